"""Fixtures of the node's process tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.nodes import save_tiny_bert


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """A tiny BERT saved as a model folder a node loads, and the loaded model (for its store)."""
    folder = tmp_path_factory.mktemp("tiny-bert")
    return folder, save_tiny_bert(folder)
