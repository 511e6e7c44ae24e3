"""The torch linear-attention forms against the naive token loop, the transition operator
against composition, and the delta rule against fla's kernel (conventions pinned)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.layers.linear_ops import (FAMILIES, RecurrenceInputs, apply_transition, chunked_recurrence,
                                             end_state_from_zero, naive_recurrence, recurrent_step,
                                             transition_operator)

B, H, K, V = 2, 3, 8, 6


def random_inputs(family: str, t: int, decay_strength: float = 1.0, seed: int = 0) -> RecurrenceInputs:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, t, H, K, generator=g)
    k = F.normalize(torch.randn(B, t, H, K, generator=g), dim=-1)
    v = torch.randn(B, t, H, V, generator=g)
    shape = (B, t, H, K) if family in ("diag", "kda") else (B, t, H)
    log_decay = F.logsigmoid(torch.randn(shape, generator=g) + 2.0) * decay_strength
    beta = torch.rand(B, t, H, generator=g) if family in ("delta", "kda") else None
    return RecurrenceInputs(q=q, k=k, v=v, log_decay=log_decay, beta=beta, scale=K ** -0.5)


def random_state(seed: int = 1) -> torch.Tensor:
    return torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
def test_chunked_form_equals_naive_loop_from_a_nonzero_state(family, chunk_size):
    inp = random_inputs(family, 45)
    s0 = random_state()
    o_ref, s_ref = naive_recurrence(family, inp, s0)
    o, s = chunked_recurrence(family, inp, s0, chunk_size)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_form_stays_exact_when_decay_products_underflow(family):
    # log decays of about -40 per token: exp of a 64-token chunk's cumulative sum is far below
    # float32's smallest normal; the form must give the loop's numbers, not inf/NaN
    inp = random_inputs(family, 300, decay_strength=300.0, seed=3)
    s0 = random_state()
    o_ref, s_ref = naive_recurrence(family, inp, s0)
    o, s = chunked_recurrence(family, inp, s0, 64)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_long_sequence_with_mild_decay_matches_loop(family):
    inp = random_inputs(family, 700, decay_strength=0.05, seed=4)
    o_ref, s_ref = naive_recurrence(family, inp)
    o, s = chunked_recurrence(family, inp, None, 64)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_recurrent_step_chain_equals_loop(family):
    inp = random_inputs(family, 12)
    s = random_state()
    o_ref, s_ref = naive_recurrence(family, inp, s)
    outs = []
    for t in range(12):
        o, s = recurrent_step(family, inp.slice_time(t, t + 1), s)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=1), o_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("decay_strength", [0.2, 200.0])
def test_transition_operator_composes_two_segments_exactly(family, decay_strength):
    inp = random_inputs(family, 40, decay_strength=decay_strength, seed=5)
    s0 = random_state()
    seg1, seg2 = inp.slice_time(0, 17), inp.slice_time(17, 40)
    _, s_whole = naive_recurrence(family, inp, s0)
    t1, e1 = transition_operator(family, seg1), naive_recurrence(family, seg1)[1]
    t2, e2 = transition_operator(family, seg2), naive_recurrence(family, seg2)[1]
    composed = apply_transition(family, t2, apply_transition(family, t1, s0) + e1) + e2
    torch.testing.assert_close(composed, s_whole, rtol=1e-5, atol=1e-5)


def test_delta_transition_chunked_equals_naive_and_is_dense():
    inp = random_inputs("delta", 70, seed=6)
    t_chunk = transition_operator("delta", inp, chunk_size=16)
    t_naive = transition_operator("delta", inp, naive=True)
    assert t_chunk.shape == (B, H, K, K) and t_chunk.dtype == torch.float32
    torch.testing.assert_close(t_chunk, t_naive, rtol=1e-5, atol=1e-6)


def test_scalar_and_diag_transitions_are_log_decay_sums():
    for family, shape in (("scalar", (B, H)), ("diag", (B, H, K))):
        inp = random_inputs(family, 9)
        t = transition_operator(family, inp)
        assert t.shape == shape
        torch.testing.assert_close(t, inp.log_decay.sum(1))


def test_delta_rule_matches_fla_fused_recurrent_kernel():
    """Pins our state orientation, decay-before-update order and scale against fla-core's
    fused_recurrent_gated_delta_rule (run by the Triton interpreter on CPU)."""
    fla_gdn = pytest.importorskip("fla.ops.gated_delta_rule",
                                  reason="fla-core is not installed in this environment")
    inp = random_inputs("delta", 11, seed=7)
    s0 = random_state()
    o_ref, s_ref = naive_recurrence("delta", inp, s0)
    o_chunk, s_chunk = chunked_recurrence("delta", inp, s0, 4)
    o_fla, s_fla = fla_gdn.fused_recurrent_gated_delta_rule(
        inp.q.contiguous(), inp.k.contiguous(), inp.v.contiguous(), g=inp.log_decay.contiguous(),
        beta=inp.beta.contiguous(), scale=inp.scale, initial_state=s0.clone(), output_final_state=True)
    torch.testing.assert_close(o_fla, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_fla, s_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o_chunk, o_fla, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_chunk, s_fla, rtol=1e-5, atol=1e-5)
    # and through the engine's fla dispatch (the decode path on the GPU)
    from engine.models.layers.fla_backend import fla_recurrent
    o_eng, s_eng = fla_recurrent("delta", inp, s0)
    torch.testing.assert_close(o_eng, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_eng, s_ref, rtol=1e-5, atol=1e-5)


def test_bad_family_and_shapes_are_rejected_by_name():
    inp = random_inputs("scalar", 4)
    with pytest.raises(ValueError, match="family='nope'"):
        naive_recurrence("nope", inp)
    with pytest.raises(ValueError, match="diag log_decay must have 4 dims"):
        chunked_recurrence("diag", inp)
    with pytest.raises(ValueError, match="initial_state shape"):
        naive_recurrence("scalar", inp, torch.zeros(1, 1, 1, 1))


@pytest.mark.parametrize("decay_strength", [1.0, 8.0])
@pytest.mark.parametrize("family", ["scalar", "diag"])
def test_end_state_from_zero_is_the_recurrence_end_state(family, decay_strength):
    """One sum (E = sum_t exp(decays after t) k_t v_t^T) against the token loop, on fresh
    random inputs, with mild and strong decay."""
    seed = int(torch.randint(0, 2 ** 31 - 1, ()))
    inp = random_inputs(family, 37, decay_strength, seed)
    want = naive_recurrence(family, inp, None)[1]
    torch.testing.assert_close(end_state_from_zero(family, inp), want, rtol=1e-4, atol=1e-5,
                               msg=lambda m: f"seed {seed}: {m}")


def test_end_state_from_zero_refuses_the_delta_rule():
    with pytest.raises(ValueError, match="delta"):
        end_state_from_zero("delta", random_inputs("delta", 5))


@pytest.mark.parametrize("family", ["scalar", "diag"])
def test_end_states_of_padded_ranges_match_one_sum_per_range(family):
    """linear_ops.end_states_and_log_sums (the context capture's batched tails) against
    end_state_from_zero per range and the log-decay sums, on fresh random inputs."""
    from engine.models.layers.linear_ops import end_state_from_zero, end_states_and_log_sums, padded_ranges

    g = torch.Generator().manual_seed(7 if family == "scalar" else 8)
    t, h, kd, vd = 40, 3, 5, 4
    decay_shape = (1, t, h) if family == "scalar" else (1, t, h, kd)
    inp = RecurrenceInputs(q=torch.randn(1, t, h, kd, generator=g), k=torch.randn(1, t, h, kd, generator=g),
                           v=torch.randn(1, t, h, vd, generator=g),
                           log_decay=-torch.rand(*decay_shape, generator=g), scale=0.5)
    ranges = [(0, 7), (9, 30), (31, 32), (33, 40)]
    idx, valid = padded_ranges(ranges, "cpu")
    E, logs = end_states_and_log_sums(family, inp, idx, valid)
    for i, (a, b) in enumerate(ranges):
        part = inp.slice_time(a, b)
        torch.testing.assert_close(E[i], end_state_from_zero(family, part)[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logs[i], part.log_decay[0].sum(dim=0), rtol=1e-5, atol=1e-5)


def test_kda_transition_is_the_product_of_the_reference_factors():
    """kda's T = prod_t (I - beta_t k_t k_t^T) diag(exp(g_t)), later tokens on the left: the
    decay acts on the state before the delta update reads it, as Kimi-Linear's reference."""
    inp = random_inputs("kda", 6, seed=9)
    want = torch.eye(K).expand(B, H, K, K).clone()
    for t in range(6):
        k, beta = inp.k[:, t].float(), inp.beta[:, t].float()
        step = (torch.eye(K) - beta[..., None, None] * k[..., :, None] * k[..., None, :]) \
            * torch.exp(inp.log_decay[:, t].float())[..., None, :]
        want = step @ want
    torch.testing.assert_close(transition_operator("kda", inp, chunk_size=4), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(transition_operator("kda", inp, naive=True), want, rtol=1e-5, atol=1e-6)


def test_kda_matches_the_kimi_linear_reference_functions():
    """Our kda family (loop and chunked) against transformers' torch reference of Kimi Delta
    Attention (recurrent and chunked), from a nonzero state, q/k normalised beforehand."""
    import inspect

    ref = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    recurrent = inspect.unwrap(ref.recurrent_kimi_delta_attention)  # the torch function, not fla's
    chunk = inspect.unwrap(ref.chunk_kimi_delta_attention)
    inp = random_inputs("kda", 37, seed=10)
    s0 = random_state()
    args = (inp.q * (inp.scale * K ** 0.5), inp.k, inp.v, inp.log_decay, inp.beta)
    o_ref, s_ref = recurrent(*args, initial_state=s0.clone(), output_final_state=True)
    o_chunk_ref, s_chunk_ref = chunk(*args, chunk_size=16, initial_state=s0.clone(), output_final_state=True)
    for family_form in (naive_recurrence("kda", inp, s0), chunked_recurrence("kda", inp, s0, 8)):
        torch.testing.assert_close(family_form[0], o_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(family_form[1], s_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o_chunk_ref, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_chunk_ref, s_ref, rtol=1e-5, atol=1e-5)


def test_kda_matches_fla_fused_recurrent_kernel():
    """Pins the kda conventions (state orientation, per-channel decay before the update,
    scale) against fla-core's fused_recurrent_kda (Triton interpreter on CPU), also through
    the engine's fla dispatch."""
    fla_kda = pytest.importorskip("fla.ops.kda", reason="fla-core with kda is not installed in this environment")
    inp = random_inputs("kda", 11, seed=11)
    s0 = random_state()
    o_ref, s_ref = naive_recurrence("kda", inp, s0)
    o_fla, s_fla = fla_kda.fused_recurrent_kda(
        inp.q.contiguous(), inp.k.contiguous(), inp.v.contiguous(), inp.log_decay.contiguous(),
        inp.beta.contiguous(), scale=inp.scale, initial_state=s0.clone(), output_final_state=True)
    torch.testing.assert_close(o_fla, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_fla, s_ref, rtol=1e-5, atol=1e-5)
    from engine.models.layers.fla_backend import fla_recurrent
    o_eng, s_eng = fla_recurrent("kda", inp, s0)
    torch.testing.assert_close(o_eng, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_eng, s_ref, rtol=1e-5, atol=1e-5)


def test_kda_needs_per_channel_decay_and_beta():
    inp = random_inputs("delta", 4)
    with pytest.raises(ValueError, match="kda log_decay must have 4 dims"):
        naive_recurrence("kda", inp)
    chan = random_inputs("diag", 4)
    with pytest.raises(ValueError, match="kda family needs beta"):
        chunked_recurrence("kda", chan)
    with pytest.raises(ValueError, match="kda"):
        end_state_from_zero("kda", random_inputs("kda", 4))
