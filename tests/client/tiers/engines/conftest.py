"""Fixtures of the engines' tests: a tiny random BERT, and a graphs cache of each module's own (never ~/.cache's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnstore_client.models import LoadedModel
from attnstore_client.tiers.engines.graphs import CACHE_ENV
from tests.support.caches import tiny_loaded


@pytest.fixture(scope="module")
def bert() -> LoadedModel:
    return tiny_loaded("bert")


@pytest.fixture(scope="module")
def graphs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(autouse=True)
def _engines_cache(graphs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(graphs))
