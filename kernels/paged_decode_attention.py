"""Paged decode attention with grouped-query heads: one query token per sequence over its
keys/values in a paged KV pool, for a batch of sequences of different lengths.

Layout (docs/ARCHITECTURE.md): `k_pages`/`v_pages [num_blocks, block_size, Hkv, D]`, K
stored after RoPE; sequence b's token at position p is at
(block_tables[b, p // block_size], p % block_size). `seq_lens[b]` counts the tokens of
sequence b including the current one (whose K/V are already written); the query attends to
positions [max(0, L - window), L) with a sliding window, [0, L) without. A sequence of
length 0 yields zeros.

A sliding-window ring `[num_slots, window, Hkv, D]` (position p at ring index p % window)
is a pool with block_size = window whose block table repeats the ring's slot id:
`ring_block_tables` builds it; pass `window` so only the live ring entries are read.

Kernel: flash-decoding. Program (sequence, kv head, split) loads the query rows of its GQA
group (padded to 16 rows for tl.dot) and streams BLOCK_N tokens at a time through an
online softmax in float32. With num_splits > 1 each split covers an equal share of the
sequence's attended range and writes (partial output, log-sum-exp) to float32 scratch; a
second kernel merges the splits. Scores and the merge are float32; float32 inputs use IEEE
dot products (no TF32). On CUDA the tile size and warps are autotuned; under the
interpreter a fixed configuration runs.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from kernels.backend import HAS_TRITON, INTERPRET, next_pow2, num_sms, tl, triton, use_triton
from kernels.errors import KernelInputError

__all__ = ["paged_decode_attention", "paged_decode_attention_reference", "ring_block_tables",
           "default_num_splits"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)
_TOKENS_PER_SPLIT_MIN = 256  # do not split a sequence into pieces shorter than this


def ring_block_tables(ring_slots: torch.Tensor, max_seq_len: int, window: int) -> torch.Tensor:
    """Block tables `[B, cdiv(max_seq_len, window)]` int32 that address the sliding-window
    rings `ring_slots [B]` of a buffer `[num_slots, window, Hkv, D]` as a paged pool with
    block_size = window (every entry of row b is ring_slots[b])."""
    if window <= 0:
        raise KernelInputError(f"window must be positive, got {window!r}")
    if ring_slots.dim() != 1:
        raise KernelInputError(f"ring_slots must be [B], got shape {tuple(ring_slots.shape)}")
    cols = max(1, -(-int(max_seq_len) // window))
    return ring_slots.to(torch.int32)[:, None].expand(-1, cols).contiguous()


def default_num_splits(batch: int, num_kv_heads: int, max_tokens: int, device: torch.device) -> int:
    """Splits per sequence so that batch * num_kv_heads * splits programs fill the GPU about
    twice, without splits shorter than 256 tokens. `max_tokens` bounds the attended range
    (block table capacity, or the window). 1 off CUDA."""
    if device.type != "cuda":
        return 1
    want = -(-2 * num_sms(device) // max(1, batch * num_kv_heads))
    return max(1, min(want, -(-max_tokens // _TOKENS_PER_SPLIT_MIN), 64))


def _validate(q, k_pages, v_pages, block_tables, seq_lens, window, num_splits, out):
    if q.dim() != 3:
        raise KernelInputError(f"q must be [B, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_pages.dim() != 4:
        raise KernelInputError(
            f"k_pages must be [num_blocks, block_size, num_kv_heads, head_dim], got {tuple(k_pages.shape)}")
    if v_pages.shape != k_pages.shape:
        raise KernelInputError(f"v_pages shape {tuple(v_pages.shape)} != k_pages shape {tuple(k_pages.shape)}")
    B, num_heads, head_dim = q.shape
    _, _, num_kv_heads, page_dim = k_pages.shape
    if page_dim != head_dim:
        raise KernelInputError(f"q head_dim {head_dim} != pages head_dim {page_dim}")
    if num_heads % num_kv_heads:
        raise KernelInputError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if q.dtype not in _FLOAT_DTYPES or k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise KernelInputError(
            f"q, k_pages, v_pages must share one float dtype, got {q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or block_tables.dtype not in _INDEX_DTYPES:
        raise KernelInputError(
            f"block_tables must be int32/int64 [{B}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}")
    if seq_lens.shape != (B,) or seq_lens.dtype not in _INDEX_DTYPES:
        raise KernelInputError(f"seq_lens must be int32/int64 [{B}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if window is not None and (not isinstance(window, int) or window <= 0):
        raise KernelInputError(f"window must be a positive int or None, got {window!r}")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits <= 0):
        raise KernelInputError(f"num_splits must be a positive int or None, got {num_splits!r}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise KernelInputError(f"out must be {q.dtype} {tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}")
    devices = {t.device for t in (q, k_pages, v_pages, block_tables, seq_lens, out) if t is not None}
    if len(devices) != 1:
        raise KernelInputError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if q.device.type == "cpu" and B:  # range checks need host values: CPU only (no sync on CUDA)
        capacity = block_tables.shape[1] * k_pages.shape[1]
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        if lo < 0 or hi > capacity:
            raise KernelInputError(
                f"seq_lens must be in [0, {capacity}] (block table capacity), got range [{lo}, {hi}]")
        used = torch.arange(block_tables.shape[1]) * k_pages.shape[1] < seq_lens[:, None]
        if window is not None:
            first = (seq_lens - window).clamp(min=0) // k_pages.shape[1]
            used &= torch.arange(block_tables.shape[1]) >= first[:, None]
        ids = block_tables[used]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= k_pages.shape[0]):
            raise KernelInputError(
                f"block_tables entries in use must be in [0, {k_pages.shape[0]}), got range "
                f"[{int(ids.min())}, {int(ids.max())}]")


# --------------------------------------------------------------------------- reference
def paged_decode_attention_reference(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                                     block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                     scale: Optional[float] = None, *, window: Optional[int] = None,
                                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Torch reference of `paged_decode_attention`: gather every sequence's K/V through its
    block table, masked softmax in float32."""
    _validate(q, k_pages, v_pages, block_tables, seq_lens, window, None, out)
    return _attention_torch(q, k_pages, v_pages, block_tables, seq_lens, scale, window, out)


def _attention_torch(q, k_pages, v_pages, block_tables, seq_lens, scale, window, out):
    B, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_pages.shape
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    ids = block_tables.long().clamp(0, num_blocks - 1)  # unused entries may hold anything
    k = k_pages[ids].flatten(1, 2).float()  # [B, capacity, Hkv, D]
    v = v_pages[ids].flatten(1, 2).float()
    pos = torch.arange(k.shape[1], device=q.device)
    lens = seq_lens.long()[:, None]
    live = pos[None, :] < lens
    if window is not None:
        live &= pos[None, :] >= lens - window
    qg = q.float().view(B, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bnhd->bhgn", qg, k) * scale
    scores = scores.masked_fill(~live[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # empty sequences: all -inf -> 0
    res = torch.einsum("bhgn,bnhd->bhgd", probs, v).reshape(B, num_heads, head_dim).to(q.dtype)
    if out is None:
        return res
    out.copy_(res)
    return out


# --------------------------------------------------------------------------- triton
if HAS_TRITON:

    @triton.jit
    def _decode_kernel(
        q_ptr, kp_ptr, vp_ptr, bt_ptr, len_ptr, out_ptr, pacc_ptr, plse_ptr,
        scale_log2e, window, num_splits,
        group, head_dim, block_size,
        s_qb, s_qh, s_qd,
        s_kpb, s_kpo, s_kph, s_kpd,
        s_vpb, s_vpo, s_vph, s_vpd,
        s_btb, s_btn,
        s_ob, s_oh, s_od,
        s_pb, s_ph, s_ps, s_pd,
        s_lb, s_lh, s_ls,
        HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(len_ptr + b).to(tl.int32)
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(seq_len - window, 0)
        # equal shares of [lo, seq_len), rounded up to whole tiles
        share = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
        start = lo + split * share
        end = tl.minimum(start + share, seq_len)

        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        gmask = g < group
        dmask = d < head_dim
        heads = (kvh * group + g).to(tl.int64)
        q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + d[None, :] * s_qd,
                    mask=gmask[:, None] & dmask[None, :], other=0.0)

        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        bt_row = bt_ptr + b * s_btb
        for n0 in range(start, end, BLOCK_N):
            tok = n0 + tl.arange(0, BLOCK_N)
            tmask = tok < end
            blk = tl.load(bt_row + (tok // block_size) * s_btn, mask=tmask, other=0).to(tl.int64)
            off = (tok % block_size).to(tl.int64)
            kv_mask = tmask[:, None] & dmask[None, :]
            k = tl.load(kp_ptr + blk[:, None] * s_kpb + off[:, None] * s_kpo + kvh * s_kph + d[None, :] * s_kpd,
                        mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(tmask[None, :], s * scale_log2e, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(vp_ptr + blk[:, None] * s_vpb + off[:, None] * s_vpo + kvh * s_vph + d[None, :] * s_vpd,
                        mask=kv_mask, other=0.0)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        nonempty = l_i > 0
        res = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        row_mask = gmask[:, None] & dmask[None, :]
        if SPLIT:
            sp = split.to(tl.int64)
            tl.store(pacc_ptr + b * s_pb + heads[:, None] * s_ph + sp * s_ps + d[None, :] * s_pd, res, mask=row_mask)
            lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
            tl.store(plse_ptr + b * s_lb + heads * s_lh + sp * s_ls, lse, mask=gmask)
        else:
            tl.store(out_ptr + b * s_ob + heads[:, None] * s_oh + d[None, :] * s_od,
                     res.to(out_ptr.dtype.element_ty), mask=row_mask)

    @triton.jit
    def _merge_splits_kernel(
        pacc_ptr, plse_ptr, out_ptr, num_splits, head_dim,
        s_pb, s_ph, s_ps, s_pd, s_lb, s_lh, s_ls, s_ob, s_oh, s_od,
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        sp = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        smask = sp < num_splits
        dmask = d < head_dim
        lse = tl.load(plse_ptr + b * s_lb + h * s_lh + sp * s_ls, mask=smask, other=float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m)  # empty splits: exp2(-inf) = 0
        part = tl.load(pacc_ptr + b * s_pb + h * s_ph + sp[:, None] * s_ps + d[None, :] * s_pd,
                       mask=smask[:, None] & dmask[None, :], other=0.0)
        total = tl.sum(w, 0)
        res = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + b * s_ob + h * s_oh + d * s_od, res.to(out_ptr.dtype.element_ty), mask=dmask)

    if INTERPRET:
        _decode_launch = _decode_kernel
    else:
        _decode_launch = triton.autotune(
            configs=[
                triton.Config({"BLOCK_N": 16}, num_warps=4, num_stages=2),
                triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=2),
                triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=2),
                triton.Config({"BLOCK_N": 64}, num_warps=8, num_stages=3),
                triton.Config({"BLOCK_N": 128}, num_warps=8, num_stages=2),
            ],
            key=["group", "head_dim", "block_size", "num_splits", "HAS_WINDOW"],
        )(_decode_kernel)


def _attention_triton(q, k_pages, v_pages, block_tables, seq_lens, scale, window, num_splits, out):
    B, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_pages.shape
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if out is None:
        out = torch.empty_like(q)
    if B == 0:
        return out
    if num_splits is None:
        max_tokens = block_tables.shape[1] * block_size
        if window is not None:
            max_tokens = min(max_tokens, window)
        num_splits = default_num_splits(B, num_kv_heads, max_tokens, q.device)
    split = num_splits > 1
    if split:
        pacc = torch.empty(B, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        plse = torch.empty(B, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        pacc = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=q.device)
        plse = torch.empty(1, 1, 1, dtype=torch.float32, device=q.device)
    block_d = max(16, next_pow2(head_dim))
    fixed = {"BLOCK_N": 16, "num_warps": 4} if INTERPRET else {}
    _decode_launch[(B, num_kv_heads, num_splits)](
        q, k_pages, v_pages, block_tables, seq_lens, out, pacc, plse,
        scale * math.log2(math.e), window or 0, num_splits,
        group, head_dim, block_size,
        *q.stride(), *k_pages.stride(), *v_pages.stride(), *block_tables.stride(), *out.stride(),
        *pacc.stride(), *plse.stride(),
        HAS_WINDOW=window is not None, SPLIT=split, IEEE=q.dtype == torch.float32,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_D=block_d, **fixed,
    )
    if split:
        _merge_splits_kernel[(B, num_heads)](
            pacc, plse, out, num_splits, head_dim,
            *pacc.stride(), *plse.stride(), *out.stride(),
            BLOCK_S=next_pow2(num_splits), BLOCK_D=block_d, num_warps=4,
        )
    return out


def paged_decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: Optional[float] = None, *, window: Optional[int] = None,
                           num_splits: Optional[int] = None, out: Optional[torch.Tensor] = None,
                           force_triton: Optional[bool] = None) -> torch.Tensor:
    """Decode attention of `q [B, num_heads, D]` over paged K/V; returns `[B, num_heads, D]`
    in q's dtype (written into `out` when given).

    k_pages/v_pages: `[num_blocks, block_size, num_kv_heads, D]`, q's dtype; num_heads a
    multiple of num_kv_heads (query head h reads kv head h // (num_heads // num_kv_heads)).
    block_tables: int32/int64 `[B, max_blocks]`; entries past a sequence's blocks are
    ignored. seq_lens: int32/int64 `[B]`, tokens per sequence including the current one.
    scale: defaults to 1/sqrt(D). window: attend to the last `window` positions only.
    num_splits: split-K factor of the Triton path (None: `default_num_splits`). Block ids
    and lengths are range-checked on CPU only (a check on CUDA would sync every step)."""
    _validate(q, k_pages, v_pages, block_tables, seq_lens, window, num_splits, out)
    if not use_triton((q, k_pages, v_pages), force_triton, "paged_decode_attention"):
        return _attention_torch(q, k_pages, v_pages, block_tables, seq_lens, scale, window, out)
    return _attention_triton(q, k_pages, v_pages, block_tables, seq_lens, scale, window, num_splits, out)
