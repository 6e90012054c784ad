"""The compute tier, last: the model computes every row still open, and what it computed is kept.

Rows are sorted longest first and cut into forwards (``forwards``). With ``int8``
on, the rows not written back run on the namespace's int8 model (``int8``) and are
kept nowhere: the exact tiers hold only what the fp32 model computed. A row
set aside for its audit (``RowFacts.audit``) is computed in fp32 and compared
with what the store served for it (``_audit``, ``attnstore_client.audit``). Each other
computed row enters this process's exact tier (``LocalOutputs``, fp16, only
what the plain model computed: replayed rows are within the maps' fidelity,
not exact); the rows the store admitted are queued for write-back (``write_back``),
each with its own fp16 copy of its outputs, so nothing a caller does to its
results reaches the store. After each window's forwards what they freed goes back to the system once the
process's heap has grown past a slack (``attnstore_client.heap.HeapBound``).

Engines. With ``CacheSettings.engine`` other than torch, an fp32 forward that keeps no maps runs on the engine
its length band chose (``engines``): an exported OpenVINO or ONNX Runtime graph checked against the model's
forward, as a right-padded batch. The rows of a graph's bands are cut into such batches by length
(``within_padding``: at most ``GRAPH_PADDING`` of a batch's tokens padded, the room of a packed forward at most),
not packed. int8 rows run on the namespace's int8 OpenVINO graph where its plan names one and its bands chose it
(``EngineSelection.prepare_int8``). Maps and the prefix and chunk tiers stay on torch.

Write-back of maps. The model computes its rows with its own attention kernel
(``sdpa``), which never materialises the probabilities, so a row's maps cost
extra work. Only the rows that will be written back with maps pay it: the
admitted rows whose length the cost model says replay pays at
(``CostModel.replay_pays``), whose maps fit one message, and which have the
feature of their map lookup (or whose namespace has no projector yet). They
keep their maps inside their own forward (an explicit fp32 softmax of their
own q/k, fp16 as stored). Measured on all-MiniLM-L6-v2 at 1 torch thread: +6.5%
to +8.6% CPU time for a padded batch that keeps maps (docs/guides/sharing.md), so
forwards that keep maps are held to ``WriteBackSettings.capture_share`` (0.5)
of the computed tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from typing import ClassVar

import numpy as np
import torch

from attnstore.errors import ConfigError
from attnstore_client.adapters.base import Adapter
from attnstore_client.adapters.batch import within_padding
from attnstore_client.call.rows import Row
from attnstore_client.call.settings import CallSettings
from attnstore_client.call.state import Call
from attnstore_client.heap import HeapBound
from attnstore_client.int8 import Int8Models
from attnstore_client.tiers.base import Tier, TierContext
from attnstore_client.tiers.engines.selection import EngineSelection
from attnstore_client.tiers.forwards import ForwardResult, cut, run_forward
from attnstore_client.tiers.local_exact import LocalExactTier
from attnstore_client.tiers.write_back import check_write_back_dtype

log = logging.getLogger(__name__)

# Tokens a computing forward is given room for at least (each of those side by side), whatever its rows' lengths:
# forwards of short rows cut to a padded batch's room (about 1,000 tokens for log lines) took 5-8% longer per token
# than forwards of 2,048 to 4,096, which ran alike (fixed costs per op and per forward), on 2 cores of an AMD EPYC
# with AVX-512 (docs/BENCHMARKS.md, "Encode"). It is the room of sentence-transformers' batch of 32 rows of 64
# tokens. Replay forwards keep the padded batch's room: the maps they hold grow with their tokens.
LEAST_TOKENS = 2048
# The padding a graph's batch may run beyond its rows' tokens (``within_padding``): the logs' 4,246 computed rows
# ran alike at 2% and 5% (13.3 s on OpenVINO, 2 streams, batches of up to 1,024 tokens, 1% padded), and cutting
# fewer, longer batches did not pay (2,048 tokens: 13.8 s).
GRAPH_PADDING = 0.05


class ComputeTier(Tier):
    """Computes every row it is given (the last tier of a call)."""

    name: ClassVar[str] = "compute"

    def __init__(self, context: TierContext, local: LocalExactTier, engines: EngineSelection | None = None) -> None:
        self._context = context
        self._local = local
        self.engines = engines  # graph engines for fp32 forwards that keep no maps (``engines``); None: torch only
        self._int8 = Int8Models(context.adapter.loaded)  # made on a call that asks for int8, kept
        self._computed_tokens = 0  # tokens of computed rows forwarded so far
        self._capturing_tokens = 0  # of those, the ones in forwards that kept maps (held to capture_share)
        self._heap = HeapBound()  # what the forwards freed, back to the system past a slack (``heap``)

    def serve(self, rows: list[Row], call: Call) -> list[Row]:
        """See :meth:`Tier.serve`; leaves no row open."""
        self._check_dtype()
        self._heap.check()  # the first call's sets the level the slack is counted from
        keep = self._maps_to_keep(rows, call)
        int8 = self._int8_adapter(call)
        exact_rows, int8_rows = self._by_precision(rows, call) if int8 is not None else (rows, [])
        workers = self._context.side_by_side(call.settings)
        if self.engines is not None and exact_rows:
            self.engines.prepare(self._context.forwards, workers)
        if self.engines is not None and int8 is not None and int8_rows and self._context.device.type == "cpu":
            plan = call.namespace.projector.int8 if call.namespace.projector is not None else None
            if plan is not None:
                self.engines.prepare_int8(plan, int8, self._context.forwards, workers)
        parts = [(self._cut_by_engine(exact_rows, call, workers, int8=False), None),
                 (self._cut_by_engine(int8_rows, call, workers, int8=True), int8)]
        workers = min(workers, sum(len(forwards) for forwards, _ in parts))
        jobs = [partial(self._forward, forward, self._keeping(forward, keep) if adapter is None else [],
                        call.settings, workers, adapter)
                for forwards, adapter in parts for forward in forwards]
        for forward, result, approximate in self._context.forwards.run(jobs, workers):  # each as it ends, here
            call.forwarded(result.seconds, result.tokens, result.forwarded)
            call.deliver(forward, result.hidden, "miss")
            self._audit(forward, result, call)
            if approximate:  # int8 rows are neither exact outputs nor the store's
                call.counts.int8_rows += len(forward)
            elif call.settings.exact:
                for position, row in enumerate(forward):
                    self._keep_outputs(row, result.hidden.row(position), result.kept.get(position), call)
        if self.engines is not None and jobs:  # reading /proc/self/maps costs 1-4 ms: not for a window with no forward
            self.engines.drop_mapped_pages()  # the embedding rows the graphs' forwards read (``engines.runtimes``)
        self._heap.check()
        return []

    def _cut(self, rows: Sequence[Row], call: Call, workers: int) -> list[list[Row]]:
        """``rows`` longest first, cut into forwards (``forwards.cut``)."""
        if not rows:
            return []
        ordered = sorted(rows, key=lambda row: -len(row.tokens))
        return cut(ordered, call.settings, self._context.cost_model, side_by_side=workers, least_tokens=LEAST_TOKENS)

    def _cut_by_engine(self, rows: Sequence[Row], call: Call, workers: int, *, int8: bool) -> list[list[Row]]:
        """``rows`` (fp32's, or int8's) cut into forwards: those of the bands a graph runs into padded batches of
        rows of near lengths (``GRAPH_PADDING``), the others as ``_cut`` cuts them."""
        engines = self.engines
        if engines is None or not rows:
            return self._cut(rows, call, workers)
        on_graph = engines.int8_runs_on_graph if int8 else engines.runs_on_graph
        graph_rows = sorted((row for row in rows if on_graph(len(row.tokens))), key=lambda row: -len(row.tokens))
        if not graph_rows:
            return self._cut(rows, call, workers)
        graphed = {id(row) for row in graph_rows}
        longest = len(graph_rows[0].tokens)
        # Together the forwards side by side hold a packed forward's least room (1,024 tokens each on 2 streams).
        room = max(call.settings.batch_size * longest, LEAST_TOKENS) // workers
        batches = within_padding([len(row.tokens) for row in graph_rows], waste=GRAPH_PADDING, max_tokens=room)
        return [*(graph_rows[part] for part in batches),
                *self._cut([row for row in rows if id(row) not in graphed], call, workers)]

    def _int8_adapter(self, call: Call) -> Adapter | None:
        """The int8 model's adapter when the call asks for int8 and its namespace has a plan (a store not read yet
        has none: its rows are computed in fp32)."""
        projector = call.namespace.projector
        if not call.settings.int8 or projector is None or projector.int8 is None:
            return None
        return self._int8.adapter(projector.int8)

    def _by_precision(self, rows: Sequence[Row], call: Call) -> tuple[list[Row], list[Row]]:
        """The rows computed in fp32 (those written back, maps kept or not: the store keeps exact outputs only) and
        in int8."""
        written = self._context.writing_back is not None and call.settings.exact
        exact: list[Row] = []
        int8: list[Row] = []
        for row in rows:
            # An audited row is compared with the store's exact outputs: only the fp32 model's can be.
            (exact if (written and row.facts.admitted) or row.facts.audit is not None else int8).append(row)
        return exact, int8

    def _forward(
        self, forward: list[Row], keeping: list[int], settings: CallSettings, side_by_side: int,
        adapter: Adapter | None,
    ) -> tuple[list[Row], ForwardResult, bool]:
        graph = None
        if not keeping and self.engines is not None and self._context.device.type == "cpu":
            lengths, types = [len(row.tokens) for row in forward], any(row.token_types for row in forward)
            if adapter is None:
                graph = self.engines.graph_for(lengths, types)
            else:  # the int8 model's forward: the int8 graph, where its plan has one and it was chosen
                graph = self.engines.int8_graph_for(lengths, types)
        result = run_forward(self._context, forward, settings, keep=keeping, side_by_side=side_by_side,
                             adapter=adapter, graph=graph)
        return forward, result, adapter is not None

    def _audit(self, forward: Sequence[Row], result: ForwardResult, call: Call) -> None:
        """Compare the audited rows of ``forward`` with the outputs the store served for them (``audit``): the
        caller already has the forward's; a stored row out of tolerance is reported (quarantined) and counted."""
        audit = self._context.audit
        for position, row in enumerate(forward):
            stored = row.facts.audit
            if stored is None:
                continue
            row.facts.audit = None
            call.counts.audited += 1
            measured = audit.tolerance.measure(stored, result.hidden.row(position))
            if audit.tolerance.holds(*measured):
                continue
            call.counts.audit_mismatches += 1
            audit.report(self._context.connection, call.settings.namespace, self._context.fingerprint, row.key,
                         measured, timeout=call.settings.timeout)

    def _check_dtype(self) -> None:
        """A model cast away from fp32 after the cache was made writes nothing back (see ``check_write_back_dtype``)."""
        write_back = self._context.writing_back
        if write_back is None:
            return
        try:
            check_write_back_dtype(self._context.adapter.model)
        except ConfigError as exc:
            log.warning("write-back turned off: %s", exc)
            write_back.turn_off(str(exc))

    def _keep_outputs(self, row: Row, hidden: torch.Tensor, maps: torch.Tensor | None, call: Call) -> None:
        """Put a computed row in this process's exact tier, and queue it for write-back if the store admits it."""
        outputs = hidden.to(torch.float16).cpu().numpy()  # (L, hidden), its own copy: what the store keeps
        self._local.outputs.put(self._local.key(row), outputs)
        write_back = self._context.writing_back
        if write_back is None or not row.facts.admitted or row.token_types:  # the store keys a row by its ids alone
            return
        if maps is None:
            write_back.put(row.tokens, outputs)
            return
        # A feature from a projector replaced since the lookup would be refused: the maps go without it.
        facts = row.facts
        if facts.feature is None or facts.projector_version != call.namespace.version:
            write_back.put(row.tokens, outputs, maps)
        else:
            write_back.put(row.tokens, outputs, maps, facts.feature, facts.projector_version)

    def _maps_to_keep(self, rows: Sequence[Row], call: Call) -> set[int]:
        """The admitted rows whose maps are kept in their forward, to be written back with them.

        Their length is one replay pays at, their maps fit one message, and they have the
        feature of their map lookup; in a namespace without a projector every such row
        qualifies (its feature is computed once a projector is trained).
        """
        write_back = self._context.writing_back
        adapter = self._context.adapter
        if write_back is None or not call.settings.exact or not adapter.capabilities.can_replay:
            return set()
        per_token = 2 * adapter.num_layers * adapter.num_heads  # fp16 bytes per L*L
        limit = write_back.settings.max_row_map_bytes
        return {
            row.index for row in rows
            if row.facts.admitted and not row.token_types
            and (call.namespace.projector is None or row.facts.feature is not None)
            and per_token * len(row.tokens) ** 2 <= limit
            and self._context.cost_model.replay_pays(len(row.tokens))
        }

    def _keeping(self, forward: Sequence[Row], keep: set[int]) -> list[int]:
        """The positions of ``forward`` whose maps it keeps: those in ``keep`` while forwards that kept maps hold
        at most ``capture_share`` of the computed tokens so far (past it the rows go back with outputs only), so
        the capture's cost stays a bounded share of the compute tier."""
        tokens = int(np.sum([len(row.tokens) for row in forward]))
        keeping = [position for position, row in enumerate(forward) if row.index in keep]
        write_back = self._context.writing_back
        within = write_back is not None and (
            self._capturing_tokens <= write_back.settings.capture_share * self._computed_tokens
        )
        self._computed_tokens += tokens
        if not keeping or not within:
            return []
        self._capturing_tokens += tokens
        return keeping
