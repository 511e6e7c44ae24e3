"""The remote adapter's calls (kvstore.remote.base) on real in-process Stores over the
in-memory remote store: closing is bounded; a call runs inline only when the adapter
bounds its own calls within the timeout, a call whose wait runs out is pending and its late
result comes once, a client timeout is counted and fails fast until it reconnects; the
one-object calls answer what the batched calls would, and a store's fill and write of one
object take them; a trailer's meta is read as the declared types."""
from __future__ import annotations

import os
import time

import pytest
import torch

from kvstore.errors import BadObject, InvalidRequest
from kvstore.records import ObjectMeta
from kvstore.remote.base import NOT_FOUND
from kvstore.remote.envelope import verify_object
from kvstore.remote.faulty import FaultyAdapter, RemoteFaults
from kvstore.remote.memory import MemoryAdapter, MemoryRemote
from kvstore.store import Store

from storeutil import PAGE, get_bytes, make_settings, put
from test_remote_tier import _drain, _remote_stats
from test_store import data


def test_closing_an_adapter_is_bounded_and_fails_the_tasks_it_never_ran():
    a = FaultyAdapter(MemoryAdapter(), RemoteFaults(delay_s=0.3), workers=1)
    a.close_wait_s = 1.0
    tids = [a.submit_stat(["x"]) for _ in range(3)]
    got = []
    a.add_done_callback(tids[2], got.append)
    t0 = time.monotonic()
    a.close()
    assert time.monotonic() - t0 < 1.5
    first = a.wait(tids[0], 5)
    assert first.codes == (NOT_FOUND,)  # it was running: it finished
    assert got and not got[0].ok and "closed" in got[0].error  # it never ran: failed, delivered once


class _InlineAdapter(MemoryAdapter):
    """A MemoryAdapter whose client "bounds its own calls" (inline_bound_s), recording the
    thread each blocking call ran on; `stat_codes` (when set) is what stat answers."""

    inline_bound_s = 0.5

    def __init__(self, remote=None):
        super().__init__(remote)
        self.threads: list[str] = []
        self.stat_codes = None

    def stat_now(self, names):
        import threading

        self.threads.append(threading.current_thread().name)
        return list(self.stat_codes) if self.stat_codes is not None else super().stat_now(names)


def test_call_runs_inline_only_when_the_adapter_bounds_its_calls_within_the_timeout():
    import threading

    a = _InlineAdapter()
    try:
        res = a.call("stat", ["x"], timeout_s=1.0)  # bound 0.5 <= 1.0: on this thread
        assert res.codes == (NOT_FOUND,) and res.ok and not res.pending
        assert a.threads[-1] == threading.current_thread().name
        res = a.call("stat", ["x"], timeout_s=0.2)  # bound above the timeout: a worker and a bounded wait
        assert res.codes == (NOT_FOUND,) and a.threads[-1].startswith("kvstore-remote")
        with pytest.raises(InvalidRequest, match="unknown remote operation"):
            a.call("scan", [], 1.0)
    finally:
        a.close()


def test_a_call_whose_wait_runs_out_is_pending_and_its_late_result_comes_once():
    from kvstore.remote.base import TIMED_OUT

    a = FaultyAdapter(MemoryAdapter(), RemoteFaults(delay_s=0.3))
    try:
        late = []
        t0 = time.monotonic()
        res = a.call("stat", ["x", "y"], timeout_s=0.05, late=late.append)
        assert time.monotonic() - t0 < 0.25  # bounded by the timeout, not the 0.3 s call
        assert res.pending and res.timed_out and not res.ok and res.codes == (TIMED_OUT, TIMED_OUT)
        deadline = time.monotonic() + 5
        while not late and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert len(late) == 1 and late[0].codes == (NOT_FOUND, NOT_FOUND) and not late[0].pending
    finally:
        a.close()


def test_a_client_timeout_inline_is_counted_fails_fast_after_and_reconnects(tmp_path):
    from kvstore.remote.base import TIMED_OUT

    remote = MemoryRemote()
    a = _InlineAdapter(remote)
    s = Store(make_settings(tmp_path, remote_timeout_s=1.0), remote_adapter=a)
    s.open()
    try:
        a.stat_codes = [TIMED_OUT]  # the client's own RPC timeout (a hung master), answered inline
        assert s.lookup([b"k"])[0].hit is False
        r = _remote_stats(s)
        assert r["timeouts"] == 1 and r["errors"] >= 1 and r["reachable"] is False
        calls = len(a.threads)
        assert s.lookup([b"k2"])[0].hit is False  # known unreachable: no call at all
        assert len(a.threads) == calls and _remote_stats(s)["lookups_skipped_unreachable"] == 1
        a.stat_codes = None
        deadline = time.monotonic() + 5
        while not a.reachable() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert a.reachable() and a.stats()["reconnects"] == 1
    finally:
        s.close()


class _Recorder(_InlineAdapter):
    """An inline adapter recording the thread of every get/put; `boom` makes them raise."""

    boom = False

    def get_now(self, items):
        import threading

        self.threads.append(threading.current_thread().name)
        if self.boom:
            raise OSError("client exploded")
        return super().get_now(items)

    def put_now(self, items):
        import threading

        self.threads.append(threading.current_thread().name)
        if self.boom:
            raise OSError("client exploded")
        return super().put_now(items)


def test_one_object_calls_answer_the_code_call_would_inline_and_through_a_worker():
    import threading

    from kvstore.remote.base import FAILED, PENDING, UNREACHABLE

    src = torch.frombuffer(bytearray(os.urandom(5000)), dtype=torch.uint8)
    dst = torch.zeros(5000, dtype=torch.uint8)
    a = _Recorder()
    try:
        assert a.put_one("o", src.data_ptr(), 5000, 1.0) == 5000  # inline: on this thread
        assert a.threads[-1] == threading.current_thread().name
        assert a.get_one("o", dst.data_ptr(), 5000, 1.0) == 5000 and torch.equal(src, dst)
        assert a.get_one("none", dst.data_ptr(), 5000, 1.0) == NOT_FOUND
        assert a.get_one("o", dst.data_ptr(), 4000, 1.0) == -600  # not the object's size: an error, no bytes
        assert a.get_one("o", dst.data_ptr(), 5000, 0.2) == 5000  # bound above the timeout: a worker
        assert a.threads[-1].startswith("kvstore-remote")
        a.boom = True  # a client that raises: FAILED, as `call` reports it
        assert a.get_one("o", dst.data_ptr(), 5000, 1.0) == FAILED and a.put_one("o", src.data_ptr(), 9, 1.0) == FAILED
        assert a.reachable()
    finally:
        a.close()
    down = FaultyAdapter(MemoryAdapter(), RemoteFaults(down=True))
    down.inline_bound_s = 0.5
    try:  # an unreachable store: UNREACHABLE, marked so, then failed fast without a call
        assert down.get_one("o", dst.data_ptr(), 5000, 1.0) == UNREACHABLE and not down.reachable()
        assert down.put_one("o", src.data_ptr(), 5000, 1.0) == UNREACHABLE
        assert down.injected["unreachable"] == 1 and down.stats()["unreachable_fast_fails"] == 1
    finally:
        down.close()
    slow = FaultyAdapter(MemoryAdapter(), RemoteFaults(delay_s=0.3))
    try:  # a wait that runs out: PENDING at once, the real result to `late` once, the buffer the get's till then
        assert slow.put_one("o", src.data_ptr(), 5000, 5.0) == 5000
        late = []
        dst.zero_()
        t0 = time.monotonic()
        assert slow.get_one("o", dst.data_ptr(), 5000, 0.05, None, late.append) == PENDING
        assert time.monotonic() - t0 < 0.25 and not late
        deadline = time.monotonic() + 5
        while not late and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        assert len(late) == 1 and late[0].codes == (5000,) and torch.equal(src, dst)
    finally:
        slow.close()


def test_a_fill_and_a_write_of_one_object_take_the_one_object_calls(tmp_path):
    calls = []

    class Counting(MemoryAdapter):
        def get_one(self, *a, **kw):
            calls.append("get_one")
            return super().get_one(*a, **kw)

        def put_one(self, *a, **kw):
            calls.append("put_one")
            return super().put_one(*a, **kw)

        def call(self, op, batch, timeout_s, late=None):
            calls.append(op)
            return super().call(op, batch, timeout_s, late)

    remote = MemoryRemote()
    s1 = Store(make_settings(tmp_path / "h1", remote_timeout_s=1.0), remote_adapter=Counting(remote))
    s2 = Store(make_settings(tmp_path / "h2", remote_timeout_s=1.0), remote_adapter=Counting(remote))
    s1.open()
    s2.open()
    try:
        body = data(2 * PAGE, 11)
        put(s1, b"one", body)
        _drain(s1)
        assert calls.count("put_one") == 1 and "put" in calls  # put_one's default goes through call
        calls.clear()
        assert get_bytes(s2, b"one") == body
        assert calls[:2] == ["stat", "get_one"]
        r = _remote_stats(s2)
        assert r["hits"] == 1 and r["get_latency"]["count"] == 1 and r["get_latency"]["p50_s"] > 0
        assert _remote_stats(s1)["put_latency"]["count"] == 1 and _remote_stats(s1)["objects_written"] == 1
    finally:
        s1.close()
        s2.close()


def test_a_meta_of_other_types_than_the_encoder_writes_is_read_as_the_declared_types():
    import msgpack
    import xxhash

    from kvstore.remote import envelope

    payload = os.urandom(100)
    xsum = xxhash.xxh3_64_intdigest(payload)
    odd = msgpack.packb({"f": "fp", "t": True, "c": 2, "x": {}}, use_bin_type=True)  # a bool count, an int cost
    head = b"k" + odd + envelope._FOOTER.pack(envelope.MAGIC, envelope.VERSION, 1, len(odd), 0, 100, xsum, xsum)
    obj = payload + head + envelope._SUM.pack(xxhash.xxh3_64_intdigest(head))
    h = verify_object(memoryview(obj), b"k")
    assert h.meta == ObjectMeta("fp", 1, 2.0, {}) and type(h.meta.token_count) is int
    assert type(h.meta.cost) is float
    bad = msgpack.packb({"f": "fp", "t": "many", "c": 0.0, "x": {}}, use_bin_type=True)
    head = b"k" + bad + envelope._FOOTER.pack(envelope.MAGIC, envelope.VERSION, 1, len(bad), 0, 100, xsum, xsum)
    with pytest.raises(BadObject, match="undecodable meta"):
        verify_object(memoryview(payload + head + envelope._SUM.pack(xxhash.xxh3_64_intdigest(head))), b"k")
