"""engine.pic.kernel_warmup: the fla chunk-kernel patterns an engine warms, checked on the
CPU with fla's chunk function replaced by a recorder that runs the torch recurrence and
notes each call's autotuning pattern (initial state given or not, cu_seqlens given or
not, value width): the warm-up launches every pattern of its table, and the patterns the
engine's own long-range paths launch are among them."""
from __future__ import annotations

import pytest
import torch

from engine.models.layers import fla_backend
from engine.models.layers.linear_ops import chunked_recurrence
from engine.models.presets import get_preset
from engine.models.weights import build_model
from engine.pic import kernel_warmup, long_ranges
from engine.pic.kernel_warmup import PATTERNS, RecurrenceKernelWarmup, warm_calls


class Recorder:
    """fla_chunk's stand-in: the torch recurrence, one sequence at a time for varlen calls."""

    def __init__(self) -> None:
        self.patterns: list[tuple] = []

    def __call__(self, family, inp, initial_state, cu_seqlens=None):
        self.patterns.append((family, initial_state is None, cu_seqlens is None, inp.v.shape[-1]))
        if cu_seqlens is None:
            return chunked_recurrence(family, inp, initial_state)
        cu = cu_seqlens.tolist()
        outs, states = [], []
        for i in range(len(cu) - 1):
            s0 = None if initial_state is None else initial_state[i:i + 1]
            o, s = chunked_recurrence(family, inp.slice_time(cu[i], cu[i + 1]), s0)
            outs.append(o)
            states.append(s)
        return torch.cat(outs, dim=1), torch.cat(states)


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(fla_backend, "fla_chunk", rec)
    return rec


def _model(name):
    return build_model(get_preset(name), "cpu", torch.float32, seed=0)


def test_delta_layers_warm_every_pattern_including_the_long_ranges(recorder):
    model = _model("qwen3next-tiny")
    calls = warm_calls(model)
    assert [c.pattern for c in calls] == list(PATTERNS)  # one delta-rule shape in the model
    w = RecurrenceKernelWarmup(model, "fla", torch.device("cpu"), torch.float32, "upfront")
    assert w.pending == [] and w.failed is None and w.capture_s is not None
    assert w.snapshot()["warmed"] == [f"delta/{p}" for p in PATTERNS]
    m = calls[0].mixer
    vd, kd = m.value_dim, m.key_dim
    warmed = set(recorder.patterns)  # (family, no initial state, no cu_seqlens, value width)
    assert warmed == {("delta", True, True, vd), ("delta", False, True, vd), ("delta", True, False, vd),
                      ("delta", False, False, vd), ("delta", False, False, vd + kd), ("delta", False, True, kd)}

    # what the engine's own long-range paths launch is among what was warmed
    recorder.patterns.clear()
    inp = kernel_warmup._inputs(m, torch.device("cpu"), torch.float32, 40)
    ranges = [(0, 18), (22, 40)]
    run = long_ranges.run_from_zero("delta", inp, ranges)
    long_ranges.outputs("delta", inp, ranges, [torch.zeros(*m.state_shape) for _ in ranges])
    m.transition_operator(inp, "fla")
    assert recorder.patterns and set(recorder.patterns) <= warmed
    assert ("delta", False, False, vd + kd) in recorder.patterns and len(run.ops) == 2


def test_scalar_decay_layers_skip_the_dense_patterns(recorder):
    model = _model("ring-tiny")
    calls = warm_calls(model)
    families = {c.mixer.family for c in calls}
    assert families and all(f != "delta" for f in families)
    for f in families:
        got = [c.pattern for c in calls if c.mixer.family == f]
        assert got == (list(PATTERNS) if f in ("kda",) else [p for p in PATTERNS
                                                             if p not in ("operators", "transition")])
    RecurrenceKernelWarmup(model, "fla", torch.device("cpu"), torch.float32, "upfront")
    assert len(recorder.patterns) == len(calls)


def test_modes_and_backends(recorder):
    model = _model("qwen3next-tiny")
    assert RecurrenceKernelWarmup(model, "torch", torch.device("cpu"), torch.float32, "upfront").calls == []
    lazy = RecurrenceKernelWarmup(model, "fla", torch.device("cpu"), torch.float32, "lazy")
    assert lazy.pending == [] and not recorder.patterns
    idle = RecurrenceKernelWarmup(model, "fla", torch.device("cpu"), torch.float32, "idle")
    assert len(idle.pending) == len(PATTERNS) and not recorder.patterns
    steps = 0
    while idle.step():
        steps += 1
    assert steps == len(PATTERNS) and len(recorder.patterns) == len(PATTERNS) and idle.capture_s is not None


def test_a_failed_idle_pattern_leaves_the_rest_to_first_use(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(fla_backend, "fla_chunk", boom)
    idle = RecurrenceKernelWarmup(_model("qwen3next-tiny"), "fla", torch.device("cpu"), torch.float32, "idle")
    assert idle.step() and idle.pending == [] and "out of memory" in idle.failed
    with pytest.raises(RuntimeError, match="out of memory"):
        RecurrenceKernelWarmup(_model("qwen3next-tiny"), "fla", torch.device("cpu"), torch.float32, "upfront")
