"""The SegmentStore contract (engine.pic.segment_store), one suite over three stores: the
in-process one, the daemon-backed one over a REAL kvstore daemon (subprocess, socket,
shared-memory arena), and a dict-backed fake. It pins the call order the planner makes,
lookup/publish/take round trips, claims of one missing segment by two requests, finish
releasing what a request holds, idle jobs, and a backend that goes away."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch

from engine.connector.config import StoreConnectorConfig
from engine.connector.daemon_store import DaemonSegmentStore
from engine.connector.store_cache import StoreSignatureCache
from engine.models.config import FULL, GDN
from engine.models.weights import build_model
from engine.pic.compute import compute_signature
from engine.pic.config import PicConfig
from engine.pic.planner import make_planner
from engine.pic.segment_store import InProcessSegmentStore, SegmentJob, SegmentStore
from engine.pic.signature_cache import InMemorySignatureCache, segment_key, signature_variant
from fake_segment_store import DictSegmentStore, RecordingStore
from kvstore.testing import DaemonProcess
from pic_testlib import BOS, FakeTokenizer, execute, make_request, pic_config, rand_ids

FP = "contract-model"
SPLIT = 4
KINDS = ("in_process", "daemon", "fake")


class CountingCache(InMemorySignatureCache):
    """An in-process cache that counts what `get` handed out and `release` gave back."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.outstanding = 0

    def get(self, key):
        sig = super().get(key)
        self.outstanding += sig is not None
        return sig

    def release(self, key) -> None:
        self.outstanding -= 1


class Stores:
    """Makes stores of one kind and answers what the contract asks of each kind. Daemon
    stores share one daemon per module (`shared`) unless a test asks for its own."""

    def __init__(self, kind: str, tmp_path: Path, shared: Callable[[], DaemonProcess]) -> None:
        self.kind = kind
        self.tmp_path = tmp_path
        self._daemon = shared
        self.daemons: dict[int, DaemonProcess] = {}  # id(store) -> its daemon
        self.own: list[DaemonProcess] = []
        self.made: list[SegmentStore] = []
        self._shared: Optional[SegmentStore] = None

    @property
    def dedups(self) -> bool:
        """Two engines see each other's segments and claims (one computes)."""
        return self.kind == "daemon"

    def new(self, own_daemon: bool = False, **connector) -> SegmentStore:
        """A store as a new engine would have it (the in-process and fake stores: one per
        process, so the same one)."""
        if self.kind == "daemon":
            if own_daemon:
                d = DaemonProcess(self.tmp_path / f"own{len(self.own)}", entry="kvstore.server").start()
                self.own.append(d)
            else:
                d = self._daemon()
            kw = dict(socket=str(d.socket), rpc_timeout_s=5.0, reconnect_min_s=0.05, reconnect_max_s=0.2)
            kw.update(connector)
            store = DaemonSegmentStore(StoreSignatureCache(FP, "cpu", StoreConnectorConfig(**kw)), anchor_tokens=1)
            self.made.append(store)
            self.daemons[id(store)] = d
            return store
        if self._shared is None:
            self._shared = InProcessSegmentStore(CountingCache(1 << 30)) if self.kind == "in_process" \
                else DictSegmentStore()
        return self._shared

    def settle(self, store: SegmentStore) -> None:
        """What was published is visible to lookups (SegmentStore.flush)."""
        assert store.flush()

    def outstanding(self, store: SegmentStore) -> int:
        """Signatures handed out and not released yet."""
        if self.kind == "daemon":
            with self.daemons[id(store)].client() as kv:
                return int(kv.stats()["leases"])
        if self.kind == "in_process":
            return store.cache.outstanding
        return store.outstanding()

    def lose_backend(self, store: SegmentStore) -> None:
        if self.kind == "in_process":
            pytest.skip("the in-process store has no backend to lose")
        if self.kind == "daemon":
            d = self.daemons[id(store)]
            assert d in self.own, "only a test's own daemon may be killed"
            d.kill()
        else:
            store.fail()

    def close(self) -> None:
        for s in self.made:
            s.close(timeout=10.0)
        for d in self.own:
            d.cleanup()


@pytest.fixture(scope="module")
def module_daemon(tmp_path_factory):
    """() -> the module's daemon, started on first use."""
    made: list[DaemonProcess] = []

    def get() -> DaemonProcess:
        if not made:
            made.append(DaemonProcess(tmp_path_factory.mktemp("daemon"), entry="kvstore.server").start())
        return made[0]

    yield get
    for d in made:
        d.cleanup()


@pytest.fixture(params=KINDS)
def stores(request, tmp_path, module_daemon):
    s = Stores(request.param, tmp_path, module_daemon)
    yield s
    s.close()


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_model(pic_config((GDN, FULL)), "cpu", torch.float32, seed=0)


def job_of(ids: list[int]) -> SegmentJob:
    return SegmentJob(segment_key(FP, ids, signature_variant([BOS], SPLIT)), tuple(ids), SPLIT, float(1 + len(ids)))


def computer(model, calls: Optional[list] = None) -> Callable:
    def compute(jobs):
        if calls is not None:
            calls.append([j.key for j in jobs])
        return [compute_signature(model, list(j.token_ids), [BOS], j.split) for j in jobs]
    return compute


def same(a, b) -> bool:
    ta, ma, _ = a.to_tensors()
    tb, mb, _ = b.to_tensors()
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def signatures_of(store: SegmentStore, request_id: str, keys: list[bytes]) -> dict:
    """As the planner asks: admit, lookup, then take what lookup deferred (all hits)."""
    store.admit(request_id, keys)
    hits = store.lookup(request_id, keys)
    assert set(hits) == set(keys)
    taken = store.take(request_id, keys)
    assert set(taken) == {k for k, sig in hits.items() if sig is None}  # exactly the deferred ones
    return {k: hits[k] if hits[k] is not None else taken[k] for k in keys}


def test_a_miss_is_claimed_computed_published_and_then_hits_with_the_same_bytes(stores, model):
    store = stores.new()
    job = job_of(rand_ids(24, 1))
    assert store.lookup("r1", [job.key]) == {}
    calls: list = []
    (filled,) = store.claim("r1", [job], computer(model, calls))
    assert filled.key == job.key and filled.computed and calls == [[job.key]]
    store.finish("r1", done=True)
    stores.settle(store)
    got = signatures_of(store, "r2", [job.key])[job.key]
    assert got is not None and same(got, filled.signature)
    store.finish("r2", done=True)


def test_lookup_answers_exactly_the_hits(stores, model):
    store = stores.new()
    a, b = job_of(rand_ids(20, 2)), job_of(rand_ids(20, 3))
    store.publish(a.key, computer(model)([a])[0], a.cost)
    stores.settle(store)
    assert set(store.lookup("r", [a.key, b.key])) == {a.key}
    store.finish("r", done=False)


def test_two_requests_missing_one_segment_get_the_same_signature_and_at_most_one_computes_where_shared(
        stores, model):
    first, second = stores.new(), stores.new(inflight_wait_s=30.0)
    job = job_of(rand_ids(32, 4))
    assert first.lookup("a", [job.key]) == {} and second.lookup("b", [job.key]) == {}
    computing, go = threading.Event(), threading.Event()
    slow_calls: list = []

    def slow(jobs):
        computing.set()
        assert go.wait(30)
        return computer(model, slow_calls)(jobs)

    got: dict = {}
    t = threading.Thread(target=lambda: got.setdefault("a", first.claim("a", [job], slow)[0]))
    t.start()
    assert computing.wait(30)
    other_calls: list = []
    if stores.dedups:  # another engine: it finds the claim and waits for the result
        w = threading.Thread(
            target=lambda: got.setdefault("b", second.claim("b", [job], computer(model, other_calls))[0]))
        w.start()
        go.set()
        t.join(60)
        w.join(60)
    else:  # one engine: its requests claim in turn
        go.set()
        t.join(60)
        got["b"] = second.claim("b", [job], computer(model, other_calls))[0]
    a, b = got["a"], got["b"]
    assert a.computed and slow_calls == [[job.key]]
    assert same(a.signature, b.signature)
    if stores.dedups:
        assert not b.computed and other_calls == []
    else:
        assert b.computed == bool(other_calls)
    first.finish("a", done=True)
    second.finish("b", done=True)


def test_finish_releases_everything_a_request_holds_and_is_idempotent(stores, model):
    store = stores.new()
    jobs = [job_of(rand_ids(16, 10 + i)) for i in range(3)]
    for j, sig in zip(jobs, computer(model)(jobs)):
        store.publish(j.key, sig, j.cost)
    stores.settle(store)
    got = signatures_of(store, "r", [j.key for j in jobs])
    assert all(sig is not None for sig in got.values())
    assert stores.outstanding(store) == 3
    store.finish("r", done=True)
    assert stores.outstanding(store) == 0
    store.take_report("r")  # a store's own report, if it keeps one, is returned once
    store.finish("r", done=True)
    store.finish("r", done=False)
    assert stores.outstanding(store) == 0 and store.take_report("r") is None


def test_idle_jobs_are_claimed_published_and_a_released_batch_can_be_claimed_again(stores, model):
    store = stores.new()
    jobs = [job_of(rand_ids(12, 20 + i)) for i in range(2)]
    claimed = store.claim_jobs(jobs)
    assert [c.job.key for c in claimed] == [j.key for j in jobs]
    store.release_jobs(claimed, "stopped")
    again = store.claim_jobs(jobs)
    assert [c.job.key for c in again] == [j.key for j in jobs]
    store.publish_jobs(again, computer(model)([c.job for c in again]))
    stores.settle(store)
    assert store.claim_jobs(jobs) == []  # held now: nothing to compute
    assert set(store.lookup("r", [j.key for j in jobs])) == {j.key for j in jobs}
    store.finish("r", done=False)


def test_a_backend_that_goes_away_turns_lookups_into_misses_without_raising(stores, model):
    store = stores.new(own_daemon=True, rpc_timeout_s=1.0, load_timeout_s=5.0) if stores.kind == "daemon" \
        else stores.new()
    job = job_of(rand_ids(16, 30))
    store.publish(job.key, computer(model)([job])[0], job.cost)
    stores.settle(store)
    stores.lose_backend(store)
    assert store.lookup("r", [job.key]) == {}
    calls: list = []
    (filled,) = store.claim("r", [job], computer(model, calls))
    assert filled.computed and calls == [[job.key]]  # served by recomputation
    store.publish(job.key, filled.signature, job.cost, "r")
    assert isinstance(store.claim_jobs([job]), list)
    store.finish("r", done=True)


@pytest.mark.parametrize("fused", [True, False])
def test_the_planner_calls_the_store_in_the_documented_order(stores, model, make_runner, fused):
    """admit, lookup, claim (only with misses; miss_path="alone": misses computed alone
    through the store), take before splicing (then layer_hook when the fused pass
    follows), finish; a warm request hits every segment and computes the same logits as
    the cold one."""
    rec = RecordingStore(stores.new())
    cfg = PicConfig(method="pic", seam=SPLIT, fused=fused, miss_path="alone")
    planner = make_planner(cfg, model, FP, FakeTokenizer(), store=rec)
    runner = make_runner(model, num_blocks=256)
    seed = 40 if fused else 50  # the module's daemon keeps what other tests stored
    docs = [rand_ids(20, seed), rand_ids(24, seed + 1)]
    segs = [(docs[0], True), (docs[1], True), (rand_ids(6, seed + 2), False)]
    cold = make_request(segs)
    out_cold = execute(planner, runner, cold)
    names = [n for n, r in rec.calls if r == cold.request_id]
    assert names[:3] == ["admit", "lookup", "claim"] and names[-1] == "finish"
    assert set(names[3:-1]) <= {"take", "layer_hook"} and "take" in names
    # the fused pass asks for its per-layer hook right after its (layered) take
    assert ("layer_hook" in names) == fused and names[-2] == ("layer_hook" if fused else "take")
    assert planner.take_report(cold.request_id).miss_segments == 2
    runner.cache.free(cold.seq)
    stores.settle(rec.inner)
    rec.calls.clear()
    warm = make_request(segs)
    out_warm = execute(planner, runner, warm)
    names = [n for n, r in rec.calls if r == warm.request_id]
    assert names[:2] == ["admit", "lookup"] and "claim" not in names and names[-1] == "finish"
    rep = planner.take_report(warm.request_id)
    assert rep.hit_segments == 2 and rep.miss_segments == 0
    torch.testing.assert_close(out_warm.logits[-1], out_cold.logits[-1], rtol=0, atol=1e-5)
    runner.cache.free(warm.seq)
    planner.on_request_freed(warm)
    assert stores.outstanding(rec.inner) == 0
