"""Shared plumbing of the linear-attention layers: project -> short conv -> recurrence ->
output, with the per-slot recurrent state and conv tail in a `StateSlotCache`.

A subclass defines four small pieces, each usable on its own (position-independent caching
calls them directly):
- `project(x [B, T, D]) -> (conv_in [B, T, C] | None, extras: dict)`: input projections;
  `conv_in` is what the short conv sees (its last conv-1 rows are the conv tail).
- `apply_conv(conv_in, tail) -> (conv_out, new_tail)` (identity when the layer has no conv).
- `prepare(conv_out, extras) -> RecurrenceInputs`: q, k, v, log decays (and beta), float32
  decays; q/k already repeated to the value heads.
- `output(o [B, T, Hv, dv], extras) -> [B, T, D]`.

The forwards put the tokens' absolute positions in `extras["positions"]` (`[T]`, or
`[B, 1]` in decode) before `prepare`; a layer whose recurrence inputs depend on them
(lightning with `LinearConfig.rotary_dim`, `uses_positions`) refuses a `prepare` without
them rather than assume offset 0.

`run_recurrence(inp, state, backend, step)` runs the layer's recurrence family from a given
state and returns (o, final state), through torch (chunked form, or the single-token step)
or fla. For PIC: the end state from zero `E` is `run_recurrence(inp, None, ...)[1]`, the
transition operator is `linear_ops.transition_operator(self.family, inp)` (log-decay sums
for scalar/diag, a dense `[H, dk, dk]` for delta and kda), and a slot is read/set through
`StateSlotCache.get_state/set_state/get_conv_tail/set_conv_tail`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from engine.models.config import ModelConfig
from engine.models.layers import fla_backend
from engine.models.layers.base import DecodeContext, PrefillContext, TokenMixer
from engine.models.layers.conv import ShortConv
from engine.models.layers.linear_ops import (DENSE_FAMILIES, RecurrenceInputs, chunked_recurrence, recurrent_step,
                                             transition_operator)
from engine.models.layers.norm import l2_normalize  # noqa: F401 - re-exported (layers import it here)

if TYPE_CHECKING:
    from engine.cache.layer_caches import StateSlotCache


@dataclass
class LinearSegmentSummary:
    """A segment run alone from zero state and zero conv tail (PIC's linear signature)."""

    transition: torch.Tensor  # [H] scalar / [H, dk] diag log-decay sums, or [H, dk, dk] delta
    end_state: torch.Tensor  # E: [H, dk, dv] float32
    conv_tail: torch.Tensor | None  # [C, conv-1] last pre-conv inputs (zero-padded if n < conv-1)


class LinearMixer(TokenMixer):
    family: str = ""
    #: whether `prepare` needs `extras["positions"]` (RoPE inside the recurrence)
    uses_positions: bool = False

    def __init__(self, cfg: ModelConfig, kind: str, conv_channels: int, conv_bias: bool = False) -> None:
        super().__init__()
        lin = cfg.linear
        self.kind = kind
        self.hidden_size = cfg.hidden_size
        self.num_heads = lin.num_heads
        self.num_v_heads = lin.num_v_heads
        self.key_dim = lin.key_dim
        self.value_dim = lin.value_dim
        self.chunk_size = lin.chunk_size
        width = lin.conv_width(kind)
        self.conv = ShortConv(conv_channels, width, bias=conv_bias, float32=lin.conv_float32) \
            if width and conv_channels else None

    # ---------------------------------------------------------------- geometry
    @property
    def state_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.key_dim, self.value_dim)

    @property
    def conv_tail_shape(self) -> tuple[int, int] | None:
        return None if self.conv is None else (self.conv.channels, self.conv.width - 1)

    # ------------------------------------------------------- pieces (override)
    def project(self, x: torch.Tensor) -> tuple[torch.Tensor | None, dict]:  # pragma: no cover
        raise NotImplementedError

    def prepare(self, conv_out: torch.Tensor | None, extras: dict) -> RecurrenceInputs:  # pragma: no cover
        raise NotImplementedError

    def output(self, o: torch.Tensor, extras: dict) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    # ---------------------------------------------------------- shared pieces
    def apply_conv(self, conv_in: torch.Tensor | None,
                   tail: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.conv is None or conv_in is None:
            return conv_in, None
        return self.conv(conv_in, tail)

    def repeat_heads(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, T, Hk, d]` -> `[B, T, Hv, d]` (value head i uses key head i // (Hv/Hk), as fla)."""
        rep = self.num_v_heads // self.num_heads
        return x if rep == 1 else x.repeat_interleave(rep, dim=2)

    def run_recurrence(self, inp: RecurrenceInputs, state: torch.Tensor | None, backend: str,
                       step: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if backend == "fla" and fla_backend.has_kernel(self.family):
            fn = fla_backend.fla_recurrent if step else fla_backend.fla_chunk
            return fn(self.family, inp, state)
        if step and inp.q.shape[1] == 1:  # (fla's token-recurrent form takes any T; torch's one token)
            return recurrent_step(self.family, inp, state)
        return chunked_recurrence(self.family, inp, state, self.chunk_size)

    def transition_operator(self, inp: RecurrenceInputs, backend: str = "torch") -> torch.Tensor:
        """T of the tokens in `inp` (see linear_ops.transition_operator). For the delta rule on
        fla it runs fla's chunk kernel from S0 = I with v = 0, as HYPIC does."""
        if backend == "fla" and self.family in DENSE_FAMILIES and fla_backend.has_kernel(self.family):
            b, t, h, kd, _ = inp.shape
            eye = torch.eye(kd, dtype=torch.float32, device=inp.k.device).expand(b, h, kd, kd).contiguous()
            probe = replace(inp, v=torch.zeros(b, t, h, kd, dtype=inp.v.dtype, device=inp.v.device))
            return fla_backend.fla_chunk(self.family, probe, eye)[1]
        return transition_operator(self.family, inp, self.chunk_size)

    def summarize_segment(self, h: torch.Tensor, backend: str = "torch") -> LinearSegmentSummary:
        """Run this layer alone over a segment's normalised inputs `h [n, D]` from zero state and
        zero conv tail: its transition operator T, end state E and conv tail."""
        conv_in, extras = self.project(h[None])
        extras["positions"] = torch.arange(h.shape[0], device=h.device)
        conv_out, tail = self.apply_conv(conv_in, None)
        inp = self.prepare(conv_out, extras)
        _, end = self.run_recurrence(inp, None, backend)
        return LinearSegmentSummary(self.transition_operator(inp, backend)[0], end[0],
                                    None if tail is None else tail[0])

    # ----------------------------------------------------------------- forwards
    def forward_train(self, x: torch.Tensor, backend: str = "torch") -> torch.Tensor:
        conv_in, extras = self.project(x)
        extras["positions"] = torch.arange(x.shape[1], device=x.device)
        conv_out, _ = self.apply_conv(conv_in, None)
        inp = self.prepare(conv_out, extras)
        o, _ = self.run_recurrence(inp, None, backend)
        return self.output(o, extras)

    def forward_prefill(self, x: torch.Tensor, ctx: PrefillContext, cache: StateSlotCache) -> torch.Tensor:
        conv_in, extras = self.project(x[None])
        extras["positions"] = ctx.positions
        if self.conv is not None:
            conv_out, tail = self.conv(conv_in, cache.conv_tail[ctx.slot][None])
            cache.conv_tail[ctx.slot] = tail[0].to(cache.conv_tail.dtype)
        else:
            conv_out = conv_in
        inp = self.prepare(conv_out, extras)
        o, state = self.run_recurrence(inp, cache.state[ctx.slot][None], ctx.backend)
        cache.state[ctx.slot] = state[0]
        return self.output(o, extras)[0]

    def forward_decode(self, x: torch.Tensor, ctx: DecodeContext, cache: StateSlotCache) -> torch.Tensor:
        conv_in, extras = self.project(x[:, None])
        extras["positions"] = ctx.positions[:, None]
        if self.conv is not None:
            y, tails = self.conv.step(conv_in[:, 0], cache.conv_tail[ctx.slots])
            cache.conv_tail[ctx.slots] = tails.to(cache.conv_tail.dtype)
            conv_out = y[:, None]
        else:
            conv_out = conv_in
        inp = self.prepare(conv_out, extras)
        o, state = self.run_recurrence(inp, cache.state[ctx.slots], ctx.backend, step=True)
        cache.state[ctx.slots] = state
        return self.output(o, extras)[:, 0]
