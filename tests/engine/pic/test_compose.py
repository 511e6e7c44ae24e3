"""Linear-state composition at the first linear layer, whose inputs do not depend on
context: after a PIC prefill (seam >= conv width - 1) its state equals a token-by-token
unroll over the whole prompt to 1e-5 relative, for every linear family, also with long
segments whose decay products underflow; and the unroll check catches the published
bug of applying seam tokens twice."""
from __future__ import annotations

import math

import pytest
import torch

from engine.models.config import FULL, GDN, GLA, KDA, LIGHTNING, MAMBA2
from engine.models.layers.linear_ops import DENSE_FAMILIES, apply_transition, naive_recurrence, transition_operator
from engine.pic.signature import LinearPart
from pic_testlib import execute, layer0_inputs, make_request, rand_ids

KINDS = [GDN, GLA, LIGHTNING, MAMBA2, KDA]
SEAM = 4


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@torch.no_grad()
def strengthen_decay(model, kind) -> None:
    """Per-head decays from gentle to brutal, so long segments underflow in some heads."""
    m = model.mixer(0)
    if kind in (GDN, MAMBA2, KDA):
        h = m.A_log.numel()
        m.A_log.copy_(torch.linspace(math.log(0.01), math.log(30.0), h))
        m.dt_bias.zero_()
    elif kind == GLA:
        bias = torch.zeros_like(m.gk_up.bias)
        bias[::2] = -2000.0  # logsigmoid(-2000)/16 = -125 per token on half the key dims
        m.gk_up.bias.copy_(bias)
    else:
        m.head_log_decay = [g * f for g, f in zip(m.head_log_decay, [40.0, 10.0, 1.0, 0.1])]


def run_pic(model, runner_of, planner_of, lengths, q_len=4, seed=0):
    docs = [rand_ids(n, seed + i) for i, n in enumerate(lengths)]
    request = make_request([(d, True) for d in docs] + [(rand_ids(q_len, 99), False)])
    planner = planner_of(model, seam=SEAM)
    got = execute(planner, runner_of(model, num_blocks=512), request)
    return request, planner, docs, got.runner.cache.layer(0).state[got.seq.slot]


@pytest.mark.parametrize("kind", KINDS)
def test_composed_state_equals_a_single_pass_at_the_first_linear_layer(kind, model_of, runner_of, planner_of):
    model = model_of([kind, FULL])
    request, _, _, state = run_pic(model, runner_of, planner_of, [19, 23, 17])
    family, inp = layer0_inputs(model, request.prompt_token_ids)
    _, truth = naive_recurrence(family, inp)
    assert rel(state, truth[0]) < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_composition_stays_exact_with_long_segments_whose_decay_underflows(kind, model_of, runner_of, planner_of):
    model = model_of([kind, FULL])
    strengthen_decay(model, kind)
    request, planner, docs, state = run_pic(model, runner_of, planner_of, [100, 120], seed=5)
    family, inp = layer0_inputs(model, request.prompt_token_ids)
    _, truth = naive_recurrence(family, inp)
    assert torch.isfinite(state).all()
    assert rel(state, truth[0]) < 1e-5
    # the tail of the second segment has fully decayed in some heads and not in others
    a = 1 + len(docs[0])
    log_sum = inp.log_decay[0, a + SEAM:a + len(docs[1])].sum(0)
    assert (log_sum.min() < -200) and (log_sum.max() > -87)
    if family in DENSE_FAMILIES:  # forgotten heads store no operator
        (sig,) = [s for s, _ in planner.cache._entries.values() if s.num_tokens == len(docs[1])]
        part: LinearPart = sig.layers[0]
        assert 0 < len(part.live_heads) < part.num_heads
        assert part.tail_transition.shape[0] == len(part.live_heads)


@pytest.mark.parametrize("kind", KINDS)
def test_unroll_check_catches_seam_tokens_applied_twice(kind, model_of, runner_of, planner_of):
    model = model_of([kind, FULL])
    request, _, docs, state = run_pic(model, runner_of, planner_of, [15, 21], seed=11)
    family, inp = layer0_inputs(model, request.prompt_token_ids)
    _, truth = naive_recurrence(family, inp)
    b0, b1 = 1 + len(docs[0]), 1 + len(docs[0]) + len(docs[1])
    seg = inp.slice_time(b0, b1)
    _, s_seam = naive_recurrence(family, inp.slice_time(0, b0 + SEAM))
    # the bug: compose the *whole* segment (seam included) onto the state after the seam
    bug = apply_transition(family, transition_operator(family, seg, naive=True), s_seam)
    bug = bug + naive_recurrence(family, seg)[1]
    _, bug = naive_recurrence(family, inp.slice_time(b1, len(request.prompt_token_ids)), bug)
    assert rel(state, truth[0]) < 1e-5
    assert rel(bug[0], truth[0]) > 1e-3
