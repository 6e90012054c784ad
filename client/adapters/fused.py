"""oneDNN's fp32 linear kernels with prepacked weights, the MLP's activation fused in, for packed forwards on CPU.

A forward of an encoder such as all-MiniLM-L6-v2 spends about three quarters of
its time in linear layers. PyTorch runs ``nn.Linear`` as a BLAS GEMM that reads
the weight in its stored layout at every call, then the MLP's activation as a
second pass over its widest tensor. oneDNN, already in every CPU build of torch
(``torch.ops.mkldnn._linear_pointwise``, what ``torch.compile`` with weight
freezing emits), takes a weight reordered once into its blocked layout and
applies an activation inside the GEMM. Same fp32 arithmetic, another summation
order: outputs move by about 1e-6.

``FusedLinears`` reorders a model's linear weights once (a second copy of them:
+85 MiB for all-MiniLM-L6-v2) and, for the duration of a call, routes every
``nn.Linear`` through those kernels and fuses the activations it knows
(BERT's exact GELU). Measured in ``docs/BENCHMARKS.md`` ("Encode"); used only
where oneDNN is available, the model runs on the CPU in fp32, and (``onednn_pays``)
the CPU runs AVX-512: on an AMD EPYC with AVX2, MKL's GEMMs run the same forwards
17-18% faster.

oneDNN builds (JIT-compiling) and keeps a kernel, with its buffers, per input
shape, about 0.6 MiB each, and a packed forward's token count is new at nearly
every forward: unrounded, a 67,349-row call grew the process by 0.7 GB. So every
count runs rounded up (``padded_tokens``): the adapter pads a packed forward
once, with filler rows (``packed.with_filler``), and a linear layer pads only an
input whose count is still unrounded (the query/key projections of a forward's
computing rows when others replay).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional

# Activation modules oneDNN fuses into the GEMM before them, by the attr name its kernel takes.
_FUSABLE: Mapping[str, str] = {"GELUActivation": "gelu"}


def fused_linears_available(model: nn.Module) -> bool:
    """Whether ``model`` can use oneDNN's kernels: torch has them, and the model is on the CPU in fp32."""
    parameter = next(model.parameters())
    return (torch.backends.mkldnn.is_available() and parameter.device.type == "cpu"
            and parameter.dtype == torch.float32)


def padded_tokens(tokens: int) -> int:
    """``tokens`` rounded up to a multiple of 64, or of 1/32 to 1/64 of it from 4,096 tokens on: at most 64
    counts below 4,096 and 32 per doubling above; a rounded count rounds to itself."""
    step = max(64, 1 << max(0, tokens.bit_length() - 6))
    return -(-tokens // step) * step


def onednn_pays() -> bool:
    """Whether oneDNN's kernels beat torch's own (BLAS) on this CPU: where torch runs AVX-512 code.

    Measured on whole packed forwards of log lines (``docs/BENCHMARKS.md``, "Encode"): on an Intel Xeon with
    AVX-512 they were the faster; on an AMD EPYC (Zen 3, AVX2) MKL's GEMMs ran the same forwards 17-18%
    faster, on two threads and side by side on one each. Timing single layers at start-up could not tell:
    from one process to the next it put oneDNN anywhere from 10% ahead to 20% behind on that EPYC.
    """
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


class FusedLinears:
    """The linear layers of ``model`` on oneDNN's kernels, installed for one call at a time.

    Args:
        model: an fp32 model on the CPU; its weights are reordered once, here.
        fused: modules whose ``forward`` is a linear layer then a fusable activation (``dense`` then
            ``intermediate_act_fn``, as BERT's intermediate), each given with its linear layer.
    """

    def __init__(self, model: nn.Module, fused: Mapping[nn.Module, nn.Linear]) -> None:
        self._linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
        with torch.no_grad():
            self._packed = {id(m): torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), None)
                            for m in self._linears}
        self._fused = {owner: (linear, _FUSABLE[type(act).__name__])
                       for owner, linear in fused.items()
                       if isinstance(linear, nn.Linear)  # not one quantised to int8 (``int8``)
                       and (act := getattr(owner, "intermediate_act_fn", None)) is not None
                       and type(act).__name__ in _FUSABLE}
        self._lock = threading.Lock()
        self._users = 0  # blocks of ``installed`` running

    def _kernel(self, linear: nn.Linear, attr: str = "none") -> Callable[[torch.Tensor], torch.Tensor]:
        packed, bias = self._packed[id(linear)], linear.bias
        scalars: list[float] = []
        algorithm = "none" if attr == "gelu" else ""  # GELU by its erf, as nn.GELU computes it

        def forward(x: torch.Tensor) -> torch.Tensor:
            tokens = x.shape[-2]
            extra = padded_tokens(tokens) - tokens
            if extra:
                x = functional.pad(x, (0, 0, 0, extra))
            out = torch.ops.mkldnn._linear_pointwise(x, packed, bias, attr, scalars, algorithm)
            return out[..., :tokens, :] if extra else out

        return forward

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Within the block, the model's linear layers (and fused activations) run on oneDNN's kernels; they
        stay installed while any thread's block runs (forwards side by side)."""
        with self._lock:
            if not self._users:
                for linear in self._linears:
                    linear.forward = self._kernel(linear)  # type: ignore[method-assign,assignment]
                for owner, (linear, attr) in self._fused.items():
                    owner.forward = self._kernel(linear, attr)
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if not self._users:
                    for module in (*self._linears, *self._fused):
                        module.__dict__.pop("forward", None)
