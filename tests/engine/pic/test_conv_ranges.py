"""engine.pic.conv_ranges: the packed conv (one gather per layer from a per-request layout)
gives the same outputs and leaves the same tail as the per-event walk, for every placement
shape a request can hold (first pieces whose tail is shorter than the conv window, pieces
whose spliced tail is shorter than it, seams shorter than it, one range or many)."""
from __future__ import annotations

import pytest
import torch

from engine.cache.layer_caches import StateSlotCache
from engine.models.layers.conv import ShortConv
from engine.pic.conv_ranges import conv_layout, conv_ranges
from engine.pic.errors import SplicePlacementError
from engine.pic.fused_events import Computed, Placed
from engine.pic.signature import LinearPart, SegmentSignature
from engine.pic.splice import SplicePiece

CH, WIDTH = 6, 4


class _Mixer:
    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.conv = ShortConv(CH, WIDTH)
        torch.nn.init.normal_(self.conv.weight)


def _piece(first: bool, tokens: int, split: int, tail_cols: int, offset: int, layers: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    parts = [LinearPart("scalar", torch.zeros(2, 3, 3), torch.zeros(2, 3, 3), torch.zeros(2),
                        conv_tail=torch.randn(CH, tail_cols, generator=g)) for _ in range(layers)]
    sig = SegmentSignature(num_tokens=tokens, anchor_len=0 if first else 2, split=0 if first else split,
                           layers=tuple(parts))
    return SplicePiece(sig, offset=0 if first else offset, first=first)


# (first piece? (tokens, tail columns)), then items: ("c", tokens) computed, ("p", tokens, split, tail columns)
LAYOUTS = {
    "seams-between-pieces": [("c", 5), ("p", 40, 3, 3), ("c", 16), ("p", 30, 3, 3), ("c", 7)],
    "first-short-tail": [("f", 2, 2), ("c", 2), ("p", 20, 18, 3), ("c", 1), ("p", 9, 2, 5), ("c", 4)],
    "short-spliced-tails": [("c", 1), ("p", 10, 9, 3), ("p", 8, 6, 3), ("c", 2), ("p", 5, 4, 1), ("c", 3)],
    "one-range": [("f", 12, 3), ("c", 9)],
}


def _events(spec, layers):
    events, off, pos, placed = [], 0, 0, 0
    for j, item in enumerate(spec):
        if item[0] == "c":
            n = item[1]
            events.append(Computed(off, off + n, pos + n))
            off, pos = off + n, pos + n
            continue
        if item[0] == "f":
            piece = _piece(True, item[1], 0, item[2], 0, layers, 10 + j)
        else:
            piece = _piece(False, item[1], item[2], item[3], pos - item[2], layers, 10 + j)
        events.append(Placed(piece, placed))
        placed += 1
        pos = piece.end
    return events, off


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_packed_conv_equals_the_per_event_walk_on_every_layer(name):
    layers = 3
    events, n = _events(LAYOUTS[name], layers)
    packed = StateSlotCache(torch.zeros(2, 2, 3, 3), torch.randn(2, CH, WIDTH - 1))
    walked = StateSlotCache(packed.state.clone(), packed.conv_tail.clone())
    shared: dict = {}
    for layer in range(layers):
        mixer = _Mixer(layer)
        conv_in = torch.randn(1, n, CH)
        seq = type("Seq", (), {"slot": 1})()
        got = conv_ranges(seq, packed, mixer, layer, events, conv_in, shared=shared)
        want = conv_ranges(seq, walked, mixer, layer, events, conv_in, tails_at={})
        assert got.shape == (1, n, CH)
        assert torch.equal(got, want)
        assert torch.equal(packed.conv_tail, walked.conv_tail)
    assert sum(1 for k in shared if k[0] == "conv_layout") == 1  # one layout for every layer


def test_a_layout_whose_ranges_do_not_cover_c_is_rejected():
    events, n = _events(LAYOUTS["seams-between-pieces"], 1)
    with pytest.raises(SplicePlacementError, match="cover 28 tokens, C holds 29"):
        conv_layout(events, WIDTH - 1, (3, 3), n + 1, torch.device("cpu"))
