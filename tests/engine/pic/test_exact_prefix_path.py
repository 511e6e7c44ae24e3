"""An exact repeat takes prefix caching's path after the restore (engine.pic.planner,
PicConfig.exact_prefix): PIC's plan and the prefill of the rest (every `fused_prefill`
call, with its arguments) are those of the `prefix` planner, the segment store sees only
the request's bookkeeping (no lookup, claim, take, layer hook, hint or publish on its
path), earlier requests' captures wait for the next splicing request or idle time, and
the logits are full recompute's. Op for op: from plan to first-token logits, the two
requests dispatch the same torch ops (restore, pass and bookkeeping alike: no capture,
hook, allocation or copy on PIC's side that prefix caching lacks). The restore computes
each checkpoint's flat slots once for all full-attention layers (one block-table copy
per checkpoint, not one per checkpoint and layer)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import engine.pic.fused as fused_mod
import engine.pic.planner as planner_mod
from engine.models.config import FULL, GDN, MAMBA2, SWA
from engine.pic.config import PicConfig
from engine.pic.planner import make_planner
from engine.pic.prefix import restore_checkpoints
from engine.pic.segment_store import InProcessSegmentStore, SegmentStore
from engine.pic.signature_cache import InMemorySignatureCache
from engine.runtime.planner import ApplyStep, FusedStep
from engine.runtime.sequence import Sequence
from pic_testlib import FakeTokenizer, execute, make_request, plain_prefill, rand_ids

MIXES = {"gdn": [GDN, SWA, FULL], "mamba2": [MAMBA2, FULL, SWA]}
BOOKKEEPING = ["admit", "finish"]


class RecordingStore(InProcessSegmentStore):
    """An `InProcessSegmentStore` that records the name of every `SegmentStore` method
    called on it (the in-process store makes no such calls on itself)."""

    def __init__(self, config: PicConfig) -> None:
        super().__init__(InMemorySignatureCache(config.signature_cache_bytes))
        self.calls: list[str] = []
        for name, attr in vars(SegmentStore).items():
            if callable(attr) and not name.startswith("_"):
                setattr(self, name, self._recorded(name, getattr(self, name)))

    def _recorded(self, name, method):
        def call(*args, **kw):
            self.calls.append(name)
            return method(*args, **kw)
        return call


class OpRecorder(TorchDispatchMode):
    """The name of every torch op dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def fused_calls(monkeypatch):
    """Every fused_prefill call (whoever makes it), as its items and keyword arguments."""
    calls: list[dict] = []
    real = fused_mod.fused_prefill

    def summary(key, value):
        if key == "checkpoints":
            return [(c.start, c.end, c.with_state) for c in value]
        return "callable" if callable(value) else value

    def recording(model, manager, seq, token_ids, items, **kw):
        calls.append({"items": [(it.start, it.end, it.piece is not None, it.sealed) for it in items],
                      "tokens": len(token_ids), **{k: summary(k, v) for k, v in kw.items()}})
        return real(model, manager, seq, token_ids, items, **kw)

    monkeypatch.setattr(fused_mod, "fused_prefill", recording)
    monkeypatch.setattr(planner_mod, "fused_prefill", recording)
    return calls


def _layout(docs, q):
    return [(d, True) for d in docs] + [(q, False)]


def _steps(plan):
    return [(type(s).__name__, getattr(s, "label", None), s.end) for s in plan.steps]


def _scheduled(plan):
    """What the scheduler sees of a plan: each step's range and the tokens it computes."""
    return [(type(s).__name__, getattr(s, "start", None), s.end, getattr(s, "compute_tokens", None))
            for s in plan.steps] + [plan.num_tokens, plan.num_reused_tokens]


def _pic(model, **kw):
    config = PicConfig(method="pic", fused=True, seam=4, **kw)
    store = RecordingStore(config)
    return make_planner(config, model, "test-model", FakeTokenizer(), store=store), store


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_an_exact_repeat_runs_prefix_cachings_plan_and_pass_after_the_restore(mix, model_of, runner_of,
                                                                              fused_calls):
    model = model_of(MIXES[mix])
    runner = runner_of(model, num_slots=8)
    docs, q = [rand_ids(n, 200 + n) for n in (17, 13, 15)], rand_ids(5, 7)
    pic, store = _pic(model)
    execute(pic, runner, make_request(_layout(docs, q)))
    while pic.help_idle(runner):  # its segments alone, then its exact prefix, computed while idle
        pass
    assert not pic.exact.pending and pic.exact.computed == 1
    prefix = make_planner(PicConfig(method="prefix", fused=True), model, "test-model", FakeTokenizer())
    execute(prefix, runner, make_request(_layout(docs, q)))

    store.calls.clear()
    fused_calls.clear()
    warm = make_request(_layout(docs, q))
    with OpRecorder() as pic_ops:
        got = execute(pic, runner, warm)
    pic_calls, pic_store = list(fused_calls), list(store.calls)
    fused_calls.clear()
    again = make_request(_layout(docs, q))
    with OpRecorder() as prefix_ops:
        ref = execute(prefix, runner, again)
    prefix_calls = list(fused_calls)

    end = 1 + sum(map(len, docs))
    assert pic.take_report(warm.request_id).prefix_tokens == end
    assert prefix.take_report(again.request_id).reused_tokens == end
    # the same plan: restore at the deepest boundary, then one pass over the question
    assert _steps(warm.plan) == _steps(again.plan) == [("ApplyStep", "load", end), ("FusedStep", "fused",
                                                                                       end + len(q))]
    assert isinstance(warm.plan.steps[0], ApplyStep) and isinstance(warm.plan.steps[1], FusedStep)
    assert _scheduled(warm.plan) == _scheduled(again.plan)  # the same token grants from the scheduler
    # the same prefill of the rest, argument for argument
    assert len(pic_calls) == 1 and pic_calls == prefix_calls
    assert pic_calls[0]["items"] == [(end, end + len(q), False, False)]
    # no segment-store work on the request's path: only its bookkeeping
    assert pic_store == BOOKKEEPING
    # the same device work from plan to logits, op for op
    assert pic_ops.ops and pic_ops.ops == prefix_ops.ops
    torch.testing.assert_close(got.logits[-1], ref.logits[-1], rtol=1e-5, atol=1e-5)
    full = plain_prefill(runner, warm.prompt_token_ids, [warm.num_prompt_tokens])
    torch.testing.assert_close(got.logits[-1], full.logits[-1], rtol=1e-5, atol=1e-5)


def test_captures_of_earlier_requests_wait_until_a_request_splices(model_of, runner_of, fused_calls):
    model = model_of(MIXES["gdn"])
    runner = runner_of(model, num_slots=8)
    docs, q = [rand_ids(n, 300 + n) for n in (16, 14)], rand_ids(4, 9)
    pic, store = _pic(model, miss_path="context", miss_signatures="context")
    execute(pic, runner, make_request(_layout(docs, q)))  # misses computed in context, captured
    while pic.help_idle(runner):  # captures published, then the exact prefix computed
        pass
    assert not pic.captured and not pic.exact.pending
    other = [rand_ids(n, 400 + n) for n in (12, 15)]
    execute(pic, runner, make_request(_layout(other, q)))
    assert pic.captured  # its captures: to be published later
    store.calls.clear()
    warm = make_request(_layout(docs, q))
    got = execute(pic, runner, warm)
    assert store.calls == BOOKKEEPING and pic.captured  # nothing published on the repeat's path
    assert pic.take_report(warm.request_id).prefix_tokens == 1 + sum(map(len, docs))
    full = plain_prefill(runner, warm.prompt_token_ids, [warm.num_prompt_tokens])
    torch.testing.assert_close(got.logits[-1], full.logits[-1], rtol=1e-5, atol=1e-5)
    # the next request that splices publishes them before its lookup, and hits them
    store.calls.clear()
    nxt = make_request(_layout([other[1], other[0]], rand_ids(3, 11)))
    execute(pic, runner, nxt)
    assert not pic.captured
    assert store.calls.index("publish") < store.calls.index("lookup")
    assert pic.take_report(nxt.request_id).hit_segments == 2


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_a_restore_computes_each_checkpoints_slots_once_for_every_layer(mix, model_of, runner_of, monkeypatch):
    model = model_of(MIXES[mix] * 2)  # two full-attention layers: slots shared across layers
    runner = runner_of(model, num_slots=8)
    docs, q = [rand_ids(n, 500 + n) for n in (17, 13, 15)], rand_ids(5, 7)
    pic, _ = _pic(model, prefix_checkpoints="every")
    execute(pic, runner, make_request(_layout(docs, q)))
    while pic.help_idle(runner):
        pass
    m = pic.exact.match(make_request(_layout(docs, q)).prompt_token_ids,
                        [(0, 18), (18, 31), (31, 46)])
    path = [n.checkpoint for n in m.path]
    assert len(path) == 3
    calls = []
    real = runner.cache.flat_slots
    monkeypatch.setattr(runner.cache, "flat_slots", lambda *a: calls.append(a[1:]) or real(*a))
    seq = runner.cache.allocate(Sequence("restored"))
    restore_checkpoints(runner.cache, seq, path)
    assert calls == [(cp.start, cp.end) for cp in path]  # once per checkpoint, not per layer too
    monkeypatch.undo()
    # and the restored caches continue exactly as a full pass does
    ids = make_request(_layout(docs, q)).prompt_token_ids
    logits = runner.prefill(seq, ids[46:], start_pos=46, all_logits=True)
    full = plain_prefill(runner, ids, [len(ids)])
    torch.testing.assert_close(logits[-1], full.logits[-1], rtol=1e-5, atol=1e-5)


def test_cached_after_is_false_exactly_when_the_layout_after_start_is_one_computed_range():
    """`layout.cached_after`, the exact-repeat planner's shortcut, against the layout it
    skips: whenever it says no cached segment follows `start`, the layout from `start`
    splices nothing and computes [start, end) as suffix; where it says one does, the
    layout splices or seams it."""
    from engine.pic.layout import cached_after, fused_spec, layout, splice_units

    key = lambda content, split: bytes([len(content), split])  # noqa: E731
    docs, q = [rand_ids(n, 300 + n) for n in (9, 3, 11)], rand_ids(4, 9)
    layouts = {"docs then question": _layout(docs, q),
               "uncached in between": [(docs[0], True), (q, False), (docs[1], True), (docs[2], True), (q, False)],
               "all cached": [(d, True) for d in docs],
               "empty last": _layout(docs, []),
               "nothing cached": [(d, False) for d in docs]}
    seen = set()
    for name, segs in layouts.items():
        req = make_request(segs)
        ids, segments = req.prompt_token_ids, req.segments
        for start in sorted({0} | {s.token_end for s in segments}):
            if start >= len(ids):
                continue
            items = layout(ids, segments, [ids[0]], 4, key, True, start)
            spec, kinds, end = fused_spec(items, start)
            covered = not cached_after(segments, start)
            seen.add(covered)
            if covered:
                assert not splice_units(items) and kinds == {"seam": 0, "suffix": len(ids) - start}, (name, start)
                assert end == len(ids)
            else:
                assert splice_units(items) or kinds["seam"], (name, start)
    assert seen == {True, False}
