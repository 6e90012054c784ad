"""Bearer tokens: the token file and the interceptor, on an in-process server."""

from __future__ import annotations

import grpc
import pytest

from attnstore.errors import AuthError, ConfigError
from attnstore.protocol.records import LookupBatch
from attnstore.protocol.requests import ingest_requests, lookup_request
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore.server.auth import (
    ADMIN_METHODS,
    SERVICE_NAME,
    BearerTokenInterceptor,
    bearer_token,
    load_tokens,
    parse_tokens,
    required_role,
)
from attnstore_client.connection.daemon import DaemonClient
from tests.support.server_fixtures import FP, LAYOUT, memory_service, served
from tests.support.stores import make_entry

ADMIN = "admin-token-aaaaaaaaaaaa"
READ = "read-token-rrrrrrrrrrrrr"
TOKENS = parse_tokens(f"# comment line\n\nadmin {ADMIN}   # trailing comment\nread {READ}\n")


def test_token_file_maps_tokens_to_roles() -> None:
    assert (TOKENS.role_of(ADMIN), TOKENS.role_of(READ), TOKENS.role_of("x" * 24)) == ("admin", "read", None)
    assert (TOKENS.count("admin"), TOKENS.count("read")) == (1, 1)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (f"writer {ADMIN}", "role 'writer' is unknown; choose one of"),
        ("admin short", "shorter than 16"),
        (f"admin {ADMIN} extra", "option 'extra' is unknown; a token line takes name=NAME and namespaces=A,B"),
        ("admin", "expected 'role token"),
        (f"admin {ADMIN} namespaces=ns", "an admin token is store-wide"),
        (f"read {READ} namespaces=a/b", "namespaces= needs a comma list of namespace names"),
        (f"read {READ} name=two words", "option 'words' is unknown"),
        (f"read {READ} name=a*b", "name 'a\\*b' must be 1-64"),
        (f"admin {ADMIN}\nread {ADMIN}", "line 2: token is listed twice"),
        ("# only comments\n", "holds no token"),
    ],
)
def test_malformed_token_files_are_refused_without_echoing_tokens(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as caught:
        parse_tokens(text, "tokens.txt")
    assert ADMIN not in str(caught.value)


def test_world_readable_token_file_is_loaded_with_a_warning(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "tokens"
    path.write_text(f"admin {ADMIN}\n")
    path.chmod(0o644)
    assert load_tokens(path).role_of(ADMIN) == "admin"
    assert "token_file_permissions" in caplog.text
    with pytest.raises(ConfigError, match="cannot read token file"):
        load_tokens(tmp_path / "missing")


def test_roles_needed_per_method() -> None:
    assert {"CreateNamespace", "Ingest", "Delete", "Compact", "Verify", "ListEntries", "SetFeatures"} <= ADMIN_METHODS
    assert {"ListQuarantine", "ReleaseQuarantine"} <= ADMIN_METHODS  # an admin judges what an audit quarantined
    assert required_role("/attnstore.v1.AttnStore/ReportMismatch") == "write"  # a read token cannot quarantine
    assert required_role("/attnstore.v1.AttnStore/SetFeatures") == "admin"
    assert required_role("/attnstore.v1.AttnStore/Ingest") == "admin"
    assert required_role("/attnstore.v1.AttnStore/Stats") == "read"
    assert required_role("/attnstore.v1.AttnStore/Lookup") == "read"
    assert required_role("/grpc.health.v1.Health/Check") is None
    assert required_role("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo") is None
    assert required_role("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo") is None


def test_bearer_token_parsing() -> None:
    assert bearer_token((("authorization", f"Bearer {READ}"),)) == READ
    assert bearer_token((("authorization", f"bearer  {READ} "),)) == READ
    assert bearer_token((("authorization", f"Basic {READ}"),)) is None
    assert bearer_token((("x-other", "Bearer abc"),)) is None
    assert bearer_token(None) is None


def test_interceptor_refuses_every_call_shape_and_lets_the_right_roles_through() -> None:
    entry = make_entry(LAYOUT, 5, 1)
    lookup = lookup_request(LookupBatch("ns", FP, entry.feature[None], [5], max_distance=0.1))
    with served(memory_service(), tokens=TOKENS) as (_, anonymous):
        target = anonymous.target
        with pytest.raises(grpc.RpcError) as unary:
            anonymous.stub.Stats(pb.StatsRequest())
        with pytest.raises(grpc.RpcError) as server_stream:
            list(anonymous.stub.Lookup(lookup))
        with pytest.raises(grpc.RpcError) as client_stream:
            anonymous.stub.Ingest(ingest_requests("ns", FP, [entry]))
        assert {unary.value.code(), server_stream.value.code(), client_stream.value.code()} == {
            grpc.StatusCode.UNAUTHENTICATED
        }
        assert anonymous.health() == "SERVING"
        with DaemonClient(target, token=READ) as reader, DaemonClient(target, token=ADMIN) as admin:
            with pytest.raises(AuthError, match="PERMISSION_DENIED.*admin token"):
                reader.ingest("ns", FP, [entry])
            assert admin.ingest("ns", FP, [entry]).entries == 1
            assert reader.lookup(lookup).matches[0].kind == pb.MATCH_KIND_MAP
            assert admin.stats().entries == reader.stats().entries == 1


def test_refused_calls_are_reported_with_the_method_and_the_code() -> None:
    refused: list[tuple[str, str]] = []
    interceptor = BearerTokenInterceptor(TOKENS, on_refused=lambda method, code: refused.append((method, code)))
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: None)

    def call(method: str, token: str | None) -> None:
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        interceptor.intercept_service(lambda _: handler, _CallDetails(f"/attnstore.v1.AttnStore/{method}", metadata))

    call("Stats", None)
    call("Lookup", "not-a-known-token-000")
    call("Delete", READ)
    call("Delete", ADMIN)
    assert refused == [
        ("Stats", "UNAUTHENTICATED"), ("Lookup", "UNAUTHENTICATED"), ("Delete", "PERMISSION_DENIED")
    ]


class _CallDetails(grpc.HandlerCallDetails):
    def __init__(self, method: str, metadata: tuple[tuple[str, str], ...]) -> None:
        self.method = method
        self.invocation_metadata = metadata


def test_replaced_tokens_take_effect_for_new_calls() -> None:
    new_read = "rotated-read-token-0000"
    with served(memory_service(), tokens=TOKENS) as (server, remote):
        server.replace_tokens(parse_tokens(f"admin {ADMIN}\nread {new_read}\n"))
        with DaemonClient(remote.target, token=READ) as old, DaemonClient(remote.target, token=new_read) as new:
            with pytest.raises(AuthError, match="UNAUTHENTICATED"):
                old.stats()
            assert new.stats().entries == 0


def test_server_without_auth_cannot_load_tokens_while_serving() -> None:
    with served(memory_service()) as (server, _), pytest.raises(ConfigError, match="without auth"):
        server.replace_tokens(TOKENS)


def test_write_role_parses_and_needs_write_for_write_back_only() -> None:
    table = parse_tokens("write " + "w" * 16 + "\nread " + "r" * 16)
    assert table.role_of("w" * 16) == "write" and table.count("write") == 1
    assert required_role(f"/{SERVICE_NAME}/WriteBack") == "write"
    assert required_role(f"/{SERVICE_NAME}/Ingest") == "admin"
    assert required_role(f"/{SERVICE_NAME}/Lookup") == "read"


def test_a_token_line_may_name_its_holder_and_limit_it_to_namespaces() -> None:
    table = parse_tokens(f"write {READ}x name=node-a namespaces=ns,logs\nadmin {ADMIN}\n")
    write, admin = table.entry_of(READ + "x"), table.entry_of(ADMIN)
    assert (write.role, write.name, write.namespaces) == ("write", "node-a", frozenset({"ns", "logs"}))
    assert admin.namespaces is None and admin.name.startswith("token-") and ADMIN not in admin.name
    assert admin.name == parse_tokens(f"read {ADMIN}").entry_of(ADMIN).name  # stable: the same token, the same name


def test_a_token_limited_to_namespaces_cannot_name_another_and_lists_only_its_own() -> None:
    service = memory_service()
    service.create_namespace("other", model="tiny-synthetic", fingerprint=FP, layout=LAYOUT)
    scoped = "scoped-token-ssssssssss"
    tokens = parse_tokens(f"admin {ADMIN}\nread {scoped} namespaces=ns\n")
    with served(service, tokens=tokens, client_token=scoped) as (_, remote):
        assert remote.get_namespace("ns").name == "ns"
        with pytest.raises(AuthError, match="PERMISSION_DENIED.*names namespace 'other'; this token may name only"):
            remote.get_namespace("other")
        entry = make_entry(LAYOUT, 6, 1)
        batch = LookupBatch("other", FP, entry.feature[None], [6], max_distance=0.1)
        with pytest.raises(AuthError, match="names namespace 'other'"):
            remote.lookup(lookup_request(batch))
        assert [n.name for n in remote.list_namespaces()] == ["ns"]
