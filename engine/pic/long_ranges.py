"""A linear layer's long computed ranges in one or two fla varlen calls, not one call each.

In the fused prefill's seam chain (engine.pic.seam_chain_layer, `linear_layer_chain`) a computed
range longer than CHAIN_MAX_TOKENS runs fla's chunk kernel between chain launches. A
request whose missing segments are computed in context (`PicConfig.miss_path="context"`)
has one such range per miss, and each fla call costs ~1.7 ms of host time on the H200
(session 7 profile: 36 calls, 60 ms of a 123 ms host pass), so a layer of a request with
four misses spent ~7 ms launching while its device work took less: the request was
host-bound. With two or more long ranges in a layer they now take:

1. `run_from_zero`: every long range from zero state, in ONE varlen call over the layer's
   computed inputs as they lie (the ranges between them ride along as their own
   sequences, their results unused): each range's end state from zero E and its
   transition T (scalar/diag: log-decay sums; delta: the dense operator, from the same
   call: the columns of a delta state evolve independently, so a range started at
   [0 | I] with values [v | 0] ends at [E | T]). The chain then steps over a long range
   as the composition S = T S + E (float32; exact in exact arithmetic), keeping the
   state the range starts from.
2. `outputs`: every long range's outputs from its start state S. Scalar and diagonal
   decay need no second call: a start state adds `scale (q_t * exp(G_t)) S` to the
   zero-start output of step 1, G_t the log decays summed from the range's first token
   through t (the identity `linear_ops.chunked_recurrence` uses between chunks). The
   delta rule's dependence on S runs through every token's transition, so it takes ONE
   more varlen call from the start states.

`BATCH_FAMILIES` names the families that take this path by default: the delta rule only.
Scalar decay batched has not beaten one call per range on the H200 (docs/BENCHMARKS.md,
session 8; ring-bench, 4 misses of 8 documents, bf16, `tools/check_long_ranges_gpu.py`):
the one-call form took 117-118 ms in two runs, one call per range 79 ms in the first and
96-154 ms (drifting) in the second, full recompute 97 ms; the same form with fla's own
varlen state pass (a device read per call, engine.models.layers.fla_backend) 121 ms. The
two paths' last-position logits differ by up to 0.11 (of 4.0; bf16, random weights),
against 1e-5 in float32 (tests/engine/pic). `bench_serving --long-range-families all`
batches every family. `BATCH_LONG_RANGES` (module flag) turns the path off altogether.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from engine.models.layers import fla_backend
from engine.models.layers.linear_ops import RecurrenceInputs, apply_transition, chunked_recurrence

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


def delta_operators(inp: RecurrenceInputs, ranges: Sequence[tuple[int, int]], backend: str = "fla",
                    chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(T `[n, H, dk, dk]`, E `[n, H, dk, dv]`, float32) of each delta-rule range of `inp`
    run from zero state, ranges sorted and disjoint: a range started at [0 | I] with values
    [v | 0] ends at [E | T] (T as HYPIC computes it: from S0 = I with v = 0). On fla ONE
    varlen call for every range; on torch one chunked recurrence per range. The alone
    pass's tails (engine.pic.compute) and the context capture's (engine.pic.capture)."""
    b, t, h, kd, vd = inp.shape
    v = torch.cat([inp.v, inp.v.new_zeros(b, t, h, kd)], dim=-1)
    eye = torch.eye(kd, dtype=torch.float32, device=v.device)
    if backend != "fla":
        s0 = torch.zeros(1, h, kd, vd + kd, dtype=torch.float32, device=v.device)
        s0[..., vd:] = eye
        wide = replace(inp, v=v)
        st = torch.cat([chunked_recurrence("delta", wide.slice_time(a, e), s0, chunk_size)[1] for a, e in ranges])
        return st[..., vd:], st[..., :vd]
    cu, rows = _layout(ranges, inp.q.shape[1])
    s0 = torch.zeros(len(cu) - 1, h, kd, vd + kd, dtype=torch.float32, device=v.device)
    s0[rows, ..., vd:] = eye
    st = fla_backend.fla_chunk("delta", replace(inp, v=v), s0, cu_seqlens=cu)[1][rows]
    return st[..., vd:], st[..., :vd]


@dataclass
class FromZero:
    """A layer's long ranges run from zero state (`run_from_zero`): each range's (T, E),
    T in `linear_ops.transition_operator`'s form without the batch dim and E `[H, dk, dv]`
    float32; for scalar/diagonal decay also the outputs from zero `[1, C, H, dv]`."""

    ops: list[tuple[torch.Tensor, torch.Tensor]]
    zero_out: Optional[torch.Tensor] = None


def run_from_zero(family: str, inp: RecurrenceInputs, ranges: Sequence[tuple[int, int]]) -> FromZero:
    """Step 1 (module docstring) for the ranges of `inp` (`[1, C, ...]`), sorted and disjoint."""
    if family == "delta":
        T, E = delta_operators(inp, ranges)
        return FromZero(list(zip(T.unbind(0), E.unbind(0))))
    cu, rows = _layout(ranges, inp.q.shape[1])
    o, st = fla_backend.fla_chunk(family, inp, None, cu_seqlens=cu)
    st = st[rows]
    g = inp.log_decay[0].to(torch.float32)  # [C, H] or [C, H, dk]
    return FromZero([(g[a:b].sum(dim=0), st[i]) for i, (a, b) in enumerate(ranges)], o)


def step_over(family: str, op: tuple[torch.Tensor, torch.Tensor], state: torch.Tensor) -> torch.Tensor:
    """The state after a range whose (T, E) is `op`, from `state` `[H, dk, dv]`."""
    T, E = op
    return apply_transition(family, T, state.to(torch.float32)) + E


def outputs(family: str, inp: RecurrenceInputs, ranges: Sequence[tuple[int, int]], run: FromZero,
            starts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Step 2 (module docstring): outputs `[1, C, H, dv]` of every range run from its start
    state (`[H, dk, dv]` each); rows outside the ranges are not meaningful."""
    if run.zero_out is None:
        return _outputs_from_starts(family, inp, ranges, starts)
    return with_start_states(family, inp, ranges, run.zero_out, starts)


def with_start_states(family: str, inp: RecurrenceInputs, ranges: Sequence[tuple[int, int]],
                      zero_out: torch.Tensor, starts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Scalar/diagonal decay: the ranges' zero-start outputs plus each start state's share,
    `scale (q_t * exp(G_t)) S` (float32, then the outputs' dtype); in place."""
    if family not in ("scalar", "diag"):
        raise ValueError(f"family={family!r}: only scalar and diagonal decay have closed-form start states")
    for (a, b), s in zip(ranges, starts):
        G = inp.log_decay[0, a:b].to(torch.float32).cumsum(dim=0)  # [L, H] or [L, H, dk]
        decay = G.exp()[..., None] if family == "scalar" else G.exp()
        q = inp.q[0, a:b].to(torch.float32) * decay * inp.scale  # [L, H, dk]
        o = zero_out[0, a:b].to(torch.float32) + torch.einsum("lhk,hkv->lhv", q, s.to(torch.float32))
        zero_out[0, a:b] = o.to(zero_out.dtype)
    return zero_out


def _outputs_from_starts(family: str, inp: RecurrenceInputs, ranges: Sequence[tuple[int, int]],
                         starts: Sequence[torch.Tensor]) -> torch.Tensor:
    """ONE varlen call with every range's start state (the delta rule)."""
    cu, rows = _layout(ranges, inp.q.shape[1])
    _, _, h, kd, vd = inp.shape
    s0 = torch.zeros(len(cu) - 1, h, kd, vd, dtype=torch.float32, device=inp.v.device)
    s0[rows] = torch.stack([s.to(torch.float32) for s in starts])
    return fla_backend.fla_chunk(family, inp, s0, cu_seqlens=cu)[0]
