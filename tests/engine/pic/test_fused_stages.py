"""The fused prefill's token-wise stages through engine.runtime.prefill_graphs: the
bucketed static-buffer path (what CUDA graphs replay; on the CPU it runs eagerly) gives
the plain pass's logits and caches, on a first pass and on a later one whose buffers
hold an earlier request's rows; prefix caching with checkpoints too. The CUDA capture
itself is checked on the GPU (tools/check_pic_gpu.py --prefill-graphs)."""
from __future__ import annotations

import pytest
import torch

from engine.runtime.prefill_graphs import PrefillStages

from pic_testlib import execute, make_request, rand_ids
from test_fused import _caches
from test_planner import MIXES


def _warm_runs(model, runner, planner, requests):
    out = []
    for segments in requests:
        execute(planner, runner, make_request(segments))  # cold: computes and caches signatures
        req = make_request(segments)
        run = execute(planner, runner, req)
        out.append((run.logits[-1], _caches(runner, run.seq, len(req.prompt_token_ids))))
    return out


def _assert_close(a, b):
    torch.testing.assert_close(b[0], a[0], rtol=1e-4, atol=1e-4)
    for i, (x, y) in enumerate(zip(a[1], b[1])):
        for s, t in zip(x, y):
            if s is None:
                assert t is None
                continue
            torch.testing.assert_close(t, s, rtol=1e-4, atol=1e-4, msg=lambda m: f"layer {i}: {m}")


@pytest.mark.parametrize("mix", list(MIXES))
def test_staged_fused_prefill_equals_the_plain_one(mix, model_of, runner_of, planner_of):
    model = model_of(MIXES[mix])
    requests = [[(rand_ids(n, 40 + n + s), True) for n in (17, 12, 15)] + [(rand_ids(6 - 2 * s, s), False)]
                for s in (0, 1)]  # the second pass runs on buffers the first one filled
    plain = _warm_runs(model, runner_of(model), planner_of(model, fused=True, seam=4), requests)
    runner = runner_of(model)
    runner.prefill_stages = stages = PrefillStages(model.device, buckets=(8, 16, 32), capture=False)
    staged = _warm_runs(model, runner, planner_of(model, fused=True, seam=4), requests)
    for a, b in zip(plain, staged):
        _assert_close(a, b)
    assert len(stages._stages) >= len(model.blocks) + 1  # every layer's stages ran bucketed


def test_staged_prefix_caching_with_checkpoints_equals_the_plain_one(model_of, runner_of, planner_of):
    model = model_of(MIXES["gdn"])
    docs = [rand_ids(n, 70 + n) for n in (9, 11)]
    requests = [[(d, True) for d in docs] + [(rand_ids(5, 7 + s), False)] for s in (0, 1)]
    got = []
    for stages in (None, PrefillStages(model.device, buckets=(8, 16, 32, 64), capture=False)):
        runner = runner_of(model)
        runner.prefill_stages = stages
        got.append(_warm_runs(model, runner, planner_of(model, method="prefix", fused=True), requests))
    for a, b in zip(*got):
        _assert_close(a, b)


def test_stages_run_a_pass_larger_than_every_bucket_plainly():
    stages = PrefillStages(torch.device("cpu"), buckets=(4, 8), capture=False)
    x = torch.randn(11, 3)
    out = stages.run("double", lambda t: (2 * t, {"sum": t.sum(-1)}), [x], 11)
    torch.testing.assert_close(out[0], 2 * x)
    assert stages.eager_runs == 1 and not stages._stages


def test_stage_rows_beyond_n_never_reach_the_caller_and_inputs_must_keep_their_form():
    stages = PrefillStages(torch.device("cpu"), buckets=(8,), capture=False)
    fn = lambda t, g: (t * 3, None if g is None else g + 1)  # noqa: E731
    a, b = torch.randn(5, 2), torch.randn(3, 2)
    out = stages.run("f", fn, [a, torch.zeros(5, 2)], 5)
    assert out[0].shape == (5, 2) and out[1].shape == (5, 2)
    out = stages.run("f", fn, [b, torch.ones(3, 2)], 3)  # stale rows 3..4 of the buffer stay unseen
    torch.testing.assert_close(out[0], 3 * b)
    torch.testing.assert_close(out[1], torch.full((3, 2), 2.0))
    with pytest.raises(ValueError, match="None"):
        stages.run("f", fn, [b, None], 3)
    with pytest.raises(ValueError, match="inputs"):
        stages.run("f", fn, [b], 3)


def test_stages_refuse_bad_buckets_and_capture_off_cuda():
    with pytest.raises(ValueError, match="buckets"):
        PrefillStages(torch.device("cpu"), buckets=(0, 4))
    with pytest.raises(ValueError, match="CUDA"):
        PrefillStages(torch.device("cpu"), capture=True)
    assert PrefillStages(torch.device("cpu")).capture is False


def test_capture_prefill_stages_fills_every_bucket_on_a_scratch_sequence(model_of, runner_of):
    from engine.pic.fused import capture_prefill_stages

    model = model_of(MIXES["gdn"])
    runner = runner_of(model)
    assert capture_prefill_stages(runner) == 0  # no stages on the CPU by default: nothing to do
    runner.prefill_stages = stages = PrefillStages(model.device, buckets=(8, 16), capture=False)
    assert capture_prefill_stages(runner) == 0  # nothing captured off CUDA, but every stage laid out
    names = {key[0] for key in stages._stages}
    assert ("in",) in names and {("next", i) for i in range(len(model.blocks))} <= names
    assert {key[1] for key in stages._stages} == {8, 16}
    assert runner.cache.slots.num_free == runner.cache.config.num_slots  # the scratch sequences are freed


def test_capture_prefill_stages_skips_buckets_the_cache_cannot_hold(model_of, make_runner):
    from engine.pic.fused import capture_prefill_stages

    model = model_of(MIXES["gdn"])
    runner = make_runner(model, num_blocks=4)  # a pass of at most 4 * block_size positions
    room = 4 * runner.cache.block_size
    runner.prefill_stages = stages = PrefillStages(model.device, buckets=(room // 2, room, room + 1), capture=False)
    capture_prefill_stages(runner)
    assert {key[1] for key in stages._stages} == {room // 2, room}
