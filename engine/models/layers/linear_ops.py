"""The linear-attention recurrences in pure torch: a naive token-by-token loop (the test
reference), a chunked parallel-within-chunk form (the CPU prefill path), and the
segment transition operator T that position-independent caching needs.

All four families share one recurrence over a state S of shape `[B, H, K, V]` (float32;
fla's `[N, H, K, V]` orientation):

    S_t = T_t S_{t-1} + u_t,         o_t = S_t^T (scale * q_t)

| family   | T_t                                  | u_t                | log_decay shape |
|----------|--------------------------------------|--------------------|-----------------|
| `scalar` | exp(g_t) I                           | k_t v_t^T          | `[B, T, H]`     |
| `diag`   | diag(exp(g_t))                       | k_t v_t^T          | `[B, T, H, K]`  |
| `delta`  | exp(g_t) (I - beta_t k_t k_t^T)      | beta_t k_t v_t^T   | `[B, T, H]`     |
| `kda`    | (I - beta_t k_t k_t^T) diag(exp(g_t))| beta_t k_t v_t^T   | `[B, T, H, K]`  |

`kda` is Kimi Delta Attention (Kimi-Linear): the delta rule with a per-key-channel decay,
applied before the delta update as the reference does (decay the state, then read and
correct it); its transition, like `delta`'s, is a dense `[H, K, K]` matrix.

Inputs are time-first `[B, T, H, D]` like fla. Every exponent computed here is a difference
of cumulative log decays taken over j <= i, so it is <= 0: long sequences whose decay
products underflow give zeros, never inf or NaN.
"""
from __future__ import annotations

from dataclasses import replace

import torch

# The inputs record, the family check and the token-by-token reference live in
# kernels.recurrence (the seam-chain kernel is tested against them); re-exported here.
from kernels.recurrence import (CHANNEL_DECAY_FAMILIES, DENSE_FAMILIES, FAMILIES, RecurrenceInputs,  # noqa: F401
                                check_family, checked_state, naive_recurrence)


def recurrent_step(family: str, inp: RecurrenceInputs,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step (T == 1) for a batch of sequences; same maths as the naive loop."""
    if inp.q.shape[1] != 1:
        raise ValueError(f"recurrent_step takes one token per sequence, got T={inp.q.shape[1]}")
    return naive_recurrence(family, inp, state)


def _cumulative(g: torch.Tensor, dim: int):
    """Within-chunk cumulative log decay G, pairwise differences G_i - G_j (time axes i, j)
    and G_last - G_j. Summed and differenced in float64: G grows like (chunk x |log decay|),
    and float32 differences of two large sums would lose the small exponents that matter."""
    big = g.to(torch.float64).cumsum(dim)
    if dim == -1:
        diff = big[..., :, None] - big[..., None, :]
        to_end = big[..., -1:] - big
    else:  # dim == -2, g [..., L, K]
        diff = big[..., :, None, :] - big[..., None, :, :]
        to_end = big[..., -1:, :] - big
    return big.to(g.dtype), diff.to(g.dtype), to_end.to(g.dtype)


def _chunk_scalar(q, k, v, g, s):
    # q, k [B,H,L,K]; v [B,H,L,V]; g [B,H,L]; s [B,H,K,V]
    big_g, diff, to_end = _cumulative(g, -1)
    n = g.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=g.device).tril()
    decay = torch.exp(diff.masked_fill(~causal, float("-inf")))
    attn = (q @ k.transpose(-1, -2)) * decay
    o = (q * torch.exp(big_g)[..., None]) @ s + attn @ v
    s = torch.exp(big_g[..., -1:])[..., None] * s + (k * torch.exp(to_end)[..., None]).transpose(-1, -2) @ v
    return o, s


def _chunk_diag(q, k, v, g, s):
    # g [B,H,L,K]
    big_g, diff, to_end = _cumulative(g, -2)  # diff [B,H,L,L,K]
    n = g.shape[-2]
    causal = torch.ones(n, n, dtype=torch.bool, device=g.device).tril()[..., None]
    decay = torch.exp(diff.masked_fill(~causal, float("-inf")))
    attn = torch.einsum("bhik,bhjk,bhijk->bhij", q, k, decay)
    o = (q * torch.exp(big_g)) @ s + attn @ v
    s = torch.exp(big_g[..., -1:, :]).transpose(-1, -2) * s + (k * torch.exp(to_end)).transpose(-1, -2) @ v
    return o, s


def _chunk_delta(q, k, v, g, beta, s):
    # WY/UT form. u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t); S_t = exp(g_t) S_{t-1} + k_t u_t^T.
    # (I + L) U = diag(beta) V - diag(beta * Gamma) K S0, L_ij = beta_i (Gamma_i/Gamma_j) k_i.k_j, j < i.
    big_g, diff, to_end = _cumulative(g, -1)
    n = g.shape[-1]
    incl = torch.ones(n, n, dtype=torch.bool, device=g.device).tril()
    strict = incl.clone()
    strict.fill_diagonal_(False)
    decay_incl = torch.exp(diff.masked_fill(~incl, float("-inf")))
    decay_strict = torch.exp(diff.masked_fill(~strict, float("-inf")))
    gamma = torch.exp(big_g)
    lower = beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay_strict
    eye = torch.eye(n, dtype=q.dtype, device=q.device)
    a = eye + lower
    w = torch.linalg.solve_triangular(a, (beta * gamma)[..., None] * k, upper=False, unitriangular=True)
    u0 = torch.linalg.solve_triangular(a, beta[..., None] * v, upper=False, unitriangular=True)
    u = u0 - w @ s
    o = (q * gamma[..., None]) @ s + ((q @ k.transpose(-1, -2)) * decay_incl) @ u
    s = torch.exp(big_g[..., -1:])[..., None] * s + (k * torch.exp(to_end)[..., None]).transpose(-1, -2) @ u
    return o, s


def _chunk_kda(q, k, v, g, beta, s):
    # _chunk_delta with a per-channel decay. G_i [K] the cumulative log decay (inclusive),
    # u_i = beta_i (v_i - (diag(Gamma_i) S0 + sum_{j<i} diag(Gamma_i/Gamma_j) k_j u_j^T)^T k_i):
    # (I + L) U = diag(beta) V - diag(beta) (K * Gamma) S0, L_ij = beta_i sum_c k_ic k_jc e^{G_ic - G_jc}, j < i.
    big_g, diff, to_end = _cumulative(g, -2)  # g [B,H,L,K]; diff [B,H,L,L,K]
    n = g.shape[-2]
    incl = torch.ones(n, n, dtype=torch.bool, device=g.device).tril()
    strict = incl.clone()
    strict.fill_diagonal_(False)
    decay_incl = torch.exp(diff.masked_fill(~incl[..., None], float("-inf")))
    gamma = torch.exp(big_g)
    kk = torch.einsum("bhik,bhjk,bhijk->bhij", k, k, decay_incl) * strict
    lower = beta[..., :, None] * kk
    eye = torch.eye(n, dtype=q.dtype, device=q.device)
    a = eye + lower
    w = torch.linalg.solve_triangular(a, beta[..., None] * k * gamma, upper=False, unitriangular=True)
    u0 = torch.linalg.solve_triangular(a, beta[..., None] * v, upper=False, unitriangular=True)
    u = u0 - w @ s
    o = (q * gamma) @ s + torch.einsum("bhik,bhjk,bhijk->bhij", q, k, decay_incl) @ u
    s = torch.exp(big_g[..., -1:, :]).transpose(-1, -2) * s + (k * torch.exp(to_end)).transpose(-1, -2) @ u
    return o, s


def chunked_recurrence(family: str, inp: RecurrenceInputs, initial_state: torch.Tensor | None = None,
                       chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Parallel-within-chunk form, float32; equals `naive_recurrence` up to rounding.
    Returns (o `[B, T, H, V]` in v's dtype, S `[B, H, K, V]` float32)."""
    check_family(family, inp)
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    s = checked_state(inp, initial_state)
    f32 = torch.float32
    q = (inp.q.to(f32) * inp.scale).transpose(1, 2)
    k = inp.k.to(f32).transpose(1, 2)
    v = inp.v.to(f32).transpose(1, 2)
    g = inp.log_decay.to(f32).transpose(1, 2)
    beta = inp.beta.to(f32).transpose(1, 2) if inp.beta is not None else None
    t_total = q.shape[2]
    outs = []
    for c0 in range(0, t_total, chunk_size):
        c1 = min(t_total, c0 + chunk_size)
        qc, kc, vc, gc = q[:, :, c0:c1], k[:, :, c0:c1], v[:, :, c0:c1], g[:, :, c0:c1]
        if family == "scalar":
            o, s = _chunk_scalar(qc, kc, vc, gc, s)
        elif family == "diag":
            o, s = _chunk_diag(qc, kc, vc, gc, s)
        elif family == "kda":
            o, s = _chunk_kda(qc, kc, vc, gc, beta[:, :, c0:c1], s)
        else:
            o, s = _chunk_delta(qc, kc, vc, gc, beta[:, :, c0:c1], s)
        outs.append(o)
    if outs:
        o = torch.cat(outs, dim=2).transpose(1, 2)
    else:
        o = torch.zeros_like(inp.v, dtype=f32)
    return o.to(inp.v.dtype), s


def transition_operator(family: str, inp: RecurrenceInputs, chunk_size: int = 64,
                        naive: bool = False) -> torch.Tensor:
    """The segment's cumulative transition T (so that S_end = T S_start + E, E = end state from 0).

    scalar: total log decay `[B, H]`; diag: total log decay `[B, H, K]`;
    delta: dense `[B, H, K, K]` float32 = prod_t exp(g_t)(I - beta_t k_t k_t^T) (later
    tokens on the left), computed by running the same recurrence from S0 = I with v = 0;
    kda: the same with the factors (I - beta_t k_t k_t^T) diag(exp(g_t)).
    """
    check_family(family, inp)
    if family in ("scalar", "diag"):
        return inp.log_decay.to(torch.float32).sum(dim=1)
    b, t, h, kd, _ = inp.shape
    eye = torch.eye(kd, dtype=torch.float32, device=inp.k.device).expand(b, h, kd, kd).contiguous()
    zero_v = torch.zeros(b, t, h, kd, dtype=torch.float32, device=inp.k.device)
    probe = replace(inp, v=zero_v)
    if naive:
        return naive_recurrence(family, probe, eye)[1]
    return chunked_recurrence(family, probe, eye, chunk_size)[1]


def end_state_from_zero(family: str, inp: RecurrenceInputs) -> torch.Tensor:
    """E, the end state `[B, H, K, V]` (float32) of the recurrence run from zero, as one sum
    for scalar/diagonal decay: E = sum_t exp(A_t) k_t v_t^T, A_t the log decays after token t
    (summed from the end, so no large sums are differenced). One einsum, no recurrence."""
    check_family(family, inp)
    if family in DENSE_FAMILIES:
        raise ValueError(f"end_state_from_zero: the {family} family's end state needs the recurrence")
    g = inp.log_decay.to(torch.float32)  # [B, T, H] or [B, T, H, K]
    suffix = g.flip(1).cumsum(1).flip(1)  # sum over s >= t
    after = torch.cat([suffix[:, 1:], torch.zeros_like(suffix[:, :1])], dim=1)  # s > t
    w = after.exp()
    k = inp.k.to(torch.float32) * (w[..., None] if family == "scalar" else w)
    return torch.einsum("bthk,bthv->bhkv", k, inp.v.to(torch.float32))


def head_log_sums(family: str, log_sums: torch.Tensor) -> torch.Tensor:
    """Per-head log-decay sums `[..., H]` of a range from its family's sums (`[..., H]`, or
    `[..., H, K]` per channel): for a per-channel decay, the channel that decayed least. A
    head whose value is below float32's range has forgotten everything before the range."""
    return log_sums.amax(-1) if family in CHANNEL_DECAY_FAMILIES else log_sums


def padded_ranges(ranges, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(idx `[n, L]` long, valid `[n, L]` bool) on `device` for ranges `[a, b)` of a time
    axis, L the longest: row i holds a..b-1 then padding (index a, not valid). One
    host-to-device copy."""
    n, L = len(ranges), max(b - a for a, b in ranges)
    idx = torch.empty(n, L, dtype=torch.long)
    valid = torch.zeros(n, L, dtype=torch.bool)
    for i, (a, b) in enumerate(ranges):
        idx[i, : b - a] = torch.arange(a, b)
        idx[i, b - a:] = a
        valid[i, : b - a] = True
    both = torch.cat([idx, valid.long()])
    if torch.device(device).type == "cuda":  # pragma: no cover - GPU only
        both = both.pin_memory()
    both = both.to(device, non_blocking=True)
    return both[:n], both[n:].bool()


def end_states_and_log_sums(family: str, inp: RecurrenceInputs, idx: torch.Tensor,
                            valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For scalar/diagonal decay, every range of `padded_ranges` at once (B = 1): E `[n, H,
    K, V]` run from zero (`end_state_from_zero`'s one sum per range, batched) and the
    log-decay sums `[n, H]` / `[n, H, K]`. A fixed number of ops whatever n."""
    check_family(family, inp)
    if family in DENSE_FAMILIES:
        raise ValueError(f"end_states_and_log_sums: the {family} family's end state needs the recurrence")
    m = valid.to(torch.float32)
    g = inp.log_decay[0].to(torch.float32)[idx]  # [n, L, H] or [n, L, H, K]
    g = g * (m[..., None] if family == "scalar" else m[..., None, None])
    suffix = g.flip(1).cumsum(1).flip(1)  # sum over s >= t (padding adds 0)
    after = torch.cat([suffix[:, 1:], torch.zeros_like(suffix[:, :1])], dim=1)
    w = after.exp() * (m[..., None] if family == "scalar" else m[..., None, None])
    k = inp.k[0].to(torch.float32)[idx] * (w[..., None] if family == "scalar" else w)
    E = torch.einsum("nlhk,nlhv->nhkv", k, inp.v[0].to(torch.float32)[idx])
    return E, suffix[:, 0]


def apply_transition(family: str, transition: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """T applied to a state `[B, H, K, V]` (float32): the linear part of composition."""
    if family == "scalar":
        return torch.exp(transition)[..., None, None] * state
    if family == "diag":
        return torch.exp(transition)[..., :, None] * state
    if family in DENSE_FAMILIES:
        return transition @ state
    raise ValueError(f"recurrence family={family!r} must be one of {FAMILIES}")
