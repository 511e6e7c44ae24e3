"""Sampling: greedy, seeded reproducibility independent of batch mates, top-k/top-p cuts,
and the stop conditions."""
from __future__ import annotations

import pytest
import torch

from engine.errors import ConfigError
from engine.runtime.sampling import (FINISH_LENGTH, FINISH_STOP, SamplingParams, check_stop, filter_logits,
                                     find_stop_string, make_generator, sample)


def test_greedy_takes_the_argmax_per_row():
    logits = torch.randn(4, 30)
    out = sample(logits, [SamplingParams()] * 4)
    assert out.tolist() == logits.argmax(-1).tolist()


def test_seeded_sampling_repeats_and_ignores_batch_mates():
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.0, seed=42)
    runs = []
    for mates in ([SamplingParams()] * 2, [SamplingParams(temperature=2.0, seed=1)] * 2):
        g = make_generator(p)
        others = [make_generator(m) for m in mates]
        toks = [sample(logits, [p, *mates], [g, *others])[0].item() for _ in range(20)]
        runs.append(toks)
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1  # it really samples


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([5.0, 4.0, 3.0, -1.0, -2.0])
    probs = filter_logits(logits, 1.0, top_k=2, top_p=1.0)
    assert (probs[2:] == 0).all() and torch.isclose(probs.sum(), torch.tensor(1.0))
    probs = filter_logits(logits, 1.0, top_k=0, top_p=0.5)  # the top token alone has > 0.5 mass
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    probs = filter_logits(logits, 1.0, top_k=0, top_p=0.9)
    assert probs[0] > 0 and probs[1] > 0 and probs[3] == 0 and probs[4] == 0
    g = torch.Generator().manual_seed(0)
    draws = {sample(logits[None], [SamplingParams(temperature=5.0, top_k=2)], [g]).item() for _ in range(50)}
    assert draws == {0, 1}


def test_stop_conditions():
    p = SamplingParams(max_new_tokens=3, stop_token_ids=(9,), stop_strings=("END",))
    assert check_stop(p, 257, 1, eos_id=257) == FINISH_STOP
    assert check_stop(SamplingParams(ignore_eos=True), 257, 1, eos_id=257) is None
    assert check_stop(p, 9, 1, eos_id=257) == FINISH_STOP
    assert check_stop(p, 5, 1, eos_id=257, text="abc EN") is None
    assert check_stop(p, 5, 2, eos_id=257, text="abc END") == FINISH_STOP
    assert check_stop(p, 5, 3, eos_id=257) == FINISH_LENGTH
    assert check_stop(SamplingParams(), 5, 1, None, total_tokens=100, max_total_tokens=100) == FINISH_LENGTH
    assert find_stop_string("x END y STOP", ["STOP", "END"]) == 2


def test_bad_sampling_params_are_named():
    with pytest.raises(ConfigError, match="top_p=0"):
        SamplingParams(top_p=0)
    with pytest.raises(ConfigError, match="temperature=-1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ConfigError, match="B == len"):
        sample(torch.zeros(2, 5), [SamplingParams()])
