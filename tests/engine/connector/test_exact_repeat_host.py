"""An exact repeat served through a REAL kvstore daemon the way the tiered benchmark serves
it (tools/bench_tiered.py serve phase, workload `repeat`): PIC with exact prefixes and the
cold fallback over a `DaemonSegmentStore`, prefix caching as a `StorePrefixPlanner`, each
restoring the exact checkpoint its own earlier pass took (the daemon's copy deleted in
between, as the benchmark's `forget` does). From the request's arrival to its first
token, PIC must cost the host no more than prefix caching:

- the pass after the restore (the suffix): the same torch ops, op for op;
- the whole request (plan, restore, pass, bookkeeping): no more torch ops dispatched;
- no more calls of the project's own Python functions (engine/, kvstore/, kernels/):
  planning, restore and bookkeeping included. Counted calls are a machine-independent
  measure of the host work around the same device work;

and it samples the same first token as prefix caching."""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

import engine.pic.fused as fused_mod
from connector_testlib import DOCS, new_engine, prompt, run_one
from engine.connector.attach import attach_store
from engine.connector.config import StoreConnectorConfig
from engine.connector.prefix_store import OBJECT_KIND
from engine.pic.config import PicConfig
from engine.runtime.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[3]
#: the project's own code, whose Python calls count as host work
OWN = tuple(str(REPO / p) + "/" for p in ("engine", "kvstore", "kernels"))
ONE_TOKEN = SamplingParams(max_new_tokens=1, ignore_eos=True)


class OwnCalls:
    """Calls of Python functions defined under OWN while active, by file:function."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()

    def _profile(self, frame, event, arg) -> None:
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(OWN):
                self.calls[f"{name[len(str(REPO)) + 1:]}:{frame.f_code.co_name}"] += 1

    def __enter__(self) -> "OwnCalls":
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)


class Ops(TorchDispatchMode):
    """The name of every torch op dispatched while active; those dispatched inside
    `fused_prefill` (the pass after the restore) also in `fused`."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.fused: list[str] = []
        self.in_fused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        if self.in_fused:
            self.fused.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def fused_marked(monkeypatch):
    """Install a marker around `engine.pic.fused.fused_prefill` that tells the active
    `Ops` recorder (set on the fixture's list) when the pass runs."""
    active: list[Ops] = []
    real = fused_mod.fused_prefill

    def marked(*args, **kw):
        for rec in active:
            rec.in_fused += 1
        try:
            return real(*args, **kw)
        finally:
            for rec in active:
                rec.in_fused -= 1

    monkeypatch.setattr(fused_mod, "fused_prefill", marked)
    return active


def _forget_prefixes(daemon) -> None:
    """Delete every exact-prefix checkpoint object from the daemon."""
    with daemon.client() as kv:
        keys = [r.key for r in kv.list() if r.meta.extra.get("kind") == OBJECT_KIND]
        if keys:
            kv.delete(keys)


def test_an_exact_repeat_costs_pic_no_more_host_work_than_prefix_caching(start_daemon, fused_marked):
    d = start_daemon()
    engine = new_engine()
    conn = StoreConnectorConfig(socket=str(d.socket), rpc_timeout_s=5.0)
    planners = {"pic": attach_store(engine, PicConfig(cold_full_fraction=0.5), conn),
                "prefix": attach_store(engine, PicConfig(method="prefix"), conn)}
    layout = prompt(tuple(range(len(DOCS))))
    got = {}
    try:
        for method, planner in planners.items():
            engine.scheduler.planner = planner
            _forget_prefixes(d)  # each method restores what its own pass took
            run_one(engine, planner, layout, f"{method}-cold", ONE_TOKEN)
            while engine.help_idle():  # PIC: the cold fallback's misses, computed alone
                pass
            assert planner.store.flush(30.0)
            run_one(engine, planner, layout, f"{method}-warm", ONE_TOKEN)  # untimed: first use of each op
            ops = Ops()
            fused_marked.append(ops)
            rid = f"{method}-measured"
            with OwnCalls() as calls, ops:  # from arrival to the first (and last) token
                engine.add_request(layout, ONE_TOKEN, request_id=rid)
                out = None
                while out is None:
                    out = next((o for o in engine.step() if o.request_id == rid and o.finished), None)
            fused_marked.clear()
            got[method] = (out, planner.take_report(rid), planner.take_store_report(rid), ops, calls.calls)
    finally:
        for planner in planners.values():
            planner.store.close(timeout=10.0)

    (p_out, p_rep, p_sr, p_ops, p_calls), (q_out, q_rep, q_sr, q_ops, q_calls) = got["pic"], got["prefix"]
    # both restored the request's whole cacheable prefix from the engine's own tree
    assert p_sr.prefix_source == q_sr.prefix_source == "engine"
    assert p_rep.reused_tokens == q_rep.reused_tokens == p_sr.prefix_tokens > 0
    assert p_rep.recomputed_tokens == q_rep.recomputed_tokens == p_rep.prompt_tokens - p_sr.prefix_tokens
    assert p_out.token_ids == q_out.token_ids
    # the pass after the restore: op for op prefix caching's
    assert p_ops.fused and p_ops.fused == q_ops.fused
    # the whole request: no more ops dispatched
    assert len(p_ops.ops) <= len(q_ops.ops), Counter(p_ops.ops) - Counter(q_ops.ops)
    # and no more of the project's Python calls
    more = {k: p_calls[k] - q_calls[k] for k in p_calls if p_calls[k] > q_calls[k]}
    fewer = {k: q_calls[k] - p_calls[k] for k in q_calls if q_calls[k] > p_calls[k]}
    assert sum(p_calls.values()) <= sum(q_calls.values()), (
        f"PIC {sum(p_calls.values())} calls, prefix caching {sum(q_calls.values())}; PIC's extra {more}; "
        f"prefix caching's extra {fewer}")
