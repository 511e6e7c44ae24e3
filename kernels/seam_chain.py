"""One linear layer's PIC seam chain in one kernel launch: the computed ranges' recurrences
and the spliced pieces' state compositions, in prompt order, from one start state.

engine.pic.fused walks a request's events per linear layer: a computed range (a seam, an
uncached segment, the suffix) runs the layer's recurrence from the current state S, a
spliced piece composes S. Run as separate calls that is ~2 small launches per event and
layer, whose host overhead dominates a warm request on the GPU. `seam_chain` does all of a
layer's events in ONE launch: one program per (head, dv block) keeps its S tile in
registers and walks the event table. A dense (delta) composition does not hold T: the
program writes its S tile to its own tile of the S output (scratch until the final store)
and multiplies T's column chunks by S's row chunks read back from there (`ChainLaunch`).

State orientation (docs/ARCHITECTURE.md): S `[H, dk, dv]` float32, S_t = T_t S_{t-1} + u_t.
Per token of a computed range (the families of engine.models.layers.linear_ops, q/k as
given, i.e. already l2-normalised and repeated to the value heads):

| family   | update                                                     |
|----------|------------------------------------------------------------|
| `scalar` | S = exp(g_t) S + k_t v_t^T                                 |
| `diag`   | S = exp(g_t)[:, None] * S + k_t v_t^T                      |
| `delta`  | S = exp(g_t) S; S += k_t (beta_t (v_t - S^T k_t))^T        |

and o_t = S^T (scale q_t). Events (`ChainEvents`, built on the host once per layer):

| kind       | code | effect                                                         |
|------------|------|----------------------------------------------------------------|
| compute    | 0    | the recurrence over tokens [lo, hi) of `inp`, o written there  |
| set        | 1    | S = E[e] (a first placement; a delta piece whose heads all forgot) |
| add        | 2    | S = S + E[e] (naive addition)                                  |
| compose    | 3    | S = T S + E[e], T per head from row `t_row[event, h]` of the T stack: scalar `exp(T[r])`, diag `exp(T[r])[:, None]`, delta dense `T[r] @ S` (row -1: that head forgot, S = E) |

Numerics: everything in float32 (inputs, E and T may be bf16/fp16; widened on load); the
dense product uses IEEE float32 (no TF32). The Triton kernel takes dk, dv <= 128.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from kernels.backend import HAS_TRITON, next_pow2, tl, triton, use_triton
from kernels.errors import KernelInputError
from kernels.recurrence import RecurrenceInputs, naive_recurrence

__all__ = ["ChainEvents", "ChainLaunch", "seam_chain", "seam_chain_reference", "COMPUTE", "SET", "ADD", "COMPOSE"]

COMPUTE, SET, ADD, COMPOSE = 0, 1, 2, 3
_FAMILY_CODE = {"scalar": 0, "diag": 1, "delta": 2}
#: the recurrence families this kernel (and its reference) serves; kda is not among them
CHAIN_FAMILIES = tuple(_FAMILY_CODE)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_DIM_TRITON = 128


@dataclass
class ChainEvents:
    """One layer's events in prompt order (module docstring).

    table: int32 `[n, 3]` rows (kind, a, b): compute (0, lo, hi); set/add (code, e, 0);
    compose (3, e, 0). e indexes `E`. t_row: int32 `[n, H]`, the T-stack row of each
    (compose event, head), -1 = forgotten head (T = 0); other events' rows are ignored.
    E: `[nE, H, dk, dv]`. T: scalar `[R]`, diag `[R, dk]`, delta `[R, dk, dk]`, or None
    when no event composes."""

    table: torch.Tensor
    t_row: torch.Tensor
    E: torch.Tensor
    T: Optional[torch.Tensor] = None

    @property
    def num_events(self) -> int:
        return int(self.table.shape[0])


@dataclass(frozen=True)
class ChainLaunch:
    """The Triton kernel's launch shape: fixed per call, never autotuned. None: the rule.

    block_v: dv columns per program, a power of two >= 16 (rule: delta with dk > 64: 16;
    else 32 when dk > 64, else 64; at most next_pow2(dv)). num_warps: rule 2 for delta
    with dk > 64, else 4. compose_chunk: a delta composition multiplies T's column chunks
    `[BLOCK_K, chunk]` with S's row chunks read back from the program's scratch tile (16,
    32 or 64); 0 = the whole `[BLOCK_K, BLOCK_K]` T in registers against S (kept to
    compare: at dk = 128 its operands spill ~19 KB per thread in ptxas -v
    for sm_90, tools/ptxas_seam_chain.py, and it ran 4.2 ms per layer call on the H200
    against 0.24-0.32 ms chunked). prefetch (rule: on): a computed range loads token t + 1's
    inputs while token t updates S (hides the loads' latency on the serial token walk).
    The rules are the fastest shapes of tools/check_seam_chain.py on an H200 (bench
    presets' shapes, 10 pieces, seam 16, bf16): delta 0.241 ms at bv 16 / 2 warps (0.317
    at bv 32 / 8 warps), diag 0.157 ms with
    prefetch (0.254 without), scalar 0.102-0.112 ms with prefetch (0.170-0.190 without)."""

    block_v: Optional[int] = None
    num_warps: Optional[int] = None
    compose_chunk: int = 16
    prefetch: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.block_v is not None and (self.block_v < 16 or self.block_v & (self.block_v - 1)):
            raise KernelInputError(f"ChainLaunch.block_v={self.block_v} must be a power of two >= 16")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise KernelInputError(f"ChainLaunch.num_warps={self.num_warps} must be one of 1, 2, 4, 8, 16")
        if self.compose_chunk not in (0, 16, 32, 64):
            raise KernelInputError(f"ChainLaunch.compose_chunk={self.compose_chunk} must be 0, 16, 32 or 64")

    def resolve(self, family: str, dk: int, dv: int) -> tuple[int, int, int, bool]:
        """(BLOCK_K, BLOCK_V, num_warps, prefetch) for this family and these dims."""
        block_k = max(16, next_pow2(dk))
        wide_delta = family == "delta" and dk > 64
        block_v = self.block_v or max(16, min(next_pow2(dv), 16 if wide_delta else 32 if dk > 64 else 64))
        num_warps = self.num_warps or (2 if wide_delta else 4)
        prefetch = self.prefetch if self.prefetch is not None else True
        return block_k, block_v, num_warps, prefetch


def _validate(family: str, inp: RecurrenceInputs, S0: torch.Tensor, ev: ChainEvents,
              out: Optional[torch.Tensor] = None) -> None:
    if family not in _FAMILY_CODE:
        raise KernelInputError(f"family={family!r} has no seam-chain kernel (one of {CHAIN_FAMILIES})")
    b, t, h, dk, dv = inp.shape
    if b != 1:
        raise KernelInputError(f"seam_chain takes one sequence (B=1), got q of shape {tuple(inp.q.shape)}")
    want_g = (1, t, h, dk) if family == "diag" else (1, t, h)
    if tuple(inp.log_decay.shape) != want_g:
        raise KernelInputError(f"{family} log_decay must have shape {want_g}, got {tuple(inp.log_decay.shape)}")
    if family == "delta" and (inp.beta is None or tuple(inp.beta.shape) != (1, t, h)):
        raise KernelInputError(f"delta needs beta of shape {(1, t, h)}, got "
                               f"{None if inp.beta is None else tuple(inp.beta.shape)}")
    if tuple(S0.shape) != (h, dk, dv):
        raise KernelInputError(f"S0 must have shape {(h, dk, dv)}, got {tuple(S0.shape)}")
    if out is not None and (out.shape != inp.v.shape or out.dtype != inp.v.dtype):
        raise KernelInputError(f"out must be {inp.v.dtype} {tuple(inp.v.shape)} like v, got {out.dtype} "
                               f"{tuple(out.shape)}")
    n = ev.num_events
    if ev.table.dim() != 2 or ev.table.shape[1] != 3 or ev.table.dtype != torch.int32:
        raise KernelInputError(f"events.table must be int32 [n, 3], got {ev.table.dtype} {tuple(ev.table.shape)}")
    if tuple(ev.t_row.shape) != (n, h) or ev.t_row.dtype != torch.int32:
        raise KernelInputError(f"events.t_row must be int32 {(n, h)}, got {ev.t_row.dtype} {tuple(ev.t_row.shape)}")
    if ev.E.dim() != 4 or tuple(ev.E.shape[1:]) != (h, dk, dv):
        raise KernelInputError(f"events.E must be [nE, {h}, {dk}, {dv}], got {tuple(ev.E.shape)}")
    if ev.T is not None:
        want = {"scalar": 1, "diag": 2, "delta": 3}[family]
        tail = {"scalar": (), "diag": (dk,), "delta": (dk, dk)}[family]
        if ev.T.dim() != want or tuple(ev.T.shape[1:]) != tail:
            raise KernelInputError(f"{family} events.T must be [R{''.join(f', {d}' for d in tail)}], "
                                   f"got {tuple(ev.T.shape)}")
    for name, x in (("E", ev.E), ("T", ev.T), ("q", inp.q), ("v", inp.v)):
        if x is not None and x.dtype not in _FLOAT_DTYPES:
            raise KernelInputError(f"{name} dtype must be one of {_FLOAT_DTYPES}, got {x.dtype}")


# --------------------------------------------------------------------------- reference
def _compose_ref(family, S, E, T, rows):
    out = E.clone()
    for h, r in enumerate(rows):
        if r < 0:
            continue
        if family == "delta":
            out[h] += T[r].float() @ S[h]
        elif family == "diag":
            out[h] += torch.exp(T[r].float())[:, None] * S[h]
        else:
            out[h] += torch.exp(T[r].float()) * S[h]
    return out


def seam_chain_reference(inp: RecurrenceInputs, S0: torch.Tensor, events: ChainEvents, family: str,
                         out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `seam_chain`: per event, the token-by-token recurrence
    (linear_ops.naive_recurrence) from the current state, or the composition."""
    _validate(family, inp, S0, events, out)
    S = S0.to(torch.float32).clone()
    o = torch.zeros(inp.v.shape, dtype=inp.v.dtype, device=inp.v.device) if out is None else out
    table, rows = events.table.tolist(), events.t_row.tolist()
    for i, (kind, a, b) in enumerate(table):
        if kind == COMPUTE:
            oi, st = naive_recurrence(family, inp.slice_time(a, b), S[None])
            o[:, a:b] = oi
            S = st[0]
            continue
        E = events.E[a].to(device=S.device, dtype=torch.float32)
        if kind == SET:
            S = E.clone()
        elif kind == ADD:
            S = S + E
        elif kind == COMPOSE:
            S = _compose_ref(family, S, E, events.T, rows[i])
        else:
            raise KernelInputError(f"event {i}: kind {kind} must be one of 0..3")
    return o, S


# --------------------------------------------------------------------------- triton
if HAS_TRITON:

    @triton.jit
    def _token_inputs(q_t, k_t, v_t, g_t, b_t, rk, s_gk, kmask, vmask, live, scale, FAMILY: tl.constexpr):
        """One token's k, v, scale q, decay factor exp(g) (a vector for diag) and beta (delta;
        the decay again otherwise, unused), float32; `live` False: zeros, nothing read."""
        kt = tl.load(k_t, mask=kmask & live, other=0.0).to(tl.float32)
        vt = tl.load(v_t, mask=vmask & live, other=0.0).to(tl.float32)
        qt = tl.load(q_t, mask=kmask & live, other=0.0).to(tl.float32) * scale
        if FAMILY == 1:
            gt = tl.exp(tl.load(g_t + rk * s_gk, mask=kmask & live, other=0.0).to(tl.float32))
        else:
            gt = tl.exp(tl.load(g_t, mask=live, other=0.0).to(tl.float32))
        if FAMILY == 2:
            bt = tl.load(b_t, mask=live, other=0.0).to(tl.float32)
        else:
            bt = gt
        return kt, vt, qt, gt, bt

    @triton.jit
    def _dense_compose(S, E, t_row_ptr, s_head_ptr, rk, rv, kmask, vmask, tile_mask, dk, dv,
                       CHUNK: tl.constexpr):
        """T S + E for the program's S tile `[BLOCK_K, BLOCK_V]` without holding T: S goes to
        the program's own scratch tile, then T's column chunks `[BLOCK_K, CHUNK]` meet S's row
        chunks `[CHUNK, BLOCK_V]` read back from it (IEEE float32 products). The barriers
        order the whole program's scratch writes before the reads, and the reads before the
        next write (the next compose, or the final store of S)."""
        tl.store(s_head_ptr + rk[:, None] * dv + rv[None, :], S, mask=tile_mask)
        tl.debug_barrier()
        rc = tl.arange(0, CHUNK)
        acc = E
        for kc in range(0, dk, CHUNK):
            ck = kc + rc
            cmask = ck < dk
            Tc = tl.load(t_row_ptr + rk[:, None] * dk + ck[None, :], mask=kmask[:, None] & cmask[None, :],
                         other=0.0).to(tl.float32)
            Sc = tl.load(s_head_ptr + ck[:, None] * dv + rv[None, :], mask=cmask[:, None] & vmask[None, :],
                         other=0.0)
            acc = tl.dot(Tc, Sc, acc, input_precision="ieee")
        tl.debug_barrier()
        return acc

    # One compiled variant per family and block shape, not a recompilation at a request's
    # first use: n_events changes with every request (no per-value specialisation), and the
    # event tables are slices of a layer's table at any row (no 16-byte alignment key;
    # they are read one scalar at a time)
    @triton.jit(do_not_specialize=["n_events", "ev_ptr", "trow_ptr"])
    def _seam_chain_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
        s0_ptr, sout_ptr, e_ptr, t_ptr, ev_ptr, trow_ptr,
        n_events, num_heads, dk, dv, scale,
        s_qt, s_qh, s_qk, s_kt, s_kh, s_kk, s_vt, s_vh, s_vv,
        s_gt, s_gh, s_gk, s_bt, s_bh, s_ot, s_oh, s_ov,
        s_sh, s_sk, s_sv,
        FAMILY: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
        COMPOSE_CHUNK: tl.constexpr, PREFETCH: tl.constexpr,
    ):
        pid_v = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        rk = tl.arange(0, BLOCK_K)
        rv = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        kmask = rk < dk
        vmask = rv < dv
        tile_mask = kmask[:, None] & vmask[None, :]
        S = tl.load(s0_ptr + h * s_sh + rk[:, None] * s_sk + rv[None, :] * s_sv,
                    mask=tile_mask, other=0.0).to(tl.float32)
        # E stack contiguous [nE, H, dk, dv]: a 64-bit head base, 32-bit offsets in the tile
        # (a [BLOCK_K, BLOCK_V] int64 offset tile would hold two registers per element)
        e_head = h * dk * dv
        e_tile = rk[:, None] * dv + rv[None, :]
        q_h = q_ptr + h * s_qh + rk * s_qk
        k_h = k_ptr + h * s_kh + rk * s_kk
        v_h = v_ptr + h * s_vh + rv * s_vv
        o_h = o_ptr + h * s_oh + rv * s_ov
        for i in range(0, n_events):
            kind = tl.load(ev_ptr + i * 3)
            a = tl.load(ev_ptr + i * 3 + 1)
            b = tl.load(ev_ptr + i * 3 + 2)
            if kind == 0:
                a64 = a.to(tl.int64)  # pointers advance per token (64-bit arithmetic)
                q_t = q_h + a64 * s_qt
                k_t = k_h + a64 * s_kt
                v_t = v_h + a64 * s_vt
                o_t = o_h + a64 * s_ot
                g_t = g_ptr + a64 * s_gt + h * s_gh
                b_t = beta_ptr + a64 * s_bt + h * s_bh
                if PREFETCH:  # token a's inputs now, token t + 1's while token t runs
                    nk, nv, nq, ng, nb = _token_inputs(q_t, k_t, v_t, g_t, b_t, rk, s_gk, kmask, vmask,
                                                       a < b, scale, FAMILY)
                for t in range(a, b):
                    if PREFETCH:
                        kt, vt, qt, gt, bt = nk, nv, nq, ng, nb
                        q_t += s_qt
                        k_t += s_kt
                        v_t += s_vt
                        g_t += s_gt
                        b_t += s_bt
                        nk, nv, nq, ng, nb = _token_inputs(q_t, k_t, v_t, g_t, b_t, rk, s_gk, kmask, vmask,
                                                           t + 1 < b, scale, FAMILY)
                    else:
                        kt, vt, qt, gt, bt = _token_inputs(q_t, k_t, v_t, g_t, b_t, rk, s_gk, kmask, vmask,
                                                           t < b, scale, FAMILY)
                        q_t += s_qt
                        k_t += s_kt
                        v_t += s_vt
                        g_t += s_gt
                        b_t += s_bt
                    if FAMILY == 1:
                        S = S * gt[:, None]
                    else:
                        S = S * gt
                    if FAMILY == 2:
                        vt = bt * (vt - tl.sum(S * kt[:, None], axis=0))
                    S = S + kt[:, None] * vt[None, :]
                    ot = tl.sum(S * qt[:, None], axis=0)
                    tl.store(o_t, ot.to(o_ptr.dtype.element_ty), mask=vmask)
                    o_t += s_ot
            else:
                E = tl.load(e_ptr + (a.to(tl.int64) * num_heads * dk * dv + e_head) + e_tile,
                            mask=tile_mask, other=0.0).to(tl.float32)
                if kind == 1:
                    S = E
                elif kind == 2:
                    S = S + E
                else:
                    row = tl.load(trow_ptr + i * num_heads + h)
                    if row < 0:  # this head forgot what came before
                        S = E
                    else:
                        r64 = row.to(tl.int64)
                        if FAMILY == 2:
                            if COMPOSE_CHUNK == 0:  # the whole T in registers (slow: spills)
                                Tm = tl.load(t_ptr + r64 * dk * dk + rk[:, None] * dk + rk[None, :],
                                             mask=kmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
                                S = tl.dot(Tm, S, input_precision="ieee") + E
                            else:
                                S = _dense_compose(S, E, t_ptr + r64 * dk * dk, sout_ptr + h * dk * dv, rk, rv,
                                                   kmask, vmask, tile_mask, dk, dv, COMPOSE_CHUNK)
                        elif FAMILY == 1:
                            d = tl.load(t_ptr + r64 * dk + rk, mask=kmask, other=0.0).to(tl.float32)
                            S = S * tl.exp(d)[:, None] + E
                        else:
                            S = S * tl.exp(tl.load(t_ptr + r64).to(tl.float32)) + E
        tl.store(sout_ptr + e_head + e_tile, S, mask=tile_mask)


def _chain_triton(family, inp, S0, ev, out, launch: "ChainLaunch"):
    _, t, h, dk, dv = inp.shape
    if inp.v.stride(-1) != 1:  # channel-first conv outputs (engine.pic.conv_ranges): token-major
        inp = replace(inp, v=inp.v.contiguous())  # rows, as the kernel's loads are compiled for
    o = torch.empty(inp.v.shape, dtype=inp.v.dtype, device=inp.v.device) if out is None else out
    s_out = torch.empty(h, dk, dv, dtype=torch.float32, device=S0.device)
    block_k, block_v, num_warps, prefetch = launch.resolve(family, dk, dv)
    E = ev.E.contiguous()
    T = ev.T.contiguous() if ev.T is not None else E  # placeholder, never read without a compose
    g = inp.log_decay
    g_strides = (g.stride(1), g.stride(2), g.stride(3) if g.dim() == 4 else 0)
    beta = inp.beta if inp.beta is not None else g
    b_strides = (beta.stride(1), beta.stride(2))
    table, t_row = ev.table.contiguous(), ev.t_row.contiguous()
    grid = (triton.cdiv(dv, block_v), h)
    _seam_chain_kernel[grid](
        inp.q, inp.k, inp.v, g, beta, o,
        S0, s_out, E, T, table, t_row,
        ev.num_events, h, dk, dv, float(inp.scale),
        *inp.q.stride()[1:], *inp.k.stride()[1:], *inp.v.stride()[1:],
        *g_strides, *b_strides, *o.stride()[1:],
        *S0.stride(),
        FAMILY=_FAMILY_CODE[family], BLOCK_K=block_k, BLOCK_V=block_v,
        COMPOSE_CHUNK=launch.compose_chunk, PREFETCH=prefetch, num_warps=num_warps,
    )
    return o, s_out


def seam_chain(inp: RecurrenceInputs, S0: torch.Tensor, events: ChainEvents, family: str,
               force_triton: Optional[bool] = None, out: Optional[torch.Tensor] = None,
               launch: Optional[ChainLaunch] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """All of one linear layer's events in prompt order (module docstring).

    inp: the layer's computed tokens, concatenated in prompt order (B = 1). S0: start state
    `[H, dk, dv]`. Returns (o `[1, T, H, dv]` in v's dtype, final S `[H, dk, dv]` float32).
    out: o is written there (only the rows of this chain's computed ranges; the caller
    may run other ranges elsewhere, e.g. long ones through a chunked kernel). launch: the
    Triton kernel's launch shape (`ChainLaunch`; None: the defaults).
    Runs the Triton kernel on CUDA / under the interpreter (kernels.backend rule) when
    dk, dv <= 128, the reference otherwise."""
    _validate(family, inp, S0, events, out)
    _, _, _, dk, dv = inp.shape
    tensors = (inp.q, inp.k, inp.v, inp.log_decay, inp.beta, S0, events.E, events.T)
    too_big = dk > MAX_DIM_TRITON or dv > MAX_DIM_TRITON
    if too_big or not use_triton(tensors, force_triton, "seam_chain"):
        return seam_chain_reference(inp, S0, events, family, out)
    if S0.dtype != torch.float32:
        S0 = S0.float()
    return _chain_triton(family, inp, S0, events, out, launch or ChainLaunch())
