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
from engine.connector.layer_loads import LayerPlanError, group_layers, issue_layered, layer_plan, span_views
from engine.models.config import FULL, GDN, MAMBA2, SWA
from engine.pic.compute import compute_signature
from kvstore import format as fmt


class FakeQueue:
    """An in-order queue: copies run only when an event recorded after them is waited on."""

    def __init__(self) -> None:
        self.ops: list[tuple] = []  # ("copy", dst, src) | ("event", n)
        self.done = 0  # ops executed

    def copy_many(self, dsts, srcs) -> None:
        assert len(dsts) == len(srcs)
        for dst, src in zip(dsts, srcs):
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
    assert _merged_bytes(_covered(grouped)) == _merged_bytes(_covered(plan))
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
    assert _merged_bytes(_covered(grown)) == _merged_bytes(_covered(plan)) and total == sum(g.nbytes for g in grown)
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
    landed = signature_from_blob(header.meta, fmt.tensors_over(header, dst), "fp", "fp")
    want, _, layers = sig.to_tensors()
    waits = []
    for i in range(6):
        events.wait_layer(i, lambda ev: (waits.append(ev), q.wait(ev)))
        group = next(g for g in reversed(grouped) if g.layer <= i)
        upto = group.layer if group.last is None else group.last
        got, _, _ = landed.to_tensors()
        for name, t in want.items():
            if layers[name] <= upto:
                assert torch.equal(got[name], t), name
            elif t.abs().sum() > 0:
                assert not torch.equal(got[name], t), f"{name} arrived before its group was waited for"
    assert len(waits) == 3  # one wait per group, not per layer


@pytest.mark.parametrize("groups", [1, 3])
def test_span_views_alias_each_span_and_a_group_is_one_copy_call(blob_of, groups):
    _, buf = blob_of([GDN, FULL, GDN, MAMBA2, SWA, GDN, FULL])
    header = fmt.read_header(buf)
    plan = layer_plan(header.parts, header.meta.get("stacked"))
    grouped = group_layers(plan, -(-sum(p.nbytes for p in plan) // groups))
    views = span_views(buf, grouped)
    assert [len(v) for v in views] == [len(g.spans) for g in grouped]
    base = buf.data_ptr()
    for g, vs in zip(grouped, views):
        for (off, n), v in zip(g.spans, vs):
            assert v.data_ptr() == base + off and v.numel() == n  # a view, not a copy

    class CallCounting(FakeQueue):
        calls = 0

        def copy_many(self, dsts, srcs) -> None:
            self.calls += 1
            super().copy_many(dsts, srcs)

    dst = torch.zeros_like(buf)
    q = CallCounting()
    events = issue_layered(buf, dst, grouped, q)
    assert q.calls == len(grouped)
    events.wait_layer(6, q.wait)
    covered = torch.zeros_like(buf, dtype=torch.bool)
    for off, n in _covered(grouped):
        covered[off:off + n] = True
    assert torch.equal(dst[covered], buf[covered]) and not dst[~covered].any()
