"""Server reflection, both ``grpc.reflection.v1`` and ``v1alpha``.

grpcio-reflection ships only v1alpha, while current clients (grpcurl, Postman)
ask for v1 first. The two protocols have the same messages and field numbers
under another package name, so v1's descriptor is derived from v1alpha's (and
added to the default pool, so reflection can describe itself) and one servicer
answers both. Reflection reveals the service schema only; auth leaves it open.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb

V1ALPHA_SERVICE = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
V1_SERVICE = "grpc.reflection.v1.ServerReflection"
REFLECTION_SERVICES: tuple[str, ...] = (V1_SERVICE, V1ALPHA_SERVICE)

_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _add_v1_descriptor() -> None:
    """Add v1's file descriptor to the default pool (once per process)."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{proto.package}.", ".grpc.reflection.v1."
    proto.name, proto.package = _V1_FILE, "grpc.reflection.v1"
    proto.options.Clear()  # v1alpha's are deprecated=true and its language packages
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):
                field.type_name = field.type_name.replace(old, new)
    for method in proto.service[0].method:
        method.input_type = method.input_type.replace(old, new)
        method.output_type = method.output_type.replace(old, new)
    pool.Add(proto)


def enable_reflection(service_names: Sequence[str], server: grpc.Server) -> None:
    """Serve reflection v1 and v1alpha on ``server`` for ``service_names`` (the reflection services are added)."""
    _add_v1_descriptor()
    servicer = reflection.ReflectionServicer((*service_names, *REFLECTION_SERVICES))
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha_pb.ServerReflectionRequest.FromString,
        response_serializer=v1alpha_pb.ServerReflectionResponse.SerializeToString,
    )
    methods = {"ServerReflectionInfo": handler}
    server.add_generic_rpc_handlers(
        tuple(grpc.method_handlers_generic_handler(name, methods) for name in REFLECTION_SERVICES)
    )
