"""tools/bench_layered_copy.py on the CPU: the synthetic blob's layout goes through the
loader's own planning (engine.connector.layer_loads) as a signature blob does; the copies
themselves need CUDA (the tool exits 2 without it)."""
from __future__ import annotations

import pytest
import torch

from engine.connector.layer_loads import (COPY_GROUP_GROWTH, MAX_COPY_GROUP_BYTES, MIN_COPY_BYTES, group_layers,
                                          groups_at, layer_plan)
from tools.bench_layered_copy import blob_layout, main, variant_plan


@pytest.mark.parametrize("banded", [True, False])
def test_the_layout_plans_every_layer_once_in_growing_groups_like_a_signature_blob(banded):
    parts, stacked, total, bands = blob_layout(1400, banded=banded)
    assert parts[-1].offset + parts[-1].length == total and all(p.offset % 4096 == 0 for p in parts)
    plan = layer_plan(parts, stacked)
    assert [ls.layer for ls in plan] == list(range(24))
    assert sum(ls.nbytes for ls in plan) == sum(p.length for p in parts)
    groups = group_layers(plan, MIN_COPY_BYTES, COPY_GROUP_GROWTH, MAX_COPY_GROUP_BYTES)
    assert groups[0].nbytes >= MIN_COPY_BYTES and groups[1].nbytes >= 2 * MIN_COPY_BYTES
    covered = [i for g in groups for i in range(g.layer, (g.last if g.last is not None else g.layer) + 1)]
    assert covered == list(range(24))
    if banded:  # the codec's layout: a group is one copy, at the bands' first layers
        assert groups_at(plan, bands) == groups and all(len(g.spans) == 1 for g in groups)
        assert [g.layer for g in groups] == bands
    else:  # stacked across all layers: a copy per stacked part and group
        assert bands == [0] and sum(len(g.spans) for g in groups) >= 4 * len(groups)
        assert [len(ls.spans) for ls in plan[:4]] == [4, 4, 4, 2]  # delta: state, tail, T, conv; attention: K, V


def test_the_variants_plan_their_layouts_and_an_unknown_one_is_refused():
    banded, n1 = variant_plan("banded", 1400)
    unbanded, n2 = variant_plan("unbanded", 1400)
    whole, n3 = variant_plan("whole", 1400)
    assert whole is None and n3 == n1 and abs(n1 - n2) < 4096 * 8
    assert sum(len(g.spans) for g in banded) == len(banded) < sum(len(g.spans) for g in unbanded)
    with pytest.raises(SystemExit, match="unknown variant 'per_span'"):
        variant_plan("per_span", 1400)


def test_without_cuda_it_says_so_and_exits_2(capsys):
    if torch.cuda.is_available():  # pragma: no cover - GPU machines run the bench itself
        return
    assert main(["--segments", "1", "--repeats", "1"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
