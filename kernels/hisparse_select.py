"""HiSparse block selection: score every KV block of a sequence against the decode query
from the block's summary, then keep the top-k blocks.

Summaries (engine/hisparse/): a pool `[num_slots, max_blocks, 2, Hkv, D]`; row
`summaries[slot, j]` describes block j of the sequence in `slot`:
- mode "minmax" (Quest): `[0]` the per-channel minimum of the block's keys, `[1]` the
  maximum; a query head's score is the upper bound `sum_d max(q_d * kmin_d, q_d * kmax_d)`
  of its dot product with any key of the block;
- mode "mean": `[0]` the mean key; the score is `q . kmean`.
Query head h reads kv head `h // (H / Hkv)`. A block's score is the sum over query
heads (measured on the trained tiny models at a 25% block budget, docs/hisparse.md, the
sum selects blocks holding more of the exact attention mass than the maximum over heads). Columns outside `[lo[b], hi[b])` score
-inf (pinned sink/recent blocks and padding).

`block_scores(q, summaries, slots, lo, hi, num_cols, mode)` -> float32 `[B, num_cols]`.
`topk_blocks(scores, k)` -> int64 `[B, k]`: column indices by descending score, ties to the
lower index (a stable sort); -inf entries come last, so a caller keeps
`min(k, hi - lo)` of them.

Each has a torch reference beside it (`*_reference`); the Triton kernels run on CUDA and
under TRITON_INTERPRET=1; elsewhere the public functions take the reference.
"""
from __future__ import annotations

from typing import Optional

import torch

from kernels.backend import HAS_TRITON, next_pow2, tl, triton, use_triton
from kernels.errors import KernelInputError

__all__ = ["block_scores", "block_scores_reference", "topk_blocks", "topk_blocks_reference", "SCORE_MODES"]

SCORE_MODES = ("minmax", "mean")
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _validate_scores(q, summaries, slots, lo, hi, num_cols, mode):
    if mode not in SCORE_MODES:
        raise KernelInputError(f"mode must be one of {SCORE_MODES}, got {mode!r}")
    if q.dim() != 3:
        raise KernelInputError(f"q must be [B, num_heads, head_dim], got shape {tuple(q.shape)}")
    if summaries.dim() != 5 or summaries.shape[2] != 2:
        raise KernelInputError(
            f"summaries must be [num_slots, max_blocks, 2, num_kv_heads, head_dim], got {tuple(summaries.shape)}")
    B, H, D = q.shape
    if summaries.shape[4] != D:
        raise KernelInputError(f"q head_dim {D} != summaries head_dim {summaries.shape[4]}")
    if H % summaries.shape[3]:
        raise KernelInputError(f"num_heads {H} is not a multiple of num_kv_heads {summaries.shape[3]}")
    if q.dtype not in _FLOAT_DTYPES or summaries.dtype not in _FLOAT_DTYPES:
        raise KernelInputError(f"q and summaries must be float, got {q.dtype}, {summaries.dtype}")
    for name, t in (("slots", slots), ("lo", lo), ("hi", hi)):
        if t.shape != (B,) or t.dtype not in _INDEX_DTYPES:
            raise KernelInputError(f"{name} must be int32/int64 [{B}], got {t.dtype} {tuple(t.shape)}")
    if not isinstance(num_cols, int) or num_cols < 1 or num_cols > summaries.shape[1]:
        raise KernelInputError(f"num_cols must be an int in [1, {summaries.shape[1]}], got {num_cols!r}")
    devices = {t.device for t in (q, summaries, slots, lo, hi)}
    if len(devices) != 1:
        raise KernelInputError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if q.device.type == "cpu" and B:  # host range checks (no sync on CUDA)
        if int(slots.min()) < 0 or int(slots.max()) >= summaries.shape[0]:
            raise KernelInputError(f"slots must be in [0, {summaries.shape[0]}), got {slots.tolist()}")
        if int(lo.min()) < 0 or int(hi.max()) > num_cols:
            raise KernelInputError(f"lo/hi must lie in [0, {num_cols}], got lo {lo.tolist()} hi {hi.tolist()}")


# --------------------------------------------------------------------------- references
def block_scores_reference(q: torch.Tensor, summaries: torch.Tensor, slots: torch.Tensor, lo: torch.Tensor,
                           hi: torch.Tensor, num_cols: int, mode: str = "minmax") -> torch.Tensor:
    """Torch reference of `block_scores` (gathers each sequence's summaries)."""
    _validate_scores(q, summaries, slots, lo, hi, num_cols, mode)
    return _scores_torch(q, summaries, slots, lo, hi, num_cols, mode)


def _scores_torch(q, summaries, slots, lo, hi, num_cols, mode):
    B, H, D = q.shape
    hkv = summaries.shape[3]
    group = H // hkv
    s = summaries[slots.long(), :num_cols].float()  # [B, N, 2, Hkv, D]
    s = s.repeat_interleave(group, dim=3)  # [B, N, 2, H, D]
    qf = q.float()[:, None]  # [B, 1, H, D]
    if mode == "minmax":
        per_head = torch.maximum(qf * s[:, :, 0], qf * s[:, :, 1]).sum(-1)  # [B, N, H]
    else:
        per_head = (qf * s[:, :, 0]).sum(-1)
    scores = per_head.sum(-1)
    col = torch.arange(num_cols, device=q.device)[None, :]
    live = (col >= lo.long()[:, None]) & (col < hi.long()[:, None])
    return scores.masked_fill(~live, float("-inf"))


def topk_blocks_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Torch reference of `topk_blocks`: a stable descending sort's first k columns."""
    _validate_topk(scores, k)
    return torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k].contiguous()


def _validate_topk(scores, k):
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise KernelInputError(f"scores must be float32 [B, N], got {scores.dtype} {tuple(scores.shape)}")
    if not isinstance(k, int) or k < 1 or k > scores.shape[1]:
        raise KernelInputError(f"k must be an int in [1, {scores.shape[1]}] (the columns), got {k!r}")


# --------------------------------------------------------------------------- triton
if HAS_TRITON:

    @triton.jit
    def _scores_kernel(
        q_ptr, s_ptr, slot_ptr, lo_ptr, hi_ptr, out_ptr,
        num_heads, group, head_dim, num_cols,
        s_qb, s_qh, s_qd,
        s_ss, s_sn, s_sp, s_sh, s_sd,
        s_ob, s_on,
        MINMAX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        tile = tl.program_id(1)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        lo = tl.load(lo_ptr + b).to(tl.int32)
        hi = tl.load(hi_ptr + b).to(tl.int32)
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        d = tl.arange(0, BLOCK_D)
        nmask = n < num_cols
        dmask = d < head_dim
        m2 = nmask[:, None] & dmask[None, :]
        base = s_ptr + slot * s_ss + n[:, None].to(tl.int64) * s_sn + d[None, :] * s_sd
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        for h in range(num_heads):
            kvh = h // group
            qv = tl.load(q_ptr + b * s_qb + h * s_qh + d * s_qd, mask=dmask, other=0.0).to(tl.float32)
            a = tl.load(base + kvh * s_sh, mask=m2, other=0.0).to(tl.float32)
            if MINMAX:
                c = tl.load(base + s_sp + kvh * s_sh, mask=m2, other=0.0).to(tl.float32)
                prod = tl.maximum(qv[None, :] * a, qv[None, :] * c)
            else:
                prod = qv[None, :] * a
            total += tl.sum(prod, 1)
        live = (n >= lo) & (n < hi)
        tl.store(out_ptr + b * s_ob + n * s_on, tl.where(live, total, float("-inf")), mask=nmask)

    @triton.jit
    def _topk_kernel(x_ptr, out_ptr, n_cols, k, s_xb, s_xn, s_ob, s_ok, BLOCK_N: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        ar = tl.arange(0, BLOCK_N)
        x = tl.load(x_ptr + b * s_xb + ar * s_xn, mask=ar < n_cols, other=float("-inf"))
        taken = ar < 0
        for i in range(k):
            m = tl.max(tl.where(taken, float("-inf"), x), 0)
            idx = tl.min(tl.where((x == m) & (~taken), ar, BLOCK_N), 0)
            tl.store(out_ptr + b * s_ob + i * s_ok, idx.to(tl.int64))
            taken = taken | (ar == idx)


def block_scores(q: torch.Tensor, summaries: torch.Tensor, slots: torch.Tensor, lo: torch.Tensor,
                 hi: torch.Tensor, num_cols: int, mode: str = "minmax",
                 force_triton: Optional[bool] = None) -> torch.Tensor:
    """Score columns `0..num_cols-1` of each sequence's summaries against its query (see the
    module docstring); float32 `[B, num_cols]`."""
    _validate_scores(q, summaries, slots, lo, hi, num_cols, mode)
    if not use_triton((q, summaries), force_triton, "block_scores"):
        return _scores_torch(q, summaries, slots, lo, hi, num_cols, mode)
    B, H, D = q.shape
    out = torch.empty(B, num_cols, dtype=torch.float32, device=q.device)
    if B == 0:
        return out
    # the kernel reads slots/lo/hi at unit stride: a column of packed decode rows is not
    slots, lo, hi = slots.contiguous(), lo.contiguous(), hi.contiguous()
    block_n = 16
    _scores_kernel[(B, triton.cdiv(num_cols, block_n))](
        q, summaries, slots, lo, hi, out, H, H // summaries.shape[3], D, num_cols,
        *q.stride(), *summaries.stride(), *out.stride(),
        MINMAX=mode == "minmax", BLOCK_N=block_n, BLOCK_D=max(16, next_pow2(D)), num_warps=4,
    )
    return out


def topk_blocks(scores: torch.Tensor, k: int, force_triton: Optional[bool] = None) -> torch.Tensor:
    """The k best columns of each row, best first, ties to the lower index; int64 `[B, k]`."""
    _validate_topk(scores, k)
    if not use_triton((scores,), force_triton, "topk_blocks"):
        return torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k].contiguous()
    B, N = scores.shape
    out = torch.empty(B, k, dtype=torch.int64, device=scores.device)
    if B == 0:
        return out
    _topk_kernel[(B,)](scores, out, N, k, *scores.stride(), *out.stride(), BLOCK_N=max(16, next_pow2(N)),
                       num_warps=4)
    return out
