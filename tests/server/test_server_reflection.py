"""Reflection v1 and v1alpha, open without a token (they reveal the schema only)."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from attnstore.server.auth import parse_tokens
from tests.support.server_fixtures import memory_service, served

TOKENS = parse_tokens("admin admin-token-aaaaaaaaaaaa\n")
EXPECTED = {
    "attnstore.v1.AttnStore",
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
}


def test_a_v1alpha_reflection_client_without_a_token_lists_every_service() -> None:
    with served(memory_service(), tokens=TOKENS) as (_, remote), grpc.insecure_channel(remote.target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        lookup = database.FindFileContainingSymbol("attnstore.v1.AttnStore")
    assert services == EXPECTED
    assert lookup.package == "attnstore.v1"


def test_v1_reflection_is_served_and_describes_itself() -> None:
    # v1 has v1alpha's messages under another package: the same bytes on the wire.
    requests = [
        v1alpha_pb.ServerReflectionRequest(list_services=""),
        v1alpha_pb.ServerReflectionRequest(file_containing_symbol="grpc.reflection.v1.ServerReflection"),
    ]
    with served(memory_service(), tokens=TOKENS) as (_, remote), grpc.insecure_channel(remote.target) as channel:
        call = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=v1alpha_pb.ServerReflectionRequest.SerializeToString,
            response_deserializer=v1alpha_pb.ServerReflectionResponse.FromString,
        )
        listed, described = list(call(iter(requests), timeout=10))
    assert {s.name for s in listed.list_services_response.service} == EXPECTED
    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in described.file_descriptor_response.file_descriptor_proto]
    assert files[0].package == "grpc.reflection.v1"
    assert files[0].service[0].method[0].input_type == ".grpc.reflection.v1.ServerReflectionRequest"
