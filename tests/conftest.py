"""Shared pytest fixtures. Engineers append their own; slow ones are session-scoped."""

from __future__ import annotations

import os

import pytest

# Never reach a model hub from the tests: the real models are packaged wheels.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def minilm_model():
    """all-MiniLM-L6-v2 (BERT), loaded once per test session: a ``LoadedModel``."""
    from attnstore_client.models import load_model

    return load_model("minilm")


@pytest.fixture(scope="session")
def smollm2_model():
    """SmolLM2-135M-Instruct (Llama, GQA), loaded once per test session (about 20 s): a ``LoadedModel``."""
    from attnstore_client.models import load_model

    return load_model("smollm2")
