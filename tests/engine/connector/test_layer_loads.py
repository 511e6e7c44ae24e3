"""Layer-by-layer copies of a signature blob (engine.connector.layer_loads) on a recording
fake copy queue: the plan covers every part's bytes once, layer by layer in order; an
event follows each layer's copies; waiting for layer i makes exactly layers <= i present
in the destination (the later ones still arriving), so a signature decoded over the
destination holds layer i's tensors bit for bit when layer i is first read. Grouped
(`group_layers`, what the loader copies): consecutive layers of at least min_bytes, one
copy per stacked part and group, every byte once, and waiting for layer i lands its
whole group and nothing after it."""
from __future__ import annotations

import pytest
import torch

from engine.connector.codec import signature_blob, signature_from_blob
from engine.connector.layer_loads import LayerPlanError, group_layers, groups_at, issue_layered, layer_plan
from engine.models.config import FULL, GDN, MAMBA2, SWA
from engine.pic.compute import compute_signature
from kvstore import format as fmt


class FakeQueue:
    """An in-order queue: copies run only when an event recorded after them is waited on."""

    def __init__(self) -> None:
        self.ops: list[tuple] = []  # ("copy", dst, src) | ("event", n)
        self.done = 0  # ops executed

    def copy(self, dst, src) -> None:
        assert dst.numel() == src.numel()
        self.ops.append(("copy", dst, src))

    def record(self) -> int:
        self.ops.append(("event", len(self.ops)))
        return len(self.ops) - 1

    def wait(self, event: int) -> None:
        while self.done <= event:
            op = self.ops[self.done]
            if op[0] == "copy":
                op[1].copy_(op[2])
            self.done += 1


@pytest.fixture
def blob_of(make_config, make_model):
    def make(layers):
        model = make_model(make_config(layers))
        ids = torch.randint(2, 50, (40,), generator=torch.Generator().manual_seed(3)).tolist()
        with torch.inference_mode():
            sig = compute_signature(model, ids, [1], 8)
        blob = signature_blob(sig, "fp")
        buf = torch.frombuffer(fmt.encode_tensors(blob.tensors, fingerprint="fp", token_count=blob.token_count,
                                                  meta=blob.meta, layers=blob.layers), dtype=torch.uint8)
        return sig, buf
    return make


def test_the_plan_covers_every_part_once_in_layer_order(blob_of):
    sig, buf = blob_of([GDN, GDN, FULL, GDN, FULL, MAMBA2, SWA])
    header = fmt.read_header(buf)
    plan = layer_plan(header.parts, header.meta.get("stacked"))
    assert [p.layer for p in plan] == list(range(7))
    spans = sorted(s for p in plan for s in p.spans)
    assert sum(n for _, n in spans) == sum(p.length for p in header.parts)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))  # no byte twice


def test_waiting_for_layer_i_lands_exactly_layers_up_to_i(blob_of):
    sig, buf = blob_of([GDN, FULL, GDN, MAMBA2, SWA])
    header = fmt.read_header(buf)
    dst = torch.zeros_like(buf)
    q = FakeQueue()
    events = issue_layered(buf, dst, layer_plan(header.parts, header.meta.get("stacked")), q)
    assert q.done == 0 and events.layers == list(range(5))
    # one event after each layer's copies, in layer order
    kinds = [op[0] for op in q.ops]
    assert kinds.count("event") == 5 and kinds[-1] == "event"
    landed = signature_from_blob(header.meta, fmt.tensors_over(header, dst), "fp", "fp")
    want, _, layers = sig.to_tensors()
    for i in range(5):
        events.wait_layer(i, q.wait)
        got, _, _ = landed.to_tensors()
        for name, t in want.items():
            if layers[name] <= i:
                assert torch.equal(got[name], t), name
            elif t.abs().sum() > 0:
                assert not torch.equal(got[name], t), f"{name} arrived before its layer was waited for"
    events.wait_layer(2, q.wait)  # once per layer
    assert q.done == len(q.ops)


def test_a_stacked_row_without_a_layer_name_is_refused(blob_of):
    _, buf = blob_of([GDN, GDN, FULL])
    header = fmt.read_header(buf)
    stacked = {name: ["state"] * len(rows) for name, rows in header.meta["stacked"].items()}
    with pytest.raises(LayerPlanError, match="does not name a layer"):
        layer_plan(header.parts, stacked)


def _covered(plan):
    return sorted(s for p in plan for s in p.spans)


def _merged_bytes(spans):
    return [b for off, n in spans for b in range(off, off + n)]


def _same_bytes_plus_padding(grouped, plan):
    """Every byte of `plan` copied exactly once by `grouped`, and no byte twice; any other
    byte it copies lies outside the plan, which covers every part of the blob
    (test_the_plan_covers_every_part_once_in_layer_order): padding. Returns how many."""
    got = _merged_bytes(_covered(grouped))
    assert len(got) == len(set(got))
    want = set(_merged_bytes(_covered(plan)))
    assert want <= set(got)
    return len(set(got) - want)


@pytest.mark.parametrize("groups", [1, 2, 3])
def test_grouped_layers_copy_every_byte_once_in_fewer_larger_copies(blob_of, groups):
    _, buf = blob_of([GDN, GDN, FULL, GDN, FULL, MAMBA2, SWA, GDN])
    header = fmt.read_header(buf)
    plan = layer_plan(header.parts, header.meta.get("stacked"))
    total = sum(p.nbytes for p in plan)
    grouped = group_layers(plan, -(-total // groups))
    assert len(grouped) == groups
    # consecutive layers, in order, every layer in exactly one group
    firsts = [g.layer for g in grouped]
    lasts = [g.layer if g.last is None else g.last for g in grouped]
    assert firsts[0] == 0 and lasts[-1] == 7 and all(b == a + 1 for a, b in zip(lasts, firsts[1:]))
    assert all(g.nbytes >= -(-total // groups) for g in grouped[:-1])
    # the same bytes as the per-layer plan, each once
    _same_bytes_plus_padding(grouped, plan)
    # rows of consecutive layers in a stacked part are one copy: at most one span per blob part per group
    assert all(len(g.spans) <= len(header.parts) for g in grouped)
    assert sum(len(g.spans) for g in grouped) < sum(len(p.spans) for p in plan)
    assert group_layers(plan, 0) == plan


def test_growing_groups_start_small_then_double_up_to_the_cap_and_copy_every_byte_once(blob_of):
    _, buf = blob_of([GDN, GDN, FULL, GDN, FULL, MAMBA2, SWA, GDN] * 3)
    header = fmt.read_header(buf)
    plan = layer_plan(header.parts, header.meta.get("stacked"))
    total = sum(p.nbytes for p in plan)
    small = max(p.nbytes for p in plan)  # the largest layer
    flat = group_layers(plan, 1)  # every layer its own group
    grown = group_layers(plan, small, growth=2.0, max_bytes=4 * small)
    assert len(flat) == len(plan) and len(grown) < len(flat)
    floors = [min(small * 2 ** i, 4 * small) for i in range(len(grown))]
    assert all(g.nbytes >= f for g, f in zip(grown[:-1], floors))
    assert grown[0].nbytes < 2 * small  # the first layers still come early
    _same_bytes_plus_padding(grown, plan)
    firsts = [g.layer for g in grown]
    lasts = [g.layer if g.last is None else g.last for g in grown]
    assert firsts[0] == 0 and lasts[-1] == len(plan) - 1 and all(b == a + 1 for a, b in zip(lasts, firsts[1:]))
    assert group_layers(plan, small, growth=2.0) != grown  # without a cap the floors keep doubling
    with pytest.raises(ValueError, match="growth=0.5"):
        group_layers(plan, small, growth=0.5)


def test_waiting_for_a_layer_of_a_group_lands_the_group_and_nothing_after_it(blob_of):
    sig, buf = blob_of([GDN, FULL, GDN, MAMBA2, SWA, GDN])
    header = fmt.read_header(buf)
    plan = layer_plan(header.parts, header.meta.get("stacked"))
    grouped = group_layers(plan, -(-sum(p.nbytes for p in plan) // 3))
    dst = torch.zeros_like(buf)
    q = FakeQueue()
    events = issue_layered(buf, dst, grouped, q)
    assert events.layers == [g.layer for g in grouped] and len(events.layers) == 3
    waits = []
    _lands_group_by_group(sig, header, dst, grouped, events, lambda ev: (waits.append(ev), q.wait(ev)), 6)
    assert len(waits) == 3  # one wait per group, not per layer


def _lands_group_by_group(sig, header, dst, plan, events, wait, n_layers):
    """Waiting for each layer in turn lands exactly the layers of its group and those
    before: a later group's parts are still unwritten (where they are not all zeros)."""
    landed = signature_from_blob(header.meta, fmt.tensors_over(header, dst), "fp", "fp")
    want, _, layers = sig.to_tensors()
    for i in range(n_layers):
        events.wait_layer(i, wait)
        group = next(g for g in reversed(plan) if g.layer <= i)
        upto = group.layer if group.last is None else group.last
        got, _, _ = landed.to_tensors()
        for name, t in want.items():
            if layers[name] <= upto:
                assert torch.equal(got[name], t), name
            elif t.abs().sum() > 0:
                assert not torch.equal(got[name], t), f"{name} arrived before its group was waited for"


def test_banded_blobs_copy_each_band_in_one_span_and_land_it_whole(blob_of, monkeypatch):
    import engine.connector.codec as codec

    monkeypatch.setattr(codec, "MIN_COPY_BYTES", 3000)  # bands of a tiny model's few KiB per layer
    monkeypatch.setattr(codec, "MAX_COPY_GROUP_BYTES", 8000)
    sig, buf = blob_of([GDN, FULL, GDN, MAMBA2, SWA, GDN, GDN, FULL])
    header = fmt.read_header(buf)
    bands = header.meta["bands"]
    assert len(bands) >= 3 and bands[0] == 0 and bands == sorted(bands)
    per_layer = layer_plan(header.parts, header.meta.get("stacked"))
    plan = groups_at(per_layer, bands)
    assert [g.layer for g in plan] == bands
    assert all(len(g.spans) == 1 for g in plan)  # a band is laid out together: one copy
    _same_bytes_plus_padding(plan, per_layer)
    # the loader's own grouping with the codec's thresholds finds the same groups
    assert group_layers(per_layer, 3000, 2.0, 8000) == plan
    # the same signature in one band (the layout before bands): a copy per stacked part and group
    monkeypatch.setattr(codec, "MIN_COPY_BYTES", 1 << 30)
    _, flat = blob_of([GDN, FULL, GDN, MAMBA2, SWA, GDN, GDN, FULL])
    h = fmt.read_header(flat)
    assert h.meta["bands"] == [0]
    assert sum(len(g.spans) for g in group_layers(layer_plan(h.parts, h.meta["stacked"]), 3000, 2.0, 8000)) \
        > 2 * len(plan)
    dst = torch.zeros_like(buf)
    q = FakeQueue()
    events = issue_layered(buf, dst, plan, q)
    _lands_group_by_group(sig, header, dst, plan, events, q.wait, 8)


def test_blobs_written_before_bands_still_load_by_the_loaders_grouping(blob_of):
    sig, buf = blob_of([GDN, FULL, GDN, MAMBA2])
    header = fmt.read_header(buf)
    meta = {k: v for k, v in header.meta.items() if k != "bands"}
    plan = group_layers(layer_plan(header.parts, meta.get("stacked")), 1 << 20)
    dst = torch.zeros_like(buf)
    q = FakeQueue()
    issue_layered(buf, dst, plan, q).wait_layer(3, q.wait)
    got, _, _ = signature_from_blob(meta, fmt.tensors_over(header, dst), "fp", "fp").to_tensors()
    want, _, _ = sig.to_tensors()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("bands", ["0,4", [0, "4"], [0, -1], None])
def test_malformed_bands_are_refused_as_a_layer_plan_error(blob_of, bands):
    _, buf = blob_of([GDN, FULL])
    header = fmt.read_header(buf)
    with pytest.raises(LayerPlanError, match="bands="):
        groups_at(layer_plan(header.parts, header.meta.get("stacked")), bands)
