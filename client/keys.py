"""Keys that tie a client to a namespace, from what the client holds: a loaded model, token ids as tensors.

The fingerprint decides whether stored maps are valid for a model at all, so it
covers everything that changes attention: the architecture config, the
tokenizer's vocabulary and the weights. The token hash is the exact-tier key;
it is computed by ``attnstore.protocol.keys``, the one function the daemon and
the backends use too: here only a tensor is brought to the CPU first.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from attnstore.protocol import keys
from attnstore.protocol.keys import Fingerprint, TokenHash

# Config keys that describe how a model was loaded, not what it computes.
_VOLATILE_CONFIG_KEYS = frozenset(
    {"_attn_implementation", "_attn_implementation_internal", "attn_implementation",
     "_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash",
     "use_cache", "output_attentions", "output_hidden_states", "return_dict",
     # how the weights were stored on disk (a GGUF file's): the digest of the loaded weights says what they are
     "quantization_config"}
)


def model_fingerprint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> Fingerprint:
    """Return the namespace fingerprint of a model and its tokenizer.

    sha256 over the canonical config JSON (load-time settings removed), the
    tokenizer vocabulary and a digest of every weight tensor in name order.

    Args:
        model: the loaded model (any dtype; weights are digested as fp32).
        tokenizer: its tokenizer.

    Returns:
        64 hex characters.
    """
    digest = hashlib.sha256()
    config = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    digest.update(json.dumps(config, sort_keys=True, separators=(",", ":"), default=str).encode())
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    digest.update(json.dumps(vocab, ensure_ascii=False, separators=(",", ":")).encode())
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().to(torch.float32).contiguous().numpy().tobytes())
    return Fingerprint(digest.hexdigest())


def token_hash(token_ids: Sequence[int] | torch.Tensor | np.ndarray, token_types: Sequence[int] = ()) -> TokenHash:
    """The exact-tier key of one row's token ids (no padding): ``protocol.keys.token_hash`` of them, a tensor
    (on any device) taken to the CPU first.

    ``token_types``: the row's token types when it is a text pair of a model with them (BERT's segments), which
    change its outputs: they go into the key as an extra key, so a pair never shares a key with the one text of
    the same ids (a text may hold a literal ``[SEP]``).

    Raises:
        ValueError: the ids are not one row.
    """
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    if any(token_types):
        return keys.token_hash(token_ids, extra_keys=("token_types", bytes(bytearray(token_types))))
    return keys.token_hash(token_ids)
