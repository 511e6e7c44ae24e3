"""kvstore.writeback on a real in-process Store (real shared-memory arena, real files, real
LMDB): the CPU tier's unbacked bytes are written back down to the watermark, coldest
first, outside the store's lock; demoting a backed object then writes nothing; backed
objects survive a restart; a failed or overtaken copy changes nothing and leaks nothing."""
from __future__ import annotations

import os
import threading
import time

import pytest

from kvstore.config import ConfigError, load_config
from kvstore.errors import InvalidRequest
from kvstore.store import Store
from kvstore.tiers.faulty import FaultyTier

from storeutil import PAGE, gate_copies, make_settings, put, read_region
from test_store import data


def _store(tmp_path, watermark=0.5, thread=False, **kw):
    s = Store(make_settings(tmp_path, cpu_capacity=8 * PAGE, writeback_watermark=watermark, **kw),
              wrap_tier=FaultyTier)
    s.open()
    if not thread:
        s._writeback.stop()  # rounds run only when the test calls run_once
    return s


def _backed(s, key):
    return s._place.objects[key].backing is not None


def _hold_a_write_back(s, entered):
    """Six pages in a tier whose watermark is four, and a write-back round started and
    held in its first copy (`gate_copies`); returns its thread."""
    for i in range(6):
        put(s, bytes([97 + i]), data(PAGE, i))
    mover = threading.Thread(target=s._writeback.run_once)
    mover.start()
    assert entered.wait(30)
    return mover


def _nvme_files(s):
    return sorted(p for p in (s.dir / "objects").rglob("*") if p.is_file())


def test_the_coldest_unbacked_objects_are_written_back_down_to_the_watermark(tmp_path):
    s = _store(tmp_path)
    try:
        for i in range(6):  # 6 pages unbacked, watermark 4 pages
            put(s, bytes([97 + i]), data(PAGE, i))
        assert s._writeback.run_once() == 2
        assert [_backed(s, bytes([97 + i])) for i in range(6)] == [True, True, False, False, False, False]  # LRU
        assert s._writeback.run_once() == 0  # at the watermark
        st = s.stats()
        assert st["writebacks"] == 2 and st["writeback_bytes"] == 2 * PAGE and st["writeback_failures"] == 0
        nvme = next(t for t in st["tiers"] if t["name"] == "nvme")
        assert nvme["backing_copies"] == 2 and nvme["used_bytes"] == 2 * PAGE
        assert [e.tier for e in s.lookup([b"a", b"b"])] == ["cpu", "cpu"]  # still served from memory
    finally:
        s.close()


def test_demoting_a_backed_object_writes_nothing(tmp_path):
    s = _store(tmp_path)
    try:
        for i in range(8):  # the CPU tier is full
            put(s, bytes([97 + i]), data(PAGE, i))
        assert s._writeback.run_once() == 4
        leases = s.get([bytes([97 + i]) for i in range(4)], "c", promote=False)  # a-d (backed) now the most recent
        s.release([x.lease_id for x in leases])
        s.tiers["nvme"].fail("write_from", times=10)  # any write now would fail
        for i in range(8, 11):
            put(s, bytes([97 + i]), data(PAGE, i))  # each needs a victim: a backed one, though LRU says e-h
        st = s.stats()
        assert st["demotions"] == 3 and st["evictions"] == 0 and s.tiers["nvme"].injected["write_from"] == 0
        assert [e.tier for e in s.lookup([b"e", b"f", b"g", b"h"])] == ["cpu"] * 4
        for i in range(3):  # the demoted ones, served from their former backing copy
            (lease,) = s.get([bytes([97 + i])], "c", promote=False)
            assert lease.tier == "nvme" and read_region(lease.region) == data(PAGE, i)
            s.release([lease.lease_id])
    finally:
        s.close()


def test_backed_objects_survive_a_restart_and_unbacked_ones_do_not(tmp_path):
    s = _store(tmp_path)
    for i in range(6):
        put(s, bytes([97 + i]), data(PAGE, i))
    s._writeback.run_once()
    s.close()
    s = _store(tmp_path)
    try:
        assert [e.hit for e in s.lookup([bytes([97 + i]) for i in range(6)])] == [True, True] + [False] * 4
        (lease,) = s.get([b"b"], "c", promote=False)
        assert lease.tier == "nvme" and read_region(lease.region) == data(PAGE, 1)
        s.release([lease.lease_id])
    finally:
        s.close()


def test_a_failed_write_back_is_counted_and_leaks_nothing(tmp_path):
    s = _store(tmp_path)
    try:
        for i in range(6):
            put(s, bytes([97 + i]), data(PAGE, i))
        s.tiers["nvme"].fail("write_from", times=2)
        assert s._writeback.run_once() == 0
        st = s.stats()
        assert st["writeback_failures"] == 2 and st["writebacks"] == 0
        assert s.tiers["nvme"].used_bytes == 0 and _nvme_files(s) == []
        assert not _backed(s, b"a") and [e.tier for e in s.lookup([b"a"])] == ["cpu"]
        assert s._writeback.run_once() == 2  # the next round succeeds
    finally:
        s.close()


def test_write_back_gives_up_on_an_object_after_repeated_failures_and_counts_each(tmp_path):
    from kvstore.writeback import MAX_ATTEMPTS

    s = _store(tmp_path)
    try:
        for i in range(5):  # 5 pages unbacked, watermark 4 pages: one copy tried per round
            put(s, bytes([97 + i]), data(PAGE, i))
        s.tiers["nvme"].fail("write_from", times=1000)
        assert [s._writeback.run_once() for _ in range(5 * MAX_ATTEMPTS + 5)] == [0] * (5 * MAX_ATTEMPTS + 5)
        st = s.stats()
        assert st["writeback_failures"] == 5 * MAX_ATTEMPTS and st["writeback_given_up"] == 5
        s._writeback.run_once()
        assert s.stats()["writeback_failures"] == 5 * MAX_ATTEMPTS  # not retried forever
        assert s.tiers["nvme"].used_bytes == 0 and _nvme_files(s) == []
        assert [e.tier for e in s.lookup([bytes([97 + i]) for i in range(5)])] == ["cpu"] * 5  # kept, not dropped
        s.tiers["nvme"].disarm()
        for i in range(5, 9):  # a full CPU tier still makes room by ordinary demotion to NVMe
            put(s, bytes([97 + i]), data(PAGE, i))
        assert s.stats()["demotions"] == 1 and s.lookup([b"a"])[0].tier == "nvme"
    finally:
        s.close()


def test_an_object_deleted_during_its_copy_leaves_no_file(tmp_path, monkeypatch):
    s = _store(tmp_path)
    real = s._place.copy

    def copy_then_delete(src, slot, dst, d):
        real(src, slot, dst, d)
        assert s.delete([b"a"]) == 1  # from outside the lock, as a client would

    monkeypatch.setattr(s._place, "copy", copy_then_delete)
    try:
        for i in range(5):
            put(s, bytes([97 + i]), data(PAGE, i))
        assert s._writeback.run_once() == 0
        assert s.tiers["nvme"].used_bytes == 0 and _nvme_files(s) == []
        assert s.tiers["cpu"].used_bytes == 4 * PAGE  # a's slot freed once unpinned
    finally:
        s.close()


def test_the_copy_runs_outside_the_lock(tmp_path, monkeypatch):
    s = _store(tmp_path)
    entered, go = gate_copies(s, monkeypatch)
    try:
        t = _hold_a_write_back(s, entered)
        got = []
        client = threading.Thread(target=lambda: got.append([e.hit for e in s.lookup([b"a", b"f"])]))
        client.start()
        client.join(5)  # a lookup is not blocked by the copy in progress
        assert not client.is_alive() and got == [[True, True]]
        go.set()
        t.join(30)
        assert s.stats()["writebacks"] >= 1
    finally:
        go.set()
        s.close()


def test_the_thread_keeps_up_by_itself_and_stops_with_the_store(tmp_path):
    s = _store(tmp_path, thread=True)
    try:
        for i in range(8):
            put(s, bytes([97 + i]), data(PAGE, i))
        deadline = time.monotonic() + 30
        while s.stats()["writebacks"] < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert s.stats()["writebacks"] == 4
    finally:
        s.close()
    assert s._writeback._thread is None


def test_the_watermark_is_validated():
    from pathlib import Path

    with pytest.raises(InvalidRequest, match="writeback_watermark"):
        make_settings(Path("/tmp/x"), writeback_watermark=1.5).validate()
    with pytest.raises(ConfigError, match="writeback-watermark|writeback_watermark"):
        load_config(env={"KVSTORE_WRITEBACK_WATERMARK": "2"}, config_file=os.devnull)
    assert load_config(env={}, config_file=os.devnull).writeback_watermark == 0.5


def test_evicting_a_tier_waits_for_a_write_back_in_progress(tmp_path, monkeypatch):
    s = _store(tmp_path)
    entered, go = gate_copies(s, monkeypatch)
    try:
        mover = _hold_a_write_back(s, entered)  # a (the coldest) is pinned by its copy now
        evicted = []
        evictor = threading.Thread(target=lambda: evicted.append(s.evict_tier("cpu")))
        evictor.start()
        time.sleep(0.2)
        go.set()
        mover.join(30)
        evictor.join(30)
        assert evicted and evicted[0] >= 6
        assert [e.tier for e in s.lookup([bytes([97 + i]) for i in range(6)])] == ["nvme"] * 6
    finally:
        go.set()
        s.close()
