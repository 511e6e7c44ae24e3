"""Tests of kernels.state_compose: the Triton kernel against its torch reference, and the
composition of per-segment (T, E) against one token-level pass over all the tokens, for
the scalar-decay, diagonal-gate and gated-delta-rule families."""
import pytest
import torch

from kernels.backend import HAS_TRITON, INTERPRET
from kernels.errors import KernelInputError
from kernels.state_compose import state_compose, state_compose_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not HAS_TRITON or (DEVICE == "cpu" and not INTERPRET),
    reason="Triton path needs a GPU or TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")
BOTH_PATHS = pytest.mark.parametrize("force_triton", [
    pytest.param(True, marks=needs_triton, id="triton"), pytest.param(False, id="reference")])

B, H, DK, DV = 2, 2, 12, 24  # dk, dv not powers of two: exercises the masked tiles


def _operators(kind, m, gen, dk=DK):
    if kind == "scalar":
        return -3 * torch.rand(m, B, H, generator=gen)
    if kind == "diagonal":
        return -3 * torch.rand(m, B, H, dk, generator=gen)
    if kind == "dense":
        return torch.randn(m, B, H, dk, dk, generator=gen) / dk ** 0.5
    return None


@needs_triton
@pytest.mark.parametrize("kind", ["scalar", "diagonal", "dense", "none"])
@pytest.mark.parametrize("with_s0", [True, False])
def test_triton_matches_reference_on_random_inputs(kind, with_s0):
    gen = torch.Generator().manual_seed(len(kind) * 10 + with_s0)
    m = 4
    E = torch.randn(m, B, H, DK, DV, generator=gen).to(DEVICE)
    T = _operators(kind, m, gen)
    T = T.to(DEVICE) if T is not None else None
    S0 = torch.randn(B, H, DK, DV, generator=gen).to(DEVICE) if with_s0 else None
    ref = state_compose_reference(E, T, S0)
    got = state_compose(E, T, S0, force_triton=True)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("kind", ["scalar", "diagonal", "dense"])
def test_triton_apply_t_mask_and_in_place_out_match_reference(kind):
    gen = torch.Generator().manual_seed(11)
    m = 3
    E = torch.randn(m, B, H, DK, DV, generator=gen).to(DEVICE)
    T = _operators(kind, m, gen).to(DEVICE)
    apply_t = torch.tensor([[True, False], [False, True], [True, True]], device=DEVICE)
    S0 = torch.randn(B, H, DK, DV, generator=gen).to(DEVICE)
    ref = state_compose_reference(E, T, S0, apply_t=apply_t)
    state = S0.clone()
    got = state_compose(E, T, state, apply_t=apply_t, out=state, force_triton=True)
    assert got.data_ptr() == state.data_ptr()
    torch.testing.assert_close(state, ref, rtol=1e-5, atol=1e-5)
    # apply_t all False is naive addition.
    none = state_compose(E, T, S0, apply_t=torch.zeros(m, dtype=torch.bool, device=DEVICE), force_triton=True)
    torch.testing.assert_close(none, S0 + E.sum(0), rtol=1e-5, atol=1e-5)


@needs_triton
def test_triton_reads_strided_and_fp16_operators():
    gen = torch.Generator().manual_seed(5)
    m, dk = 2, 16
    E_big = torch.randn(m, B, H, dk, 2 * DV, generator=gen).to(DEVICE)
    E = E_big[..., ::2]  # non-contiguous last dim
    T = (torch.randn(m, B, H, dk, dk, generator=gen) / 4).to(DEVICE, torch.float16)
    S0 = torch.randn(B, H, dk, DV, generator=gen).to(DEVICE)
    ref = state_compose_reference(E, T, S0)
    got = state_compose(E, T, S0, force_triton=True)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@BOTH_PATHS
def test_naive_addition_without_t_is_s0_plus_sum_of_end_states(force_triton):
    gen = torch.Generator().manual_seed(2)
    E = torch.randn(5, B, H, DK, DV, generator=gen).to(DEVICE)
    S0 = torch.randn(B, H, DK, DV, generator=gen).to(DEVICE)
    got = state_compose(E, None, S0, force_triton=force_triton)
    torch.testing.assert_close(got, S0 + E.sum(0), rtol=1e-6, atol=1e-5)


# --------------------------------------------------------------------------- token-level unroll
def _tokens(kind, L, gen, log_decay_range):
    lo, hi = log_decay_range
    k = torch.nn.functional.normalize(torch.randn(L, B, H, DK, generator=gen), dim=-1)
    v = torch.randn(L, B, H, DV, generator=gen)
    beta = torch.rand(L, B, H, generator=gen)
    if kind == "diagonal":
        log_g = lo + (hi - lo) * torch.rand(L, B, H, DK, generator=gen)
    else:
        log_g = lo + (hi - lo) * torch.rand(L, B, H, generator=gen)
    return log_g, beta, k, v


def _step(kind, S, log_g, beta, k, v):
    """One token of each family, float32: scalar S = a S + k v^T; diagonal S = diag(g) S +
    k v^T; dense (gated delta rule) S = g (I - beta k k^T) S + beta k v^T."""
    g = torch.exp(log_g)
    if kind == "scalar":
        return g[..., None, None] * S + k[..., :, None] * v[..., None, :]
    if kind == "diagonal":
        return g[..., None] * S + k[..., :, None] * v[..., None, :]
    kS = torch.einsum("bhk,bhkv->bhv", k, S)
    S = S - beta[..., None, None] * k[..., :, None] * kS[..., None, :]
    return g[..., None, None] * S + (beta[..., None] * k)[..., :, None] * v[..., None, :]


def _segment_signature(kind, log_g, beta, k, v):
    """(T, E) of one segment from zero state, token by token in float32: T as the family
    stores it (log-decay sum, per-dim log-decay sums, or the dense product)."""
    E = torch.zeros(B, H, DK, DV)
    for t in range(log_g.shape[0]):
        E = _step(kind, E, log_g[t], beta[t], k[t], v[t])
    if kind in ("scalar", "diagonal"):
        return log_g.sum(0), E
    T = torch.eye(DK).expand(B, H, DK, DK).clone()
    for t in range(log_g.shape[0]):
        kT = torch.einsum("bhk,bhkj->bhj", k[t], T)
        T = torch.exp(log_g[t])[..., None, None] * (T - beta[t][..., None, None] * k[t][..., :, None] * kT[..., None, :])
    return T, E


def _rel_err(a, b):
    return ((a - b).norm(dim=(-2, -1)) / b.norm(dim=(-2, -1))).max().item()


@BOTH_PATHS
@pytest.mark.parametrize("kind", ["scalar", "diagonal", "dense"])
@pytest.mark.parametrize("lengths,log_decay_range", [
    ([5, 17, 1, 9], (-0.3, 0.0)),        # mild decay: the start state still matters
    ([6, 120, 7], (-3.0, -1.0)),          # long middle segment: its decay product underflows to 0
])
def test_composition_equals_single_pass_over_all_tokens(force_triton, kind, lengths, log_decay_range):
    gen = torch.Generator().manual_seed(sum(lengths) + len(kind))
    S0 = torch.randn(B, H, DK, DV, generator=gen)
    Ts, Es, S_pass = [], [], S0.clone()
    for L in lengths:
        log_g, beta, k, v = _tokens(kind, L, gen, log_decay_range)
        T, E = _segment_signature(kind, log_g, beta, k, v)
        Ts.append(T)
        Es.append(E)
        for t in range(L):
            S_pass = _step(kind, S_pass, log_g[t], beta[t], k[t], v[t])
    T = torch.stack(Ts).to(DEVICE)
    E = torch.stack(Es).to(DEVICE)
    if log_decay_range[0] <= -1.0:
        if kind == "dense":
            assert Ts[1].abs().max() < 1e-30  # the delta-rule product underflowed
        else:
            assert torch.exp(Ts[1]).max() == 0  # exp of the log-decay sum is exactly 0
    S = state_compose(E, T, S0.to(DEVICE), force_triton=force_triton).cpu()
    assert _rel_err(S, S_pass) < 1e-5
    # Naive addition (no T) is measurably wrong, so the check above has teeth.
    naive = state_compose(E, None, S0.to(DEVICE), force_triton=force_triton).cpu()
    assert _rel_err(naive, S_pass) > 1e-2


def test_bad_inputs_raise_naming_the_argument():
    E = torch.zeros(2, B, H, DK, DV)
    with pytest.raises(KernelInputError, match="T must"):
        state_compose(E, torch.zeros(2, B, H, DK, DK, DK))
    with pytest.raises(KernelInputError, match="diagonal T"):
        state_compose(E, torch.zeros(2, B, H, DK + 1))
    with pytest.raises(KernelInputError, match="S0 must be float32"):
        state_compose(E, None, torch.zeros(B, H, DK, DV, dtype=torch.float16))
    with pytest.raises(KernelInputError, match="apply_t"):
        state_compose(E, torch.zeros(2, B, H), apply_t=torch.ones(3, dtype=torch.bool))


@BOTH_PATHS
def test_zero_segments_return_the_start_state_or_zeros(force_triton):
    E = torch.zeros(0, B, H, DK, DV, device=DEVICE)
    S0 = torch.randn(B, H, DK, DV, device=DEVICE)
    torch.testing.assert_close(state_compose(E, torch.zeros(0, B, H, device=DEVICE), S0,
                                             force_triton=force_triton), S0, rtol=0, atol=0)
    assert state_compose(E, None, None, force_triton=force_triton).abs().max() == 0
