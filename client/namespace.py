"""A client's view of its namespace: read at start, refused if built for another model, read again as needed.

The namespace gives a call its projector (none yet: exact tiers only), the
projector's version and, for causal models, how it stores prefix blocks. It is
read again while the store has not answered yet (as the breaker allows), while
it has no projector (every ``NAMESPACE_RETRY_SECONDS``), and when a search is
told its projector was replaced.
"""

from __future__ import annotations

import logging
import time

import torch

from attnstore.errors import AttnStoreError, FingerprintMismatchError, UnavailableError
from attnstore_client.call.rows import NamespaceView
from attnstore_client.connection import StoreConnection
from attnstore_client.projector import Projector
from attnstore_client.resilience import CircuitBreaker

log = logging.getLogger(__name__)

# A namespace unreachable at start, or without a projector yet, is asked again this often.
NAMESPACE_RETRY_SECONDS = 30.0


class NamespaceReader:
    """Reads one namespace for one model.

    Args:
        connection: the store.
        name: the namespace.
        fingerprint: the model's fingerprint; a namespace of another is refused.
        model: the model's name, for messages.
        causal: whether the model may use prefix blocks.
        device: where the projector runs.
    """

    def __init__(
        self, connection: StoreConnection, name: str, fingerprint: str, *, model: str, causal: bool,
        device: torch.device,
    ) -> None:
        self._connection = connection
        self.name = name
        self._fingerprint = fingerprint
        self._model = model
        self._causal = causal
        self.device = device
        self.view = NamespaceView()
        self._checked_at = 0.0
        self._read = False  # False while the store has not answered yet

    def read(self) -> NamespaceView:
        """Read the namespace: refuse another model's, take its projector (none yet: exact tiers only).

        Raises:
            FingerprintMismatchError, NamespaceNotFoundError, AuthError: the namespace cannot be used.
            UnavailableError: the store cannot be reached.
        """
        self._checked_at = time.monotonic()
        handle = self._connection.namespace(self.name)
        self._read = True
        if handle.fingerprint != self._fingerprint:
            raise FingerprintMismatchError(
                f"namespace {self.name!r} at {self._connection.url} was built with model {handle.model!r} "
                f"(fingerprint {handle.fingerprint[:16]}...); {self._model!r} has fingerprint "
                f"{self._fingerprint[:16]}...: a different model, tokenizer or weights, so its maps would be wrong. "
                "Build a namespace with this model, or pick the namespace built for it."
            )
        prefix = handle.prefix if self._causal else None
        if handle.projector is None:
            log.info("namespace %r has no projector yet: exact hits only until it has one", self.name)
            self.view = NamespaceView(None, 0, prefix)
        else:
            projector = Projector.from_safetensors_bytes(handle.projector).to(self.device)
            self.view = NamespaceView(projector, handle.projector_version, prefix)
        return self.view

    def refresh(self, breaker: CircuitBreaker) -> bool:
        """Read the namespace again if it is due (see the module docstring); whether it was read.

        Whatever the store answers, the breaker hears it, so a half-open breaker's trial always ends;
        and nothing it answers is raised: the store can only make a call faster.
        """
        if self.view.projector is not None:
            return False
        if self._read and time.monotonic() - self._checked_at < NAMESPACE_RETRY_SECONDS:
            return False
        if not breaker.allow():
            return False
        try:
            self.read()
        except UnavailableError as exc:
            log.info("store %s still unreachable: %s", self._connection.url, exc)
            breaker.record_failure()
            return False
        except AttnStoreError as exc:
            log.warning("namespace %r at %s cannot be used now (%s): computing every row", self.name,
                        self._connection.url, exc)
            self._read = True
            breaker.record_failure()
            return False
        breaker.record_success()
        return True
