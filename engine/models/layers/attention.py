"""Full (global causal) and sliding-window attention: GQA, RoPE on the first `rotary_dim`
dims (rotate-half), optional per-head q/k RMSNorm and Qwen3-Next-style sigmoid output gate.

Caches (engine/cache/layer_caches.py): a full layer appends each token's K (after RoPE at
its absolute position) and V to the paged pool; a sliding-window layer keeps the last
`window` tokens in a per-slot ring at index `p % window`. A token at position p attends to
positions `<= p` (full) or `(p - window, p]` (sliding window).

Hooks for position-independent caching (engine/pic/):
- `project(x, positions)` -> (q, k, v, gate): with `positions = arange(n)` it gives a
  segment's K at base 0 (rotated) and V; `rope_shift(k, delta)` re-rotates keys by a
  position delta (RoPE is additive in the position; only the rotary dims move).
- full layers: `PagedKVCache.write(flat_slots, k, v)` puts K/V at any positions of a
  request's block table; sliding-window layers: `WindowRingCache.write(slot, positions, k, v)`.
- `attend_prefill(q, k_ctx, v_ctx, q_pos, k_pos)` and `output(o, gate)` are the rest of the
  layer, so seam tokens can be recomputed against whatever context the pool holds.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import SWA, ModelConfig
from engine.models.layers.base import DecodeContext, ExternalKVCache, PrefillContext, TokenMixer
from engine.models.layers.norm import RMSNorm
from engine.models.layers.rope import apply_rope, apply_rope_cos_sin, rope_cos_sin, rope_inv_freq

if TYPE_CHECKING:
    from engine.cache.layer_caches import PagedKVCache, WindowRingCache

#: queries per block in masked (windowed / offset-causal) attention; bounds mask memory.
QUERY_BLOCK = 1024

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    #: SDPA backends for prefill attention on CUDA, cuDNN left out: cuDNN's SDPA builds an
    #: execution plan for every new (q, k) length, which never amortises when every
    #: request has its own prompt length: on the H200 (torch 2.11, 2026-11-29 serving
    #: traces, docs/BENCHMARKS.md) each call of a new shape cost 12-14 ms of host time, 73-81
    #: ms per request over qwen3next-bench's 6 full layers, against 2-10 ms of GPU work.
    #: Flash attention (GQA, causal, lower-right causal) and the memory-efficient kernel
    #: (masks) need no plan.
    CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
except ImportError:  # pragma: no cover - torch without torch.nn.attention
    sdpa_kernel = None
    CUDA_SDPA_BACKENDS = []


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """F.scaled_dot_product_attention, on CUDA restricted to CUDA_SDPA_BACKENDS."""
    if q.is_cuda and sdpa_kernel is not None:
        with sdpa_kernel(CUDA_SDPA_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _expand_kv(x: torch.Tensor, groups: int, head_dim_axis: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=head_dim_axis)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                     k_pos: torch.Tensor, window: int | None, scale: float,
                     q_start: int | None = None, k_start: int | None = None) -> torch.Tensor:
    """Causal (optionally windowed) attention of one batch of equally positioned sequences.

    q `[B, Lq, H, D]`, k/v `[B, Lk, Hkv, D]`, q_pos `[Lq]`, k_pos `[Lk]` (ascending absolute
    positions). Query at p sees keys at positions j with j <= p and, if `window`, p - j < window.
    Returns `[B, Lq, H, D]`.

    `q_start`/`k_start` (both or neither) say the positions are the contiguous ranges
    `q_start..` and `k_start..`: the layout is then known on the host and no position
    is read back from the device (each such read is a sync on CUDA).
    """
    groups = q.shape[2] // k.shape[2]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    lq, lk = qh.shape[2], kh.shape[2]
    if q_start is not None and k_start is not None:
        return _causal_contiguous(qh, kh, vh, q_start, k_start, window, scale, groups).transpose(1, 2)
    if window is None and lq == lk and (q_pos is k_pos or torch.equal(q_pos, k_pos)):
        # positions coincide: top-left causal == the true mask; flash-eligible on GPU
        out = sdpa(qh, kh, vh, is_causal=True, scale=scale,
                                             enable_gqa=groups > 1)
        return out.transpose(1, 2)
    kh, vh = _expand_kv(kh, groups, 1), _expand_kv(vh, groups, 1)
    if window is None and q.is_cuda and bool((k_pos[-lq:] == q_pos).all()):
        # chunk at the end of its context: lower-right causal, flash/efficient kernels
        from torch.nn.attention.bias import causal_lower_right
        out = sdpa(qh, kh, vh, attn_mask=causal_lower_right(lq, lk), scale=scale)
        return out.transpose(1, 2)
    outs = []
    for a in range(0, lq, QUERY_BLOCK):
        b = min(lq, a + QUERY_BLOCK)
        qp = q_pos[a:b]
        lo = 0
        if window is not None:
            lo = int(torch.searchsorted(k_pos, qp[0] - window + 1))
        hi = int(torch.searchsorted(k_pos, qp[-1], right=True))
        kp = k_pos[lo:hi]
        mask = kp[None, :] <= qp[:, None]
        if window is not None:
            mask &= (qp[:, None] - kp[None, :]) < window
        outs.append(sdpa(
            qh[:, :, a:b], kh[:, :, lo:hi], vh[:, :, lo:hi], attn_mask=mask, scale=scale))
    return torch.cat(outs, dim=2).transpose(1, 2)


def _causal_contiguous(qh, kh, vh, q_start: int, k_start: int, window: int | None, scale: float,
                       groups: int) -> torch.Tensor:
    """`causal_attention` over heads-first q/k/v at contiguous positions (host-known layout)."""
    lq, lk = qh.shape[2], kh.shape[2]
    if window is None and q_start == k_start and lq == lk:
        return sdpa(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=groups > 1)
    kh, vh = _expand_kv(kh, groups, 1), _expand_kv(vh, groups, 1)
    if window is None and k_start + lk == q_start + lq and qh.is_cuda:
        from torch.nn.attention.bias import causal_lower_right
        return sdpa(qh, kh, vh, attn_mask=causal_lower_right(lq, lk), scale=scale)
    outs = []
    for a in range(0, lq, QUERY_BLOCK):
        b = min(lq, a + QUERY_BLOCK)
        first, last = q_start + a, q_start + b - 1  # absolute positions of this query block
        lo = max(0, first - window + 1 - k_start) if window is not None else 0
        hi = min(lk, last + 1 - k_start)
        qp = torch.arange(first, last + 1, device=qh.device)
        kp = torch.arange(k_start + lo, k_start + hi, device=qh.device)
        mask = kp[None, :] <= qp[:, None]
        if window is not None:
            mask &= (qp[:, None] - kp[None, :]) < window
        outs.append(sdpa(
            qh[:, :, a:b], kh[:, :, lo:hi], vh[:, :, lo:hi], attn_mask=mask, scale=scale))
    return torch.cat(outs, dim=2)


#: full attention of two or more query runs takes ONE masked SDPA call while its mask
#: (queries x keys) holds at most this many elements (32 MiB in bf16): a warm PIC pass's
#: seams and question; past it (cold passes computing whole segments in context) a call
#: per run, whose causal form skips the keys past each run and needs no mask in memory
RANGES_MASK_MAX = 1 << 24


def one_masked_call(ranges, lk: int) -> bool:
    """Whether `causal_attention_ranges` (full attention) runs `ranges` against `lk` keys
    as one masked call (`RANGES_MASK_MAX`)."""
    return len(ranges) > 1 and sum(b - a for a, b in ranges) * lk <= RANGES_MASK_MAX


def ranges_mask(ranges, lk: int, dtype: torch.dtype, device, q_pos: torch.Tensor | None = None) -> torch.Tensor:
    """The additive mask `[Lq, lk]` of full causal attention for queries in the runs
    `ranges` (absolute `[a, b)`, ascending) against keys at 0..lk-1: 0 where the query at p
    may see key j (j <= p), -inf elsewhere. Its rows are laid out 16-element aligned (the
    result is a view of the first lk columns), the alignment SDPA's memory-efficient CUDA
    kernel takes without a copy per call, so one mask serves every full layer of a
    request. `q_pos`: the queries' positions already on `device` (else copied there)."""
    if q_pos is None:
        q_pos = torch.cat([torch.arange(a, b) for a, b in ranges]).to(device, non_blocking=True)
    cols = torch.arange(-(-lk // 16) * 16, device=device)
    mask = torch.zeros(q_pos.shape[0], cols.shape[0], dtype=dtype, device=device)
    return mask.masked_fill_(cols[None, :] > q_pos[:, None], float("-inf"))[:, :lk]


def causal_attention_ranges(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranges, window: int | None,
                            scale: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of queries that lie in host-known runs of positions against keys at
    positions 0..Lk-1: q `[Lq, H, D]` holds the queries of `ranges` (absolute `[a, b)`,
    ascending, b <= Lk) one after another, k/v `[Lk, Hkv, D]`. Query at p sees keys j <= p
    (and p - j < window). Returns `[Lq, H, D]`.

    The same numbers as `causal_attention` over the scattered positions (to rounding),
    without reading a position back from the device (no host sync); K/V are expanded for
    GQA once. Full attention over two or more runs whose mask is small (`one_masked_call`)
    is ONE SDPA call with the additive `ranges_mask` (`mask`: that mask, made once per
    request by the caller, else here); otherwise (one run, a window, a large mask) a call
    per run, each a chunk at the end of its context [0, b) (on CUDA SDPA's lower-right
    causal form, flash / efficient kernels)."""
    at = sum(b - a for a, b in ranges)
    if at != q.shape[0]:
        raise ValueError(f"ranges cover {at} queries, q holds {q.shape[0]}")
    groups = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)[None]
    kh, vh = _expand_kv(k.transpose(0, 1)[None], groups, 1), _expand_kv(v.transpose(0, 1)[None], groups, 1)
    if window is None and one_masked_call(ranges, k.shape[0]):
        if mask is None:
            mask = ranges_mask(ranges, k.shape[0], q.dtype, q.device)
        if tuple(mask.shape) != (q.shape[0], k.shape[0]):
            raise ValueError(f"mask {tuple(mask.shape)} is not [queries, keys] = {(q.shape[0], k.shape[0])}")
        return sdpa(qh, kh, vh, attn_mask=mask, scale=scale)[0].transpose(0, 1)
    outs, at = [], 0
    for a, b in ranges:
        n = b - a
        lo = 0 if window is None else max(0, a - window + 1)
        outs.append(_causal_contiguous(qh[:, :, at:at + n], kh[:, :, lo:b], vh[:, :, lo:b], a, lo, window, scale, 1))
        at += n
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out[0].transpose(0, 1)


def causal_attention_known(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranges, k_pos, window: int | None,
                           scale: float, k_pos_dev: torch.Tensor | None = None) -> torch.Tensor:
    """`causal_attention` with every position known on the host: q `[Lq, H, D]` holds the
    queries of `ranges` (absolute `[a, b)`, ascending) one after another, k/v `[Lk, Hkv,
    D]` the keys at `k_pos` (a host sequence of Lk ascending positions, with gaps). Query at
    p sees the keys at j <= p (and p - j < window). Each block's key span is found on the
    host (no position read back from the device); K/V are expanded for GQA once.
    `k_pos_dev`: `k_pos` already on q's device (else copied there once)."""
    from bisect import bisect_left, bisect_right

    groups = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)[None]
    kh, vh = _expand_kv(k.transpose(0, 1)[None], groups, 1), _expand_kv(v.transpose(0, 1)[None], groups, 1)
    kp_dev = k_pos_dev if k_pos_dev is not None else \
        torch.as_tensor(list(k_pos), dtype=torch.long).to(q.device, non_blocking=True)
    outs, at = [], 0
    for a, b in ranges:
        for s in range(a, b, QUERY_BLOCK):
            e = min(b, s + QUERY_BLOCK)
            lo = bisect_left(k_pos, s - window + 1) if window is not None else 0
            hi = bisect_right(k_pos, e - 1)
            qp = torch.arange(s, e, device=q.device)
            kp = kp_dev[lo:hi]
            mask = kp[None, :] <= qp[:, None]
            if window is not None:
                mask &= (qp[:, None] - kp[None, :]) < window
            outs.append(sdpa(qh[:, :, at + s - a:at + e - a], kh[:, :, lo:hi], vh[:, :, lo:hi], attn_mask=mask,
                             scale=scale))
        at += b - a
    if at != q.shape[0]:
        raise ValueError(f"ranges cover {at} queries, q holds {q.shape[0]}")
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out[0].transpose(0, 1)


def grouped_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """One query per sequence against its gathered context, GQA without expanding K/V.

    q `[B, H, D]`, k/v `[B, L, Hkv, D]`, valid `[B, L]` bool -> `[B, H, D]`. Scores and
    softmax in float32."""
    b, h, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, hkv, h // hkv, d)  # query head i uses kv head i // (H / Hkv)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).to(torch.float32) * scale  # [B, Hkv, G, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v.transpose(1, 2)).reshape(b, h, d)  # [B, Hkv, G, D] -> [B, H, D]


class Attention(TokenMixer):
    def __init__(self, cfg: ModelConfig, kind: str) -> None:
        super().__init__()
        self._init_geometry(cfg, kind)
        a = cfg.attention
        q_out = a.num_heads * a.head_dim * (2 if a.output_gate else 1)
        kv_out = a.num_kv_heads * a.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_out, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_out, bias=False)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(a.head_dim, cfg.rms_norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, cfg.rms_norm_eps) if a.qk_norm else None

    def _init_geometry(self, cfg: ModelConfig, kind: str) -> None:
        """Heads, window, scale and RoPE settings (everything but the projections)."""
        a = cfg.attention
        self.kind = kind
        self.num_heads = a.num_heads
        self.num_kv_heads = a.num_kv_heads
        self.head_dim = a.head_dim
        self.window = a.sliding_window if kind == SWA else None
        self.output_gate = a.output_gate
        self.scale = a.softmax_scale
        self.rotary_dim = a.rotary_dim
        self.rope_theta = a.swa_rope_theta if (kind == SWA and a.swa_rope_theta) else a.rope_theta
        self.rope_linear_factor = a.rope_linear_factor
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    @property
    def rope_key(self) -> tuple[int, float, float]:
        """What `inv_freq` is made from (rotary dim, theta, linear scaling: full attention
        only): layers with equal keys rotate by the same angles."""
        return self.rotary_dim, self.rope_theta, 1.0 if self.window is not None else self.rope_linear_factor

    @property
    def inv_freq(self) -> torch.Tensor:
        """float32 RoPE inverse frequencies on the layer's device (from `rope_key`). Not a
        buffer, so casting the model to bf16 never degrades the angles."""
        device = self.o_proj.weight.device
        if device not in self._inv_freq:
            rot, theta, factor = self.rope_key
            self._inv_freq[device] = rope_inv_freq(rot, theta, device) / factor
        return self._inv_freq[device]

    # ------------------------------------------------------------ pieces (PIC hooks)
    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x `[..., T, D]`, positions `[T]` -> q `[..., T, H, hd]`, k `[..., T, Hkv, hd]` (both
        rotated to `positions`), v `[..., T, Hkv, hd]`, gate `[..., T, H, hd]` or None."""
        lead = x.shape[:-1]
        q = self.q_proj(x)
        gate = None
        if self.output_gate:
            q, gate = q.view(*lead, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            q = q.view(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_dim:
            cos, sin = rope_cos_sin(positions, self.inv_freq)
            cos, sin = cos[..., None, :], sin[..., None, :]  # broadcast over heads
            q, k = apply_rope_cos_sin(q, cos, sin), apply_rope_cos_sin(k, cos, sin)
        return q, k, v, gate

    def rope_shift(self, k: torch.Tensor, delta: int | torch.Tensor) -> torch.Tensor:
        """Re-rotate keys `[T, Hkv, hd]` by a position delta (scalar or `[T]`)."""
        d = torch.as_tensor(delta, device=k.device).expand(k.shape[0])
        return apply_rope(k, d, self.inv_freq)

    def attend_prefill(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
                       q_pos: torch.Tensor, k_pos: torch.Tensor, q_start: int | None = None,
                       k_start: int | None = None) -> torch.Tensor:
        """One sequence: q `[n, H, hd]` against context K/V `[L, Hkv, hd]` at `k_pos`
        (`q_start`/`k_start`: the positions are contiguous from there; see causal_attention)."""
        return causal_attention(q[None], k_ctx[None], v_ctx[None], q_pos, k_pos, self.window, self.scale,
                                q_start, k_start)[0]

    def attend_ranges(self, q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, ranges,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
        """One sequence: the queries of host-known position runs `ranges` against context
        K/V at positions 0..L-1 (see causal_attention_ranges; `mask`: its `ranges_mask`)."""
        return causal_attention_ranges(q, k_ctx, v_ctx, ranges, self.window, self.scale, mask)

    def attend_known(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranges, k_pos,
                     k_pos_dev: torch.Tensor | None = None) -> torch.Tensor:
        """One sequence: the queries of host-known runs `ranges` against keys at the host-known
        positions `k_pos` (see causal_attention_known)."""
        return causal_attention_known(q, k, v, ranges, k_pos, self.window, self.scale, k_pos_dev)

    def output(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o.flatten(-2))

    # ------------------------------------------------------------------ forwards
    def forward_train(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device)
        q, k, v, gate = self.project(x, pos)
        o = causal_attention(q, k, v, pos, pos, self.window, self.scale, 0, 0)
        return self.output(o, gate)

    def forward_prefill(self, x: torch.Tensor, ctx: PrefillContext,
                        cache: PagedKVCache | WindowRingCache) -> torch.Tensor:
        pos = ctx.positions
        q, k, v, gate = self.project(x, pos)
        if isinstance(cache, ExternalKVCache):
            return self.output(cache.attend_prefill(q, k, v, ctx, self.scale), gate)
        k_start = ctx.start_pos
        if self.window is None:
            cache.write(ctx.write_slots, k, v)
            if ctx.start_pos == 0:
                k_ctx, v_ctx, k_pos = k, v, pos
            else:
                k_start = 0
                k_ctx, v_ctx = cache.gather(ctx.context_slots)
                k_pos = torch.arange(k_ctx.shape[0], device=x.device)
        else:
            first = max(0, ctx.start_pos - self.window + 1)
            past = torch.arange(first, ctx.start_pos, device=x.device)
            if past.numel():
                k_start = first
                k_past, v_past = cache.read(ctx.slot, past)
                k_ctx, v_ctx = torch.cat([k_past, k.to(k_past.dtype)]), torch.cat([v_past, v.to(v_past.dtype)])
                k_pos = torch.cat([past, pos])
            else:
                k_ctx, v_ctx, k_pos = k, v, pos
            cache.write(ctx.slot, pos, k, v)
        o = self.attend_prefill(q, k_ctx.to(q.dtype), v_ctx.to(q.dtype), pos, k_pos, ctx.start_pos, k_start)
        return self.output(o, gate)

    def forward_decode(self, x: torch.Tensor, ctx: DecodeContext,
                       cache: PagedKVCache | WindowRingCache) -> torch.Tensor:
        pos = ctx.positions
        q, k, v, gate = self.project(x[:, None], pos[:, None])  # [B, 1, H, hd]
        k, v = k[:, 0], v[:, 0]
        if isinstance(cache, ExternalKVCache):
            return self.output(cache.attend_decode(q[:, 0], k, v, ctx, self.scale)[:, None], gate)[:, 0]
        if self.window is None:
            cache.write(ctx.write_slots, k, v)
        else:
            idx = pos % self.window
            cache.k[ctx.slots, idx] = k.to(cache.k.dtype)
            cache.v[ctx.slots, idx] = v.to(cache.v.dtype)
        if ctx.paged_attention and self._pages(cache)[0].dtype == q.dtype:
            o = self.attend_decode_paged(q[:, 0], ctx, cache)
            return self.output(o[:, None], gate)[:, 0]
        if self.window is None:
            k_ctx, v_ctx = cache.gather(ctx.context_slots)  # [B, Lmax, Hkv, hd]
            valid = torch.arange(k_ctx.shape[1], device=x.device)[None, :] < ctx.context_lens[:, None]
        else:
            k_ctx, v_ctx = cache.k[ctx.slots], cache.v[ctx.slots]  # [B, w, Hkv, hd]
            valid = torch.arange(self.window, device=x.device)[None, :] <= pos[:, None]
        o = grouped_decode_attention(q[:, 0], k_ctx.to(q.dtype), v_ctx.to(q.dtype), valid, self.scale)
        return self.output(o[:, None], gate)[:, 0]

    def _pages(self, cache: PagedKVCache | WindowRingCache) -> tuple[torch.Tensor, torch.Tensor]:
        return (cache.k_pages, cache.v_pages) if self.window is None else (cache.k, cache.v)

    def attend_decode_paged(self, q: torch.Tensor, ctx: DecodeContext,
                            cache: PagedKVCache | WindowRingCache) -> torch.Tensor:
        """q `[B, H, hd]` (its K/V already written) against each sequence's context through
        the paged decode kernel (kernels/paged_decode_attention.py; its torch reference off
        CUDA). Every shape is fixed by the inputs' shapes (no host reads), so this runs
        inside a CUDA graph.

        A sliding-window ring is a pool with block_size = window addressed by the ring slot.
        The length is moved down by whole windows to `L' in [1, 2 * window]` (same ring
        indices, `L' - window >= 0`), so a two-column table of the slot covers it."""
        from kernels.paged_decode_attention import paged_decode_attention

        lens = ctx.context_lens
        k_pages, v_pages = self._pages(cache)
        if self.window is None:
            tables = ctx.block_tables
        else:
            w = self.window
            lens = lens - w * ((lens - 1) // w - 1).clamp(min=0)
            tables = ctx.slots[:, None].expand(-1, 2)
        return paged_decode_attention(q, k_pages, v_pages, tables, lens, self.scale, window=self.window,
                                      force_triton=None if q.is_cuda else False)
