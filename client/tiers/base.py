"""The tier interface: given a call's rows still open, serve some and leave the rest open.

Every tier of a call (``local_exact``, ``store_exact``, ``prefix``, ``maps``,
``compute``) implements ``Tier.serve``: it hands the rows it serves to
``Call.deliver`` (their last hidden states, with a kind) and returns the rows
it leaves open, in the order it was given them. A tier that cannot serve a row
it should have (the store failed) marks it with ``Call.fail`` and leaves it
open: the rows left after the last tier that asks the store are computed.
``Prefill`` times each ``serve``; a tier counts its hits in ``Call.counts``.

What every tier shares lives in ``TierContext``: the model, the store, the
breaker, the cost model and the write-back worker; ``ask_store`` is the one
way a tier calls the store (retries within the deadline, the breaker told,
failures counted as fallbacks).
"""

from __future__ import annotations

import logging
import random
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

import torch

from attnstore.errors import AttnStoreError
from attnstore_client.adapters import Adapter
from attnstore_client.audit import AuditLog
from attnstore_client.call.rows import NamespaceView, Row
from attnstore_client.call.settings import CallSettings
from attnstore_client.call.state import Call
from attnstore_client.connection import StoreConnection
from attnstore_client.resilience import CircuitBreaker, call_with_retries, cause_of
from attnstore_client.tiers.cost_model import CostModel
from attnstore_client.tiers.forward_pool import ForwardPool
from attnstore_client.tiers.write_back import WriteBackWorker

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class TierContext:
    """What the tiers of one ``AttnCache`` share across calls; made once, before the tiers, and never changed.

    What may change between calls is not held here but read when a tier needs it: the device from the model
    (``AttnCache.to`` moves it), the cost model through ``cost_models`` (``AttnCache.cost_model`` replaces it).

    Attributes:
        adapter: the model's adapter.
        connection: the store.
        fingerprint: the model's fingerprint (checked against the namespace by the cache).
        breaker: shared by every call.
        cost_models: the cost model the next call uses (it decides which rows are sent for maps, and how
            forwards are cut).
        write_back: where computed rows the store admits go; None: nowhere (see ``writing_back``).
        forwards: the threads packed forwards run on side by side (``forward_pool``).
        reload_namespace: reads the namespace again when a search is told its projector was replaced and returns
            the new view, which the call adopts (``Call.namespace``; the cache takes its threshold and gate from
            the view the call ended with); it changes nothing else. None leaves that a failed call.
    """

    adapter: Adapter
    connection: StoreConnection
    fingerprint: str
    breaker: CircuitBreaker
    cost_models: Callable[[], CostModel]
    write_back: WriteBackWorker | None = None
    forwards: ForwardPool = field(default_factory=ForwardPool)
    reload_namespace: Callable[[], NamespaceView] | None = None
    rng: random.Random = field(default_factory=lambda: random.Random(0))  # retry jitter
    audit: AuditLog = field(default_factory=AuditLog)  # which served rows to audit, and what the audits found

    @property
    def device(self) -> torch.device:
        """Where the model runs (its weights' device)."""
        return next(self.adapter.model.parameters()).device

    @property
    def cost_model(self) -> CostModel:
        """The cost model of the call running now."""
        return self.cost_models()

    @property
    def writing_back(self) -> WriteBackWorker | None:
        """The write-back worker the tiers keep rows for; None when write-back is off or was turned off
        (``WriteBackWorker.turn_off``)."""
        return None if self.write_back is None or self.write_back.turned_off else self.write_back

    def side_by_side(self, settings: CallSettings) -> int:
        """How many packed forwards run at once: as many as torch has threads, on the CPU and where the call
        lets them (``CallSettings.side_by_side``); else 1."""
        if not (settings.side_by_side and settings.packed and self.device.type == "cpu"):
            return 1
        return torch.get_num_threads()

    def to_device(self, array: object) -> torch.Tensor:
        """A numpy array as an fp32 tensor on the device: through pinned memory to a GPU."""
        tensor = torch.as_tensor(array)
        if self.device.type != "cpu":
            tensor = tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.float()


class Tier(ABC):
    """One way of serving rows, asked only for the rows still open."""

    # The tier's name, its module's ("maps", "compute"...), keying its time in ``CacheStats.tier_s``; how it served a
    # row is the row's ``RowKind`` ("map", "miss"...), which the tallies, the stats and the node's metrics count.
    name: ClassVar[str]

    @abstractmethod
    def serve(self, rows: list[Row], call: Call) -> list[Row]:
        """Serve what this tier can of ``rows`` (through ``call.deliver``); return the rows left open."""


def ask_store(context: TierContext, call: Call, ask: Callable[[float | None], T], rows: Sequence[Row]) -> T | None:
    """A store call with retries, as the breaker allows; None when it was not made or failed.

    Then ``rows`` are marked failed and the store is not asked again in this call
    (``call.store_down`` says why). The breaker hears the outcome of every call it
    let through, so a half-open breaker's trial always ends.
    """
    if call.store_down is None and not context.breaker.allow():
        call.store_down = "circuit_open"
    if call.store_down is not None:
        call.fail(rows, call.store_down)
        return None
    started = time.perf_counter()
    try:
        result = call_with_retries(ask, call.settings.retry, timeout=call.settings.timeout, rng=context.rng)
    except AttnStoreError as exc:
        log.warning("store call failed, computing %d rows: %s", len(rows), exc)
        context.breaker.record_failure()
        call.store_down = cause_of(exc)
        call.fail(rows, call.store_down)
        return None
    except BaseException:
        context.breaker.record_failure()  # the trial (if this was one) must end
        raise
    finally:
        call.counts.lookup_s += time.perf_counter() - started
    context.breaker.record_success()
    return result
