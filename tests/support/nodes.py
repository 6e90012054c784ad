"""Nodes for the node tests: a tiny model saved as a model folder, and ``attnstore node`` as a real process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Self

import httpx

from attnstore.protocol.records import NamespaceLayout
from attnstore.service import AttnStoreService
from attnstore_client.adapters import adapter_for
from attnstore_client.keys import model_fingerprint
from attnstore_client.models import LoadedModel, load_model
from attnstore_client.tiers.prefix import capture_prefix_blocks, prefix_layout_of
from attnstore_tools.build.namespace_layout import exact_tier_layout
from tests.support.adapters import save_tiny_decoder
from tests.support.caches import tiny_loaded
from tests.support.wait import wait_until

API_KEY = "node-key-0123456789abcdef"
# Requests the ended calls held, in all: the counter a call's own metrics are counted beside (node/batcher.py).
_COUNTED_REQUESTS = "attnstore_node_call_requests_sum"
_LOG_TAIL_CHARS = 6000


def save_tiny_bert(folder: Path) -> LoadedModel:
    """The tiny random BERT of the cache tests, with its word tokenizer, saved as a model folder (``--model``);
    returns it as loaded back from there."""
    if not (folder / "config.json").exists():
        loaded = tiny_loaded("bert")
        loaded.model.save_pretrained(folder)
        loaded.tokenizer.save_pretrained(folder)
    return load_model(str(folder))


def tiny_store(path: Path, loaded: LoadedModel, namespace: str = "default") -> str:
    """An embedded store at ``path`` with an exact-tier-only namespace for ``loaded``; its ``local:`` URL."""
    service = AttnStoreService.open(path, create=True)
    try:
        service.create_namespace(namespace, model=loaded.name,
                                 fingerprint=model_fingerprint(loaded.model, loaded.tokenizer),
                                 layout=exact_tier_layout(loaded))
    finally:
        service.close()
    return f"local:{path}"


def save_tiny_llama(folder: Path) -> LoadedModel:
    """A tiny random Llama with MiniLM's tokenizer (its whole vocabulary, so any text fits), saved as a model
    folder; returns it as loaded back from there."""
    if not (folder / "config.json").exists():
        save_tiny_decoder(folder, full_vocab=True)
    return load_model(str(folder))


def decoder_store(path: Path, loaded: LoadedModel, prefixes: Sequence[Sequence[int]] = (), *, block: int = 8,
                  namespace: str = "default") -> str:
    """An embedded store at ``path`` with a causal namespace for ``loaded`` holding the prefix blocks of
    ``prefixes`` (token rows; blocks of ``block`` tokens); its ``local:`` URL."""
    adapter = adapter_for(loaded)
    service = AttnStoreService.open(path, create=True)
    try:
        service.create_namespace(namespace, model=loaded.name,
                                 fingerprint=model_fingerprint(loaded.model, loaded.tokenizer),
                                 layout=NamespaceLayout(layers=adapter.num_layers, heads=adapter.num_heads, causal=True,
                                                        hidden=adapter.hidden_size, feature_dim=16))
        layout = service.store.prefixes.set_layout(namespace, prefix_layout_of(adapter, block_size=block))
        pad = loaded.tokenizer.pad_token_id or 0
        if prefixes:
            for blocks in capture_prefix_blocks(adapter, [list(row) for row in prefixes], layout, pad_id=pad):
                service.store.prefixes.put(namespace, blocks)
    finally:
        service.close()
    return f"local:{path}"


class NodeProcess:
    """One ``attnstore node`` subprocess on a free loopback port.

    Args:
        model: ``--model``.
        store: ``--store``.
        workdir: where its ready file, log and key file go.
        args: more ``node`` arguments.
        keys: serve with a key file holding ``API_KEY``.
    """

    def __init__(
        self, model: str, store: str, workdir: Path, *, args: Sequence[str] = (), keys: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self._env = dict(env or {})  # the node's environment beyond this process's
        self.ready_file = workdir / "node-ready.json"
        self.log_path = workdir / "node.log"
        # No sampled audit unless a test asks for one (a later --audit-rate in ``args`` wins): the node's default
        # audits 1% of served rows at random, computing them whole, so a test counting rows by tier would read one
        # fewer now and then (CI read 3 of 4 prefix rows).
        self._command = [sys.executable, "-m", "attnstore_tools.cli", "node", "--model", model, "--store", store,
                         "--listen", "127.0.0.1:0", "--ready-file", str(self.ready_file), "--audit-rate", "0", *args]
        if keys:
            key_file = workdir / "keys.txt"
            key_file.write_text(f"# test keys\ntests {API_KEY}\n", encoding="utf-8")
            key_file.chmod(0o600)
            self._command += ["--api-key-file", str(key_file)]
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> Self:
        """Start the node and wait for its ready file (the model is loaded); returns ``self``.

        Raises:
            RuntimeError: it exited or was not ready in time (killed then); the message ends with its log.
        """
        self.ready_file.unlink(missing_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **self._env}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(self._command, stdout=log, stderr=subprocess.STDOUT, env=env)
        process = self.process

        def ready() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"the node exited with {process.returncode} at start{self._tail()}")
            return self.ready_file.exists()

        try:
            wait_until(ready, timeout, "the node's ready file", poll=0.05)
        except AssertionError:
            self.kill()
            raise RuntimeError(f"the node was not ready within {timeout:g} s{self._tail()}") from None
        self.port = json.loads(self.ready_file.read_text(encoding="utf-8"))["port"]
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send ``sig`` and wait; returns the exit code."""
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(f"the node did not exit within {timeout:g} s{self._tail()}") from None

    def kill(self) -> None:
        """SIGKILL the node if it still runs."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def metric(self, sample: str) -> float:
        """One sample of the node's ``/metrics``, named as exposed with its labels (for instance
        ``attnstore_node_rows_total{tier="prefix"}``); 0 when the node exposes no such sample."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        match = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    @contextmanager
    def counting(self, requests: int = 1, timeout: float = 60.0) -> Iterator[None]:
        """Around ``requests`` requests that the node queues: on leaving, wait until the calls that served them
        are counted. Rows reach their request as they are served, so an answer can arrive a moment before its
        call's metrics (rows by tier, forward tokens) are; a test reading those after an answer waits here."""
        before = self.metric(_COUNTED_REQUESTS)
        yield
        wait_until(lambda: self.metric(_COUNTED_REQUESTS) >= before + requests, timeout,
                   f"the node's calls counting {requests} more request(s)")

    def log(self) -> str:
        """The node's log so far."""
        return self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path.exists() else ""

    def _tail(self) -> str:
        return f"; its log, {self.log_path}:\n{self.log()[-_LOG_TAIL_CHARS:]}"
