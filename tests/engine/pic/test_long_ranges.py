"""engine.pic.long_ranges on fresh random inputs, fla emulated by the torch recurrence:
a delta-rule layer's long ranges run from zero in one call, stepped over as
S = T S + E, and given their outputs from their start states by a second call match
each range run alone from its start state; only the delta rule takes the path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.models.layers import fla_backend
from engine.models.layers.linear_ops import RecurrenceInputs, chunked_recurrence
from engine.pic import long_ranges
from pic_testlib import fla_emulated

H, K, V = 3, 8, 6
RANGES = [(2, 21), (25, 40), (40, 63)]  # a gap, then two ranges back to back; rows 63.. ride along


def _inputs(family: str, t: int, seed: int) -> RecurrenceInputs:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, t, H, K, generator=g)
    k = F.normalize(torch.randn(1, t, H, K, generator=g), dim=-1)
    v = torch.randn(1, t, H, V, generator=g)
    shape = (1, t, H, K) if family == "diag" else (1, t, H)
    log_decay = F.logsigmoid(torch.randn(shape, generator=g) + 2.0)
    beta = torch.rand(1, t, H, generator=g) if family == "delta" else None
    return RecurrenceInputs(q=q, k=k, v=v, log_decay=log_decay, beta=beta, scale=K ** -0.5)


def test_long_ranges_from_zero_then_start_states_match_each_range_run_alone(monkeypatch):
    family = "delta"
    calls = []

    def counted(fam, inp, initial_state, cu_seqlens=None):
        calls.append(fam)
        return fla_emulated(fam, inp, initial_state, cu_seqlens)

    monkeypatch.setattr(fla_backend, "fla_chunk", counted)
    seed = int(torch.randint(0, 2 ** 31 - 1, ()).item())  # fresh inputs every run
    inp = _inputs(family, 70, seed)
    state = torch.randn(H, K, V, generator=torch.Generator().manual_seed(seed + 1))
    run = long_ranges.run_from_zero(family, inp, RANGES)
    assert len(run.ops) == len(RANGES)
    starts, want_out = [], []
    for i, (a, b) in enumerate(RANGES):
        starts.append(state)
        o, end = chunked_recurrence(family, inp.slice_time(a, b), state[None], 16)
        want_out.append(o)
        state_next = long_ranges.step_over(family, run.ops[i], state)
        torch.testing.assert_close(state_next, end[0], rtol=1e-4, atol=1e-4, msg=lambda m: f"{seed}: {m}")
        state = end[0]
    out = long_ranges.outputs(family, inp, RANGES, starts)
    for (a, b), want in zip(RANGES, want_out):
        torch.testing.assert_close(out[:, a:b], want, rtol=1e-4, atol=1e-4, msg=lambda m: f"{seed}: {m}")
    assert len(calls) == 2


@pytest.mark.parametrize("family", ["scalar", "diag"])
def test_only_the_delta_rule_takes_the_shared_calls(family):
    assert long_ranges.batches("delta", 2) and not long_ranges.batches("delta", 1)
    assert not long_ranges.batches("delta", 3, enabled=False)  # PicConfig.batch_long_ranges off
    assert not long_ranges.batches(family, 3)
    inp = _inputs(family, 8, 0)
    with pytest.raises(ValueError, match=f"family='{family}'"):
        long_ranges.run_from_zero(family, inp, [(0, 4), (4, 8)])
    with pytest.raises(ValueError, match=f"family='{family}'"):
        long_ranges.outputs(family, inp, [(0, 8)], [torch.zeros(H, K, V)])
