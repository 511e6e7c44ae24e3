"""engine.pic.compute.settle_transitions: every pending delta part gets its live heads and
the operator rows of exactly those heads, in head order, across layers read in one go."""
from __future__ import annotations

import torch

from engine.pic.compute import PendingTransitions, settle_transitions
from engine.pic.signature import LinearPart


def _part() -> LinearPart:
    return LinearPart(family="delta", state=torch.zeros(4, 3, 3), tail_state=None, tail_transition=None)


def test_each_part_keeps_the_rows_of_its_live_heads_in_order():
    g = torch.Generator().manual_seed(0)
    layers = []
    for m in (3, 2):
        dense = torch.randn(m, 4, 3, 3, generator=g)
        live = torch.rand(m, 4, generator=g) > 0.5
        live[0] = torch.tensor([False, True, False, True])  # some heads forgotten
        live[1] = True  # every head live: the dense operator itself
        if m > 2:
            live[2] = False  # none live: no transition
        p = PendingTransitions(dense, live)
        parts = [_part() for _ in range(m)]
        p.attach(parts, layers)
    pending = list(layers)
    settle_transitions(layers)
    assert layers == []
    for p in pending:
        for i, part in enumerate(p.parts):
            heads = tuple(int(h) for h in torch.nonzero(p.live[i]).flatten())
            assert part.live_heads == heads
            if not heads:
                assert part.tail_transition is None
            else:
                assert torch.equal(part.tail_transition, p.dense[i][list(heads)])
                assert part.tail_transition.is_contiguous()
    assert pending[0].parts[0].live_heads == (1, 3) and pending[0].parts[2].tail_transition is None
