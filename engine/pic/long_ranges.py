"""A linear layer's long computed ranges in two fla varlen calls, not one call each.

In the fused prefill's seam chain (engine.pic.seam_chain_layer, `linear_layer_chain`) a computed
range longer than CHAIN_MAX_TOKENS runs fla's chunk kernel between chain launches. A
request whose missing segments are computed in context (`PicConfig.miss_path="context"`)
has one such range per miss, and each fla call costs ~1.7 ms of host time on the H200
(session 7 profile: 36 calls, 60 ms of a 123 ms host pass), so a layer of a request with
four misses spent ~7 ms launching while its device work took less: the request was
host-bound. With two or more long ranges in a layer they now take two calls:

1. `range_operators`: every long range from zero state, in ONE varlen call over the
   layer's computed inputs as they lie (the ranges between them ride along as their own
   sequences, their results unused): each range's end state from zero E and its
   transition T (scalar/diag: log-decay sums; delta: the dense operator, from the same
   call: the columns of a delta state evolve independently, so a range started at
   [0 | I] with values [v | 0] ends at [E | T]). The chain then steps over a long range
   as the composition S = T S + E (float32; exact in exact arithmetic), keeping the
   state the range starts from.
2. `range_outputs`: ONE varlen call with every long range's start state gives their
   outputs.

`BATCH_FAMILIES` names the recurrence families that take this path: the delta rule only
for now. Session 7's one run with every family batched (docs/BENCHMARKS.md, call D) had
qwen3next (delta) sustain 3.2x prefix caching's rate on the stream and ring (scalar
decay) fall to 0.35x, with per-request times above full recompute's; the two passes
cover all of a layer's computed tokens each, so a cheap recurrence gains little and the
cause was not isolated. Until `tools/check_long_ranges_gpu.py` measures each family
(batched vs one call per range, one process), scalar and diagonal decay keep one call
per range. `BATCH_LONG_RANGES` (module flag) turns the path off altogether.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from engine.models.layers import fla_backend
from engine.models.layers.linear_ops import RecurrenceInputs, apply_transition

#: run a layer's long computed ranges as two varlen calls when it has at least two
BATCH_LONG_RANGES = True
#: the recurrence families whose layers do (module docstring)
BATCH_FAMILIES = ("delta",)


def batches(family: str, long_ranges: int) -> bool:
    """Whether a layer of `family` with `long_ranges` long computed ranges takes the
    two-call path."""
    return BATCH_LONG_RANGES and family in BATCH_FAMILIES and long_ranges > 1


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


def delta_operators(inp: RecurrenceInputs, ranges: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(T `[n, H, dk, dk]`, E `[n, H, dk, dv]`, float32) of each delta-rule range of `inp`
    run from zero state, ranges sorted and disjoint, in ONE fla varlen call: a range
    started at [0 | I] with values [v | 0] ends at [E | T] (T as HYPIC computes it: from
    S0 = I with v = 0). Also the alone pass's tails (engine.pic.compute)."""
    cu, rows = _layout(ranges, inp.q.shape[1])
    b, t, h, kd, vd = inp.shape
    v = torch.cat([inp.v, inp.v.new_zeros(b, t, h, kd)], dim=-1)
    s0 = torch.zeros(len(cu) - 1, h, kd, vd + kd, dtype=torch.float32, device=v.device)
    s0[rows, ..., vd:] = torch.eye(kd, dtype=torch.float32, device=v.device)
    st = fla_backend.fla_chunk("delta", replace(inp, v=v), s0, cu_seqlens=cu)[1][rows]
    return st[..., vd:], st[..., :vd]


def range_operators(family: str, inp: RecurrenceInputs,
                    ranges: Sequence[tuple[int, int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(T, E) of each range of `inp` (`[1, C, ...]`) run from zero state, ranges sorted
    and disjoint: T in `linear_ops.transition_operator`'s form without the batch dim,
    E `[H, dk, dv]` float32."""
    if family == "delta":
        T, E = delta_operators(inp, ranges)
        return list(zip(T.unbind(0), E.unbind(0)))
    cu, rows = _layout(ranges, inp.q.shape[1])
    st = fla_backend.fla_chunk(family, inp, None, cu_seqlens=cu)[1][rows]
    g = inp.log_decay[0].to(torch.float32)  # [C, H] or [C, H, dk]
    return [(g[a:b].sum(dim=0), st[i]) for i, (a, b) in enumerate(ranges)]


def step_over(family: str, op: tuple[torch.Tensor, torch.Tensor], state: torch.Tensor) -> torch.Tensor:
    """The state after a range whose (T, E) is `op`, from `state` `[H, dk, dv]`."""
    T, E = op
    return apply_transition(family, T, state.to(torch.float32)) + E


def range_outputs(family: str, inp: RecurrenceInputs, ranges: Sequence[tuple[int, int]],
                  starts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Outputs `[1, C, H, dv]` of every range run from its start state (`[H, dk, dv]`
    each), in one varlen call; rows outside the ranges are not meaningful."""
    cu, rows = _layout(ranges, inp.q.shape[1])
    _, _, h, kd, vd = inp.shape
    s0 = torch.zeros(len(cu) - 1, h, kd, vd, dtype=torch.float32, device=inp.v.device)
    s0[rows] = torch.stack([s.to(torch.float32) for s in starts])
    return fla_backend.fla_chunk(family, inp, s0, cu_seqlens=cu)[0]
