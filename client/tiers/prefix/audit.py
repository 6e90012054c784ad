"""The prefix tier's audit: a sampled row that a stored prefix would serve is computed whole instead, and the
stored blocks of its prefix (every layer's keys and values, the last hidden states) are compared with the
forward's, block by block (``attnstore_client.audit``).

Values of prefix blocks come from writers (``PutPrefix``), like written-back rows. The first block out of
tolerance is reported by its chain hash and quarantined at the daemon, which names its writer (the token that put
it; ``AttnCache.audit_findings``): every chain through it then ends before it, for every node, until an admin
releases it. The caller gets the computed row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from attnstore.protocol.prefix import PrefixLayout
from attnstore_client.adapters.batch import batch_from_ids
from attnstore_client.call.rows import Row
from attnstore_client.call.state import Call
from attnstore_client.connection import PrefixStream
from attnstore_client.tiers.base import TierContext


def audit_prefix(
    context: TierContext, call: Call, row: Row, chain: Sequence[bytes], layout: PrefixLayout, stream: PrefixStream,
    position: int,
) -> torch.Tensor:
    """Compute ``row`` whole, compare its stored prefix (``chain``'s blocks, row ``position`` of ``stream``) with
    the forward's block by block, report the first wrong block; the row's last hidden states ``(L, hidden)``.

    Raises:
        MapsUnavailableError: the stream could not give the row's stored prefix (the caller drops the row).
    """
    adapter = context.adapter
    batch = batch_from_ids([row.tokens], adapter.loaded.tokenizer.pad_token_id).to(context.device)
    cache = DynamicCache()
    with torch.inference_mode():
        output = adapter.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                               past_key_values=cache, use_cache=True)
    layers = [cast(DynamicLayer, layer) for layer in cache.layers]  # a plain DynamicCache's own layers
    size, tolerance = layout.block_size, context.audit.tolerance
    worst: list[tuple[float, float]] = [(1.0, 0.0)] * len(chain)  # per block: least cosine, largest share
    parts = [(stream.layer(position, layer),  # (2, KVH, p, d) stored
              torch.stack([cast(torch.Tensor, layers[layer].keys)[0], cast(torch.Tensor, layers[layer].values)[0]]))
             for layer in range(len(layers))]  # fresh (2, KVH, P, d)
    hidden = output.last_hidden_state[0]  # (P, hidden)
    for block in range(len(chain)):
        window = slice(block * size, (block + 1) * size)
        pairs = [(stored[:, :, window].reshape(-1, stored.shape[-1]),  # (2 * KVH * bs, d)
                  fresh[:, :, window].reshape(-1, fresh.shape[-1])) for stored, fresh in parts]
        pairs.append((stream.hidden(position)[window], hidden[window]))  # (bs, hidden)
        measured = [tolerance.measure(stored, fresh) for stored, fresh in pairs]
        worst[block] = (min(m[0] for m in measured), max(m[1] for m in measured))
    call.counts.audited += 1
    wrong = next((block for block in range(len(chain)) if not tolerance.holds(*worst[block])), None)
    if wrong is not None:
        call.counts.audit_mismatches += 1
        context.audit.report(context.connection, call.settings.namespace, context.fingerprint, bytes(chain[wrong]),
                             worst[wrong], timeout=call.settings.timeout, kind="prefix")
    return hidden.float()  # (L, hidden)
