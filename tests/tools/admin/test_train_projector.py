"""``attnstore admin train-projector`` end to end: a real daemon (subprocess, real LMDB), a tiny random model.

The namespace starts as a cold start leaves it (``admin create-namespace``: no
projector) and holds what write-back stores: entries with maps, outputs and
token ids and no feature vector.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnstore.errors import AuthError, FingerprintMismatchError, ProjectorChangedError
from attnstore.protocol.records import LookupBatch, NewEntry
from attnstore.protocol.requests import lookup_request, search_request
from attnstore.protocol.v1 import attnstore_pb2 as pb
from attnstore_client.adapters import adapter_for
from attnstore_client.adapters.batch import tokenize
from attnstore_client.cache import AttnCache
from attnstore_client.connection.daemon import DaemonClient
from attnstore_client.keys import model_fingerprint, token_hash
from attnstore_client.models import LoadedModel, load_model
from attnstore_client.projector import Projector
from attnstore_client.tiers.write_back import WriteBackSettings
from attnstore_tools.admin.cold_start import create_exact_namespace
from attnstore_tools.admin.train_projector import TrainProjectorConfig, train_namespace_projector
from attnstore_tools.build.fit import FitConfig
from attnstore_tools.cli import main
from tests.support.caches import sentences, tiny_loaded
from tests.support.daemon import ADMIN_TOKEN, OTHER_WRITE_TOKEN, READ_TOKEN, WRITE_TOKEN, DaemonProcess

# One length (6 words): a bidirectional model's projector trains and calibrates on same-length inputs.
TEXTS = sentences(40, seed=11, min_words=6, max_words=6)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tiny = tiny_loaded("bert")
    folder = tmp_path_factory.mktemp("model")
    tiny.model.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def loaded(model_folder: Path) -> LoadedModel:
    return load_model(str(model_folder))  # what the command loads


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("daemon")
    process = DaemonProcess(workdir / "store", workdir).start()
    yield process
    assert process.stop() == 0, process.log()


@pytest.fixture(scope="module")
def redis_daemon(tmp_path_factory: pytest.TempPathFactory, redis_server):
    workdir = tmp_path_factory.mktemp("redis-daemon")
    process = DaemonProcess(redis_server.url(), workdir).start()
    yield process
    assert process.stop() == 0, process.log()


def _cold_namespace(daemon: DaemonProcess, loaded: LoadedModel, name: str) -> str:
    """A namespace as ``admin create-namespace`` leaves it."""
    with daemon.client(ADMIN_TOKEN) as admin:
        create_exact_namespace(admin, loaded, name)
    return name


@pytest.fixture
def namespace(daemon: DaemonProcess, loaded: LoadedModel, request: pytest.FixtureRequest) -> str:
    """A cold-start namespace of the test's own."""
    return _cold_namespace(daemon, loaded, request.node.originalname.removeprefix("test_")[:40])


def _store_rows(admin: DaemonClient, loaded: LoadedModel, namespace: str, texts: list[str]) -> list[int]:
    """Store ``texts`` as write-back stores admitted rows: maps, outputs and token ids, no feature vector."""
    batch = tokenize(loaded.tokenizer, texts)
    capture = adapter_for(loaded).capture(batch)
    entries = [
        NewEntry(maps=maps.to(torch.float16).numpy(), token_hash=token_hash(batch.row_ids(row)),
                 outputs=hidden.to(torch.float16).numpy(), token_ids=batch.row_ids(row))
        for row, (maps, hidden) in enumerate(zip(capture.maps, capture.hidden, strict=True))
    ]
    fingerprint = model_fingerprint(loaded.model, loaded.tokenizer)
    return [int(i) for i in admin.ingest(namespace, fingerprint, entries).entry_ids]


def _train(daemon: DaemonProcess, model_folder: Path, namespace: str, *extra: str) -> int:
    return main(["admin", "train-projector", "--target", f"grpc://{daemon.target}", "--token", ADMIN_TOKEN,
                 "--namespace", namespace, "--model", str(model_folder), "--no-progress", *extra])


def _near_duplicate_lookup(admin: DaemonClient, loaded: LoadedModel, namespace: str, text: str) -> pb.Match:
    """Look ``text`` up as a client does: features of the namespace's projector, the exact tier first."""
    info = admin.get_namespace(namespace)
    projector = Projector.from_safetensors_bytes(info.projector)
    batch = tokenize(loaded.tokenizer, [text])
    feature = projector.project(adapter_for(loaded).feature_source(batch))  # (1, dim)
    request = lookup_request(LookupBatch(
        namespace=namespace, fingerprint=info.fingerprint, features=feature, lengths=list(batch.lengths),
        token_hashes=[token_hash(batch.row_ids(0))], max_distance=1e6,
        projector_version=info.projector_version,
    ), want_maps=True)
    result = admin.lookup(request)
    assert result.matches[0].kind != pb.MATCH_KIND_MAP or 0 in result.maps
    return result.matches[0]


def test_a_namespace_filled_by_traffic_serves_map_hits_once_trained(
    daemon: DaemonProcess, model_folder: Path, loaded: LoadedModel, namespace: str, tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    with daemon.client(ADMIN_TOKEN) as admin:
        ids = _store_rows(admin, loaded, namespace, TEXTS)
        assert _train(daemon, model_folder, namespace, "--json", str(tmp_path / "report.json")) == 0
        report = json.loads((tmp_path / "report.json").read_text())
        assert (report["entries"], report["featured"], report["missing"]) == (len(ids), len(ids), 0)
        assert report["projector_version"] == admin.get_namespace(namespace).projector_version == 1
        listed = list(admin.iter_entries(namespace))
        assert [e.entry_id for e in listed] == ids and all(e.has_feature and e.has_maps for e in listed)
        words = TEXTS[0].split()
        near = " ".join(words[:-1] + [next(w for w in ("w2", "w3") if w != words[-1])])
        match = _near_duplicate_lookup(admin, loaded, namespace, near)
    assert (match.kind, match.entry_id) == (pb.MATCH_KIND_MAP, ids[0])  # the row it differs from in one word
    out = capsys.readouterr().out
    assert "projector: " in out and "calibration: " in out


def test_too_few_entries_with_maps_is_a_clear_error_and_changes_nothing(
    daemon: DaemonProcess, model_folder: Path, loaded: LoadedModel, namespace: str, capsys: pytest.CaptureFixture
) -> None:
    with daemon.client(ADMIN_TOKEN) as admin:
        _store_rows(admin, loaded, namespace, TEXTS[:5])
        assert _train(daemon, model_folder, namespace) == 2
        info = admin.get_namespace(namespace)
        assert (info.projector, info.projector_version) == (b"", 0)
        assert not any(e.has_feature for e in admin.iter_entries(namespace))
    error = capsys.readouterr().err
    assert "has 5 entries with maps and token ids" in error and "at least 16" in error


def _search_own_rows(
    admin: DaemonClient, loaded: LoadedModel, namespace: str, texts: list[str], version: int
) -> list[pb.Match]:
    """Search every text's vector under the namespace's projector (no exact tier), with a tiny threshold."""
    info = admin.get_namespace(namespace)
    projector = Projector.from_safetensors_bytes(info.projector)
    batch = tokenize(loaded.tokenizer, texts)
    features = projector.project(adapter_for(loaded).feature_source(batch))  # (n, dim)
    return admin.search(search_request(LookupBatch(
        namespace=namespace, fingerprint=info.fingerprint, features=features, lengths=list(batch.lengths),
        max_distance=1e-4, projector_version=version,
    )))


@pytest.mark.parametrize("backend", ["lmdb", "redis"])
def test_a_second_run_replaces_the_projector_and_refeatures_every_entry(
    backend: str, model_folder: Path, loaded: LoadedModel, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    daemon: DaemonProcess = request.getfixturevalue("daemon" if backend == "lmdb" else "redis_daemon")
    namespace = _cold_namespace(daemon, loaded, "second_run")
    with daemon.client(ADMIN_TOKEN) as admin:
        first_ids = _store_rows(admin, loaded, namespace, TEXTS[:24])
        assert _train(daemon, model_folder, namespace, "--no-calibration") == 0
        first = admin.get_namespace(namespace)
        # Traffic goes on: more rows arrive, without vectors, before the second run.
        later_ids = _store_rows(admin, loaded, namespace, TEXTS[24:])
        assert _train(daemon, model_folder, namespace, "--seed", "1", "--json", str(tmp_path / "second.json")) == 0
        second = admin.get_namespace(namespace)
        report = json.loads((tmp_path / "second.json").read_text())
        listed = list(admin.iter_entries(namespace))
        matches = _search_own_rows(admin, loaded, namespace, TEXTS, second.projector_version)
        with pytest.raises(ProjectorChangedError, match="version 2"):
            _search_own_rows(admin, loaded, namespace, TEXTS[:1], first.projector_version)
    assert (first.projector_version, second.projector_version) == (1, 2) and first.projector != second.projector
    assert [int(e.entry_id) for e in listed] == first_ids + later_ids and all(e.has_feature for e in listed)
    assert (report["entries"], report["featured"], report["missing"]) == (len(TEXTS), len(TEXTS), 0)
    # Every stored vector is the second projector's: each row's own projection finds its entry at distance 0.
    assert [(m.kind, int(m.entry_id)) for m in matches] == [(pb.MATCH_KIND_MAP, i) for i in first_ids + later_ids]
    assert max(m.distance for m in matches) < 1e-4


def test_another_model_or_a_read_token_is_refused_and_changes_nothing(
    daemon: DaemonProcess, loaded: LoadedModel, namespace: str
) -> None:
    with daemon.client(ADMIN_TOKEN) as admin:
        _store_rows(admin, loaded, namespace, TEXTS[:20])
        with pytest.raises(FingerprintMismatchError, match="train with the namespace's model"):
            train_namespace_projector(admin, tiny_loaded("bert", seed=1), namespace)
        with daemon.client(READ_TOKEN) as reader, pytest.raises(AuthError, match="PERMISSION_DENIED"):
            train_namespace_projector(reader, loaded, namespace)
        assert admin.get_namespace(namespace).projector_version == 0
        assert not any(e.has_feature for e in admin.iter_entries(namespace))


def test_entries_read_in_many_small_fetches_all_get_a_vector(
    daemon: DaemonProcess, loaded: LoadedModel, namespace: str
) -> None:
    config = TrainProjectorConfig(fit=FitConfig(calibration=None), fetch_entries=3, features_per_call=5,
                                  progress=False)
    with daemon.client(ADMIN_TOKEN) as admin:
        ids = _store_rows(admin, loaded, namespace, TEXTS[:20])
        report = train_namespace_projector(admin, loaded, namespace, config)
        listed = list(admin.iter_entries(namespace))
    assert (report.entries, report.featured, report.missing, report.without_tokens) == (20, 20, 0, 0)
    assert [int(e.entry_id) for e in listed] == ids and all(e.has_feature for e in listed)
    assert report.fit.calibration is None


def test_a_cold_namespace_filled_by_write_back_traffic_then_trained_serves_map_hits_to_another_node(
    daemon: DaemonProcess, model_folder: Path, loaded: LoadedModel, namespace: str
) -> None:
    url = f"grpc://{daemon.target}"
    # Node 2 sees the traffic first, then node 1: the daemon admits each row on its second caller's ask
    # (--admit-after 2) and node 1 writes it back with its maps.
    with AttnCache(loaded, url, namespace=namespace, token=OTHER_WRITE_TOKEN) as other:
        other.encode(TEXTS, batch_size=8)
    with AttnCache(loaded, url, namespace=namespace, token=WRITE_TOKEN,
                   write_back=WriteBackSettings(capture_share=1.0)) as writer:  # every batch keeps maps
        writer.encode(TEXTS, batch_size=8)
        assert writer.write_back is not None
        writer.write_back.flush(60.0)
        assert writer.write_back.stats().maps_stored == len(TEXTS)
    with daemon.client(ADMIN_TOKEN) as admin:
        assert all(e.has_maps and not e.has_feature for e in admin.iter_entries(namespace))
    assert _train(daemon, model_folder, namespace) == 0
    words = TEXTS[0].split()
    near = " ".join(words[:-1] + [next(w for w in ("w2", "w3") if w != words[-1])])
    # Node 2, after the training: the near-duplicate replays the maps node 1 wrote back.
    with AttnCache(loaded, url, namespace=namespace, token=WRITE_TOKEN, max_distance=1e6) as reader:
        reader.encode([near, TEXTS[1]])
        assert reader.last_row_kinds == ("map", "exact")
