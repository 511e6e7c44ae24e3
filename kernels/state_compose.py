"""Batched composition of linear-attention states across cached segments.

Owns the PIC splice of linear layers. Each cached segment j carries its zero-start end
state E_j and its segment-cumulative transition operator T_j; a start state S0 followed by
segments 1..m ends in
    S = T_m( ... T_2(T_1 S0 + E_1) + E_2 ... ) + E_m.
State orientation (docs/ARCHITECTURE.md): S `[B, H, dk, dv]` float32, S_t = T_t S_{t-1} +
k_t v_t^T, so T acts on the key dim from the left.

Transition families, by the shape of `T` (`[m, B, H, ...]`):
  * "scalar"   `[m, B, H]`         log-decay sum per head;  T = exp(logT) I
  * "diagonal" `[m, B, H, dk]`     log-decay sums (GLA);    T = diag(exp(logT))
  * "dense"    `[m, B, H, dk, dk]` gated delta rule;        S' = T @ S
  * None       no operator: naive addition, S = S0 + sum_j E_j (the baseline).
`apply_t` (`[m]` or `[m, B]` bool) marks, per segment (and batch row), whether its T is
applied; where False that segment is added without T (identity). Rows of a batch with fewer
segments are padded with E = 0 and apply_t = False.

Numerics: everything in float32 (T and E may be stored in a lower precision; they are
widened on load). exp of a log-decay sum that underflows gives exactly 0, which is the right
answer: the prefix is forgotten. The dense product uses IEEE float32 (no TF32).
On CUDA the Triton kernel keeps a dense T in registers, so it takes dk <= 128; larger dense
operators run the torch reference (one batched matmul per segment).
"""
from __future__ import annotations

from typing import Optional

import torch

from kernels.backend import HAS_TRITON, next_pow2, tl, triton, use_triton
from kernels.errors import KernelInputError

__all__ = ["state_compose", "state_compose_reference", "transition_kind"]

_KIND_CODE = {"none": 0, "scalar": 1, "diagonal": 2, "dense": 3}
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_DENSE_DK_TRITON = 128


def transition_kind(T: Optional[torch.Tensor]) -> str:
    """"none", "scalar", "diagonal" or "dense", from the rank of T `[m, B, H, ...]`."""
    if T is None:
        return "none"
    kinds = {3: "scalar", 4: "diagonal", 5: "dense"}
    if T.dim() not in kinds:
        raise KernelInputError(
            f"T must be [m,B,H] (scalar), [m,B,H,dk] (diagonal) or [m,B,H,dk,dk] (dense), "
            f"got shape {tuple(T.shape)}")
    return kinds[T.dim()]


def _validate(E, T, S0, apply_t, out):
    if E.dim() != 5:
        raise KernelInputError(f"E must be [m, B, H, dk, dv], got shape {tuple(E.shape)}")
    m, B, H, dk, dv = E.shape
    kind = transition_kind(T)
    want_t = {"none": None, "scalar": (m, B, H), "diagonal": (m, B, H, dk), "dense": (m, B, H, dk, dk)}[kind]
    if T is not None and tuple(T.shape) != want_t:
        raise KernelInputError(f"{kind} T must have shape {want_t} to match E, got {tuple(T.shape)}")
    for name, t in (("E", E), ("T", T)):
        if t is not None and t.dtype not in _FLOAT_DTYPES:
            raise KernelInputError(f"{name} dtype must be one of {_FLOAT_DTYPES}, got {t.dtype}")
    for name, t in (("S0", S0), ("out", out)):
        if t is None:
            continue
        if tuple(t.shape) != (B, H, dk, dv):
            raise KernelInputError(f"{name} must have shape {(B, H, dk, dv)}, got {tuple(t.shape)}")
        if t.dtype != torch.float32:
            raise KernelInputError(f"{name} must be float32, got {t.dtype}")
    if apply_t is not None:
        if T is None:
            raise KernelInputError("apply_t given but T is None (no operator to apply)")
        if tuple(apply_t.shape) == (m,):
            apply_t = apply_t[:, None].expand(m, B)
        if tuple(apply_t.shape) != (m, B):
            raise KernelInputError(f"apply_t must have shape ({m},) or ({m}, {B}), got {tuple(apply_t.shape)}")
        if apply_t.dtype != torch.bool:
            raise KernelInputError(f"apply_t must be bool, got {apply_t.dtype}")
    devices = {t.device for t in (E, T, S0, apply_t, out) if t is not None}
    if len(devices) != 1:
        raise KernelInputError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    return kind, apply_t


# --------------------------------------------------------------------------- reference
def state_compose_reference(E: torch.Tensor, T: Optional[torch.Tensor],
                            S0: Optional[torch.Tensor] = None, *,
                            apply_t: Optional[torch.Tensor] = None,
                            out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Torch reference of `state_compose` (same arguments and result)."""
    kind, apply_t = _validate(E, T, S0, apply_t, out)
    return _compose_torch(E, T, S0, kind, apply_t, out)


def _compose_torch(E, T, S0, kind, apply_t, out):
    m, B, H, dk, dv = E.shape
    S = torch.zeros(B, H, dk, dv, dtype=torch.float32, device=E.device) if S0 is None else S0.float().clone()
    for j in range(m):
        if kind == "scalar":
            applied = torch.exp(T[j].float())[..., None, None] * S
        elif kind == "diagonal":
            applied = torch.exp(T[j].float())[..., None] * S
        elif kind == "dense":
            applied = torch.matmul(T[j].float(), S)
        else:
            applied = S
        if apply_t is not None:
            applied = torch.where(apply_t[j][:, None, None, None], applied, S)
        S = applied + E[j].float()
    if out is None:
        return S
    out.copy_(S)
    return out


# --------------------------------------------------------------------------- triton
if HAS_TRITON:

    @triton.jit
    def _state_compose_kernel(
        s0_ptr, e_ptr, t_ptr, mask_ptr, out_ptr,
        m, num_heads, dk, dv,
        s_s0b, s_s0h, s_s0k, s_s0v,
        s_ej, s_eb, s_eh, s_ek, s_ev,
        s_tj, s_tb, s_th, s_tr, s_tc,
        s_mj, s_mb,
        s_ob, s_oh, s_ok, s_ov,
        KIND: tl.constexpr, HAS_S0: tl.constexpr, HAS_MASK: tl.constexpr,
        BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        pid_bh = tl.program_id(0)
        pid_v = tl.program_id(1)
        b = (pid_bh // num_heads).to(tl.int64)
        h = (pid_bh % num_heads).to(tl.int64)
        rk = tl.arange(0, BLOCK_K)
        rv = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        kmask = rk < dk
        tile_mask = kmask[:, None] & (rv < dv)[None, :]

        if HAS_S0:
            S = tl.load(s0_ptr + b * s_s0b + h * s_s0h + rk[:, None] * s_s0k + rv[None, :] * s_s0v,
                        mask=tile_mask, other=0.0).to(tl.float32)
        else:
            S = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)

        e_cur = e_ptr + b * s_eb + h * s_eh + rk[:, None] * s_ek + rv[None, :] * s_ev
        t_cur = t_ptr + b * s_tb + h * s_th
        m_cur = mask_ptr + b * s_mb
        for _ in range(0, m):  # pointers advance by one segment per step (64-bit arithmetic)
            if KIND == 1:
                factor = tl.exp(tl.load(t_cur).to(tl.float32))
                if HAS_MASK:
                    factor = tl.where(tl.load(m_cur) != 0, factor, 1.0)
                S = S * factor
            elif KIND == 2:
                factor = tl.exp(tl.load(t_cur + rk * s_tr, mask=kmask, other=0.0).to(tl.float32))
                if HAS_MASK:
                    factor = tl.where(tl.load(m_cur) != 0, factor, 1.0)
                S = S * factor[:, None]
            elif KIND == 3:
                Tm = tl.load(t_cur + rk[:, None] * s_tr + rk[None, :] * s_tc,
                             mask=kmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
                TS = tl.dot(Tm, S, input_precision="ieee")
                if HAS_MASK:
                    S = tl.where(tl.load(m_cur) != 0, TS, S)
                else:
                    S = TS
            S = S + tl.load(e_cur, mask=tile_mask, other=0.0).to(tl.float32)
            e_cur += s_ej
            t_cur += s_tj
            m_cur += s_mj

        tl.store(out_ptr + b * s_ob + h * s_oh + rk[:, None] * s_ok + rv[None, :] * s_ov, S, mask=tile_mask)


def _compose_triton(E, T, S0, kind, apply_t, out):
    m, B, H, dk, dv = E.shape
    block_k = max(16, next_pow2(dk))
    if kind == "dense":
        block_v = max(16, min(next_pow2(dv), 32 if dk > 64 else 64))
        num_warps = 8 if dk > 64 else 4
    else:
        block_v = max(16, min(next_pow2(dv), 64))
        num_warps = 4
    t = T if T is not None else E  # placeholder pointer, never read when KIND == 0
    t_strides = list(T.stride()) + [0] * (5 - T.dim()) if T is not None else [0] * 5
    mask = apply_t.to(torch.int8) if apply_t is not None else E
    m_strides = mask.stride()[:2] if apply_t is not None else (0, 0)
    s0 = S0 if S0 is not None else out
    grid = (B * H, triton.cdiv(dv, block_v))
    if m == 0 and S0 is None:
        out.zero_()
        return out
    _state_compose_kernel[grid](
        s0, E, t, mask, out,
        m, H, dk, dv,
        *s0.stride(), *E.stride(), *t_strides, *m_strides, *out.stride(),
        KIND=_KIND_CODE[kind], HAS_S0=S0 is not None, HAS_MASK=apply_t is not None,
        BLOCK_K=block_k, BLOCK_V=block_v, num_warps=num_warps,
    )
    return out


def state_compose(E: torch.Tensor, T: Optional[torch.Tensor], S0: Optional[torch.Tensor] = None, *,
                  apply_t: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                  force_triton: Optional[bool] = None) -> torch.Tensor:
    """S = T_m(...T_2(T_1 S0 + E_1) + E_2...) + E_m, batched; returns S `[B, H, dk, dv]` float32.

    E: end states `[m, B, H, dk, dv]`. T: operators, family by shape (module docstring) or
    None for naive addition. S0: start states `[B, H, dk, dv]` float32, None = zeros.
    apply_t: bool `[m]` or `[m, B]`, False = that segment is added without its T.
    out: float32 `[B, H, dk, dv]` to write into (may be S0 itself: in-place update of the
    state slots); a new tensor when None."""
    kind, apply_t = _validate(E, T, S0, apply_t, out)
    dense_too_big = kind == "dense" and E.shape[3] > MAX_DENSE_DK_TRITON
    if dense_too_big or not use_triton((E, T, S0, out), force_triton, "state_compose"):
        return _compose_torch(E, T, S0, kind, apply_t, out)
    if out is None:
        out = torch.empty(E.shape[1:], dtype=torch.float32, device=E.device)
    return _compose_triton(E, T, S0, kind, apply_t, out)
