"""tools/bench_layered_copy.py on the CPU: the synthetic blob's layout goes through the
loader's own planning (engine.connector.layer_loads) as a signature blob does; the copies
themselves need CUDA (the tool exits 2 without it)."""
from __future__ import annotations

import torch

from engine.connector.layer_loads import (COPY_GROUP_GROWTH, MAX_COPY_GROUP_BYTES, MIN_COPY_BYTES, group_layers,
                                          layer_plan)
from tools.bench_layered_copy import blob_layout, main


def test_the_layout_plans_every_layer_once_in_growing_groups_like_a_signature_blob():
    parts, stacked, total = blob_layout(1400)
    assert total == sum(p.length for p in parts) and parts[-1].offset + parts[-1].length == total
    plan = layer_plan(parts, stacked)
    assert [ls.layer for ls in plan] == list(range(24))
    assert sum(ls.nbytes for ls in plan) == total
    assert [len(ls.spans) for ls in plan[:4]] == [4, 4, 4, 2]  # delta: state, tail state, T, conv tail; attention: K, V
    groups = group_layers(plan, MIN_COPY_BYTES, COPY_GROUP_GROWTH, MAX_COPY_GROUP_BYTES)
    assert sum(g.nbytes for g in groups) == total
    assert groups[0].nbytes >= MIN_COPY_BYTES and groups[1].nbytes >= 2 * MIN_COPY_BYTES
    covered = [i for g in groups for i in range(g.layer, (g.last if g.last is not None else g.layer) + 1)]
    assert covered == list(range(24))


def test_without_cuda_it_says_so_and_exits_2(capsys):
    if torch.cuda.is_available():  # pragma: no cover - GPU machines run the bench itself
        return
    assert main(["--segments", "1", "--repeats", "1"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
