"""A delta-rule layer's long computed ranges in two fla varlen calls, not one call each.

In the fused prefill's seam chain (engine.pic.seam_chain_layer, `linear_layer_chain`) a computed
range longer than CHAIN_MAX_TOKENS runs fla's chunk kernel between chain launches. A
request whose missing segments are computed in context (`PicConfig.miss_path="context"`)
has one such range per miss, and each fla call costs ~1.7 ms of host time on an H200
(a profile of an alone pass: 36 calls, 60 ms of a 123 ms host pass), so a layer of a
request with four misses would spend ~7 ms launching while its device work takes less.
With two or more long ranges in a layer they take:

1. `run_from_zero`: every long range from zero state, in ONE varlen call over the layer's
   computed inputs as they lie (the ranges between them ride along as their own
   sequences, their results unused): each range's end state from zero E and its dense
   transition T from the same call (the columns of a delta state evolve independently,
   so a range started at [0 | I] with values [v | 0] ends at [E | T]). The chain then
   steps over a long range as the composition S = T S + E (float32; exact in exact
   arithmetic), keeping the state the range starts from.
2. `outputs`: every long range's outputs from its start state S, in ONE more varlen
   call from the start states (the delta rule's dependence on S runs through every
   token's transition).

Only the delta rule takes this path (`batches`), and only while
`PicConfig.batch_long_ranges` is on (the default). Scalar and diagonal decay keep one fla
call per range: the same two-step form for them (one call from zero, start states added
in closed form) took 117-120 ms against 79 ms for one call per range on an H200
(ring-bench, 4 misses of 8 documents of 1400 tokens, bf16, medians of 5,
`tools/check_long_ranges_gpu.py`), and was removed (docs/pic.md, "Removed switches").
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from engine.models.layers import fla_backend
from engine.models.layers.linear_ops import RecurrenceInputs, apply_transition, chunked_recurrence

def batches(family: str, long_ranges: int, enabled: bool = True) -> bool:
    """Whether a layer of `family` with `long_ranges` long computed ranges takes the
    two-call path (`enabled`: PicConfig.batch_long_ranges)."""
    return enabled and family == "delta" and long_ranges > 1


def _layout(ranges: Sequence[tuple[int, int]], total: int) -> tuple[torch.Tensor, list[int]]:
    """cu_seqlens (CPU int64) cutting [0, total) at every range's bounds, and the
    sequence index of each range."""
    cu, rows = [0], []
    for a, b in ranges:
        if a > cu[-1]:
            cu.append(a)
        rows.append(len(cu) - 1)
        cu.append(b)
    if total > cu[-1]:
        cu.append(total)
    return torch.tensor(cu, dtype=torch.long), rows


def delta_operators(inp: RecurrenceInputs, ranges: Sequence[tuple[int, int]], backend: str = "fla",
                    chunk_size: int = 64, family: str = "delta") -> tuple[torch.Tensor, torch.Tensor]:
    """(T `[n, H, dk, dk]`, E `[n, H, dk, dv]`, float32) of each delta-rule range of `inp`
    run from zero state, ranges sorted and disjoint: a range started at [0 | I] with values
    [v | 0] ends at [E | T] (T as HYPIC computes it: from S0 = I with v = 0). On fla ONE
    varlen call for every range; on torch one chunked recurrence per range. The alone
    pass's tails (engine.pic.compute) and the context capture's (engine.pic.capture).
    `family`: `delta` or `kda` (the dense-transition families; kda through fla only where
    fla_backend.has_kernel says so, else the torch form)."""
    b, t, h, kd, vd = inp.shape
    v = torch.cat([inp.v, inp.v.new_zeros(b, t, h, kd)], dim=-1)
    eye = torch.eye(kd, dtype=torch.float32, device=v.device)
    if backend != "fla" or not fla_backend.has_kernel(family):
        s0 = torch.zeros(1, h, kd, vd + kd, dtype=torch.float32, device=v.device)
        s0[..., vd:] = eye
        wide = replace(inp, v=v)
        st = torch.cat([chunked_recurrence(family, wide.slice_time(a, e), s0, chunk_size)[1] for a, e in ranges])
        return st[..., vd:], st[..., :vd]
    cu, rows = _layout(ranges, inp.q.shape[1])
    idx = fla_backend.host_to_device(torch.tensor(rows, dtype=torch.long), v.device)  # no host sync
    s0 = torch.zeros(len(cu) - 1, h, kd, vd + kd, dtype=torch.float32, device=v.device)
    s0[idx, ..., vd:] = eye
    st = fla_backend.fla_chunk(family, replace(inp, v=v), s0, cu_seqlens=cu)[1].index_select(0, idx)
    return st[..., vd:], st[..., :vd]


@dataclass
class FromZero:
    """A delta-rule layer's long ranges run from zero state (`run_from_zero`): each range's
    (T `[H, dk, dk]`, E `[H, dk, dv]`), float32."""

    ops: list[tuple[torch.Tensor, torch.Tensor]]


def _check_delta(family: str) -> None:
    if family != "delta":
        raise ValueError(f"family={family!r}: only the delta rule's long ranges share varlen calls")


def run_from_zero(family: str, inp: RecurrenceInputs, ranges: Sequence[tuple[int, int]]) -> FromZero:
    """Step 1 (module docstring) for the ranges of `inp` (`[1, C, ...]`), sorted and disjoint."""
    _check_delta(family)
    T, E = delta_operators(inp, ranges)
    return FromZero(list(zip(T.unbind(0), E.unbind(0))))


def step_over(family: str, op: tuple[torch.Tensor, torch.Tensor], state: torch.Tensor) -> torch.Tensor:
    """The state after a range whose (T, E) is `op`, from `state` `[H, dk, dv]`."""
    T, E = op
    return apply_transition(family, T, state.to(torch.float32)) + E


def outputs(family: str, inp: RecurrenceInputs, ranges: Sequence[tuple[int, int]],
            starts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Step 2 (module docstring): outputs `[1, C, H, dv]` of every range run from its start
    state (`[H, dk, dv]` each), in ONE varlen call; rows outside the ranges are not
    meaningful."""
    _check_delta(family)
    cu, rows = _layout(ranges, inp.q.shape[1])
    _, _, h, kd, vd = inp.shape
    s0 = torch.zeros(len(cu) - 1, h, kd, vd, dtype=torch.float32, device=inp.v.device)
    s0[fla_backend.host_to_device(torch.tensor(rows, dtype=torch.long), s0.device)] = \
        torch.stack([s.to(torch.float32) for s in starts])  # a device index: no host sync
    return fla_backend.fla_chunk(family, inp, s0, cu_seqlens=cu)[0]
