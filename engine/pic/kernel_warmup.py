"""Warm-up of the linear layers' chunked recurrence kernels (fla) for every argument
pattern the engine's paths launch (`RecurrenceKernelWarmup`), so no request pays a
compilation or a tuning sweep.

fla's chunk kernels are autotuned Triton kernels. Triton's autotuner keys a tuning result
on the kernel's key arguments and the dtype of every tensor argument, and an optional
argument passed as None makes a different key from one passed as a tensor; each new key
compiles and times every configuration (12 for the delta rule's state kernel on an H200,
~1 s). Per linear-layer shape the engine calls fla's chunk function in these patterns
(`PATTERNS`):

| pattern             | initial state | cu_seqlens | values      | who calls it                              |
|---------------------|---------------|------------|-------------|-------------------------------------------|
| `chunk`             | None          | None       | v           | a layer run alone from zero               |
| `chunk_from_state`  | tensor        | None       | v           | prefill / a long range of a seam chain     |
| `varlen`            | None          | tensor     | v           | packed alone passes, tails from zero       |
| `varlen_from_state` | tensor        | tensor     | v           | long ranges' outputs (engine.pic.long_ranges) |
| `operators`         | tensor        | tensor     | [v \\| 0]   | long ranges' (T, E) (dense families)       |
| `transition`        | identity      | None       | 0 (dk wide) | a segment's transition T (dense families)  |

Requests alone reach the first three; `varlen_from_state` and `operators` only when a
request computes two or more long ranges in context (a QPS trial met them first: a 12-
configuration sweep inside a timed request). The warm-up runs each pattern once on
random inputs of `WARM_TOKENS` tokens (two sequences for the varlen ones) through the
layer's own projections, so shapes, dtypes and layouts are the ones requests produce.
With the kernel cache (engine.kernel_cache) a second start finds every result on disk.

Only on the fla backend (CUDA); elsewhere nothing is pending. The same modes as the
CUDA graphs (engine.runtime.prefill_graphs.BucketWarmup): `upfront` at build, `idle`
between requests, `lazy` not at all. Not thread-safe: the engine loop's thread only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.models.layers import fla_backend
from engine.models.layers.linear_base import LinearMixer
from engine.models.layers.linear_ops import RecurrenceInputs
from engine.pic import long_ranges
from engine.pic.signature import DENSE_FAMILIES
from engine.runtime.prefill_graphs import BucketWarmup

PATTERNS = ("chunk", "chunk_from_state", "varlen", "varlen_from_state", "operators", "transition")
#: tokens of each warm-up call: more than one 64-token chunk, two sequences when varlen
WARM_TOKENS = 96


@dataclass(frozen=True)
class WarmCall:
    """One pattern on one linear-layer shape (the first layer of that shape stands for all)."""

    mixer: Any
    pattern: str


def _shape_key(m: LinearMixer) -> tuple:
    return (m.family, m.num_heads, m.num_v_heads, m.key_dim, m.value_dim, type(m).__name__)


def warm_calls(model: torch.nn.Module) -> list[WarmCall]:
    """Every (layer shape, pattern) the engine's fla paths launch (module docstring), in
    layer order; none for a family fla does not serve."""
    seen: dict[tuple, LinearMixer] = {}
    for m in model.modules():
        if isinstance(m, LinearMixer) and fla_backend.has_kernel(m.family):
            seen.setdefault(_shape_key(m), m)
    calls = []
    for m in seen.values():
        for p in PATTERNS:
            if p in ("operators", "transition") and m.family not in DENSE_FAMILIES:
                continue
            calls.append(WarmCall(m, p))
    return calls


def _inputs(m: LinearMixer, device: torch.device, dtype: torch.dtype, tokens: int) -> RecurrenceInputs:
    """The recurrence inputs of `tokens` random hidden states through `m`'s projections and conv."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = (torch.randn(1, tokens, m.hidden_size, generator=gen) * 0.1).to(device=device, dtype=dtype)
    conv_in, extras = m.project(x)
    extras["positions"] = torch.arange(tokens, device=device)
    conv_out, _ = m.apply_conv(conv_in, None)
    return m.prepare(conv_out, extras)


@torch.inference_mode()
def run_call(call: WarmCall, device: torch.device, dtype: torch.dtype, tokens: int = WARM_TOKENS) -> None:
    """Launch `call`'s pattern once on random inputs (module docstring)."""
    m = call.mixer
    inp = _inputs(m, device, dtype, tokens)
    half = tokens // 2
    cu = torch.tensor([0, half, tokens], dtype=torch.long)
    state = torch.zeros(2, *m.state_shape, dtype=torch.float32, device=device)
    p = call.pattern
    if p == "chunk":
        fla_backend.fla_chunk(m.family, inp, None)
    elif p == "chunk_from_state":
        fla_backend.fla_chunk(m.family, inp, state[:1])
    elif p == "varlen":
        fla_backend.fla_chunk(m.family, inp, None, cu_seqlens=cu)
    elif p == "varlen_from_state":
        fla_backend.fla_chunk(m.family, inp, state, cu_seqlens=cu)
    elif p == "operators":
        long_ranges.delta_operators(inp, [(0, half), (half, tokens)], backend="fla", family=m.family)
    elif p == "transition":
        m.transition_operator(inp, "fla")
    else:
        raise ValueError(f"warm-up pattern {p!r} is not one of {', '.join(PATTERNS)}")


class RecurrenceKernelWarmup(BucketWarmup):
    """The fla patterns of one engine's model still to warm (module docstring); each
    "bucket" is one `WarmCall`. `backend` other than "fla": nothing to do."""

    what = "recurrence kernels"

    def __init__(self, model: torch.nn.Module, backend: str, device: torch.device, dtype: torch.dtype,
                 mode: str) -> None:
        self.calls = warm_calls(model) if backend == "fla" else []
        #: the patterns warmed, as "family/pattern"
        self.warmed: list[str] = []
        super().__init__(range(len(self.calls)), lambda i: run_call(self.calls[i], device, dtype), mode)

    def _captured(self, bucket: int, result: Any) -> None:
        c = self.calls[bucket]
        self.warmed.append(f"{c.mixer.family}/{c.pattern}")

    def snapshot(self) -> dict:
        """For /health: mode, patterns warmed and left, seconds, failure."""
        return {**self._times(), "warmed": list(self.warmed)}
