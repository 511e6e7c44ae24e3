"""The fused pass's `before_layer` hook (engine.pic.fused) is called before layer i first
reads the spliced signatures' layer i: a planner whose signatures arrive layer by layer
(all zeros until the hook for their layer lands them, as engine.connector.layer_loads
makes the compute stream wait per layer) gives the same logits and caches as signatures
that were there all along; landing each layer one hook late does not."""
from __future__ import annotations

import pytest
import torch

from engine.pic.report import STATE_KEY
from engine.pic.signature import SegmentSignature

from pic_testlib import execute, make_request, rand_ids

from test_fused import _caches
from test_planner import MIXES


def _arriving(planner, late: bool = False):
    """Patch `planner` so each spliced signature is swapped for zeros in `_ready` and its
    layer i copied in by the fused pass's before_layer(i) (before_layer(i + 1) if `late`)."""
    arrivals, calls, layered_flags = [], [], []
    ready = planner._ready

    def _ready(runner, request, units, layered=False):
        ready(runner, request, units, layered)
        layered_flags.append(layered)
        state = request.planner_state[STATE_KEY]
        for u in units:
            tensors, meta, layers = state.signatures[u.key].to_tensors()
            zeros = {n: torch.zeros_like(t) for n, t in tensors.items()}
            state.signatures[u.key] = SegmentSignature.from_tensors(zeros, meta)
            arrivals.append((tensors, zeros, layers))

    def _layer_hook(request):
        def before_layer(i):
            calls.append(i)
            land = i - 1 if late else i
            for tensors, zeros, layers in arrivals:
                for n, t in tensors.items():
                    if layers[n] == land:
                        zeros[n].copy_(t)
        return before_layer

    planner._ready, planner._layer_hook = _ready, _layer_hook
    return calls, layered_flags


def _warm(planner, runner, segments):
    execute(planner, runner, make_request(segments))  # cold: computes and caches the signatures
    req = make_request(segments)
    run = execute(planner, runner, req)
    return run.logits[-1], _caches(runner, run.seq, len(req.prompt_token_ids))


@pytest.mark.parametrize("mix", ["gdn", "mamba2", "swa"])
def test_signatures_arriving_layer_by_layer_give_the_same_prefill(mix, model_of, runner_of, planner_of):
    model = model_of(MIXES[mix])
    segments = [(rand_ids(n, 40 + n), True) for n in (17, 12, 15)] + [(rand_ids(6, 3), False)]
    want_logits, want_caches = _warm(planner_of(model, fused=True, seam=4), runner_of(model), segments)
    planner = planner_of(model, fused=True, seam=4)
    calls, flags = _arriving(planner)
    logits, caches = _warm(planner, runner_of(model), segments)
    assert flags[-1] is True  # the fused step asked for per-layer waits
    assert calls[-len(model.blocks):] == list(range(len(model.blocks)))
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    for i, (a, b) in enumerate(zip(want_caches, caches)):
        for x, y in zip(a, b):
            if x is not None:
                torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5, msg=lambda m: f"layer {i}: {m}")


def test_a_layer_landing_one_hook_late_changes_the_prefill(model_of, runner_of, planner_of):
    model = model_of(MIXES["gdn"])
    segments = [(rand_ids(n, 40 + n), True) for n in (17, 12, 15)] + [(rand_ids(6, 3), False)]
    want_logits, _ = _warm(planner_of(model, fused=True, seam=4), runner_of(model), segments)
    planner = planner_of(model, fused=True, seam=4)
    _arriving(planner, late=True)
    logits, _ = _warm(planner, runner_of(model), segments)
    assert not torch.allclose(logits, want_logits, rtol=1e-3, atol=1e-3)
