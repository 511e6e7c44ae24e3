"""A demotion that writes a victim to NVMe does its disk write outside the store's lock
(kvstore.placement.Placement.demote), on a real in-process Store (shared-memory arena,
real files, real LMDB): other clients' lookups and gets complete while it is held; the
victim stays readable from its CPU copy until its NVMe copy is settled; a victim deleted
or leased meanwhile is handled; a process killed between the write and the settle (or
mid-write) loses nothing committed and serves no wrong bytes after a restart."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from kvstore.errors import StorageError
from kvstore.store import Store
from kvstore.testing import REPO_ROOT
from kvstore.tiers.faulty import FaultyTier

from storeutil import PAGE, gate_copies, get_bytes, make_settings, put, read_region
from test_store import data

KEYS = [bytes([97 + i]) for i in range(8)]  # a..h fill the CPU tier; a is the coldest


def _full_store(tmp_path, **kw):
    s = Store(make_settings(tmp_path, cpu_capacity=8 * PAGE, **kw))
    s.open()
    for i, k in enumerate(KEYS):
        put(s, k, data(PAGE, i))
    return s


def _start_put(s, key, payload):
    out: list = []
    t = threading.Thread(target=lambda: out.append(put(s, key, payload)))
    t.start()
    return t, out


def _in_thread(fn, timeout=5.0):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "blocked behind another client's demotion write"
    return out[0]


def test_lookups_and_gets_complete_while_a_demotion_write_is_held(tmp_path, monkeypatch):
    s = _full_store(tmp_path)
    entered, go = gate_copies(s, monkeypatch)
    try:
        putter, done = _start_put(s, b"z", data(PAGE, 99))  # needs room: demotes a (no NVMe copy yet)
        assert entered.wait(30)
        assert [e.tier for e in _in_thread(lambda: s.lookup([b"a", b"h", b"z"]))] == ["cpu", "cpu", None]
        assert _in_thread(lambda: get_bytes(s, b"a")) == data(PAGE, 0)  # the victim, from its CPU copy
        assert _in_thread(lambda: get_bytes(s, b"h")) == data(PAGE, 7)
        assert _in_thread(lambda: s.stats())["demotions"] == 0
        assert putter.is_alive()  # the put that needed the room waits for it
        go.set()
        putter.join(30)
        assert done and done[0].tier == "cpu"
        assert [e.tier for e in s.lookup([b"a", b"z"])] == ["nvme", "cpu"]
        assert s.stats()["demotions"] == 1 and s.stats()["evictions"] == 0
        assert get_bytes(s, b"a", promote=False) == data(PAGE, 0) and get_bytes(s, b"z") == data(PAGE, 99)
    finally:
        go.set()
        s.close()


def test_a_victim_deleted_during_its_demotion_write_leaves_nothing_behind(tmp_path, monkeypatch):
    s = _full_store(tmp_path)
    entered, go = gate_copies(s, monkeypatch)
    try:
        putter, done = _start_put(s, b"z", data(PAGE, 99))
        assert entered.wait(30)
        assert _in_thread(lambda: s.delete([b"a"])) == 1
        go.set()
        putter.join(30)
        assert done and done[0].tier == "cpu"
        assert s.lookup([b"a"])[0].hit is False
        assert s._index is not None and s._index.get(b"a") is None
        assert [p for p in (s.dir / "objects").rglob("*") if p.is_file()] == []  # the sealed copy was freed
        nvme = next(t for t in s.stats()["tiers"] if t["name"] == "nvme")
        assert nvme["used_bytes"] == 0 and nvme["objects"] == 0
    finally:
        go.set()
        s.close()


def test_a_victim_leased_during_its_demotion_write_stays_readable_with_a_backing_copy(tmp_path, monkeypatch):
    s = _full_store(tmp_path)
    entered, go = gate_copies(s, monkeypatch)
    try:
        putter, done = _start_put(s, b"z", data(PAGE, 99))
        assert entered.wait(30)
        (lease,) = _in_thread(lambda: s.get([b"a"], "reader"))
        go.set()
        putter.join(30)
        assert done and done[0].tier == "cpu"  # room came from another victim
        assert lease.tier == "cpu" and read_region(lease.region) == data(PAGE, 0)
        assert s.lookup([b"a"])[0].tier == "cpu" and s._place.objects[b"a"].backing is not None
        s.release([lease.lease_id])
        assert s.stats()["demotions"] == 1 and s.stats()["evictions"] == 0
    finally:
        go.set()
        s.close()


def test_a_failed_demotion_write_drops_the_victim_and_frees_its_nvme_file(tmp_path):
    s = Store(make_settings(tmp_path, cpu_capacity=8 * PAGE), wrap_tier=FaultyTier)
    s.open()
    try:
        for i, k in enumerate(KEYS):
            put(s, k, data(PAGE, i))
        s.tiers["nvme"].fail("seal")
        assert put(s, b"z", data(PAGE, 99)).tier == "cpu"
        assert s.lookup([b"a"])[0].hit is False  # dropped, as a failed demotion always was
        st = s.stats()
        assert st["evictions"] == 1 and st["demotions"] == 0
        assert [p for p in (s.dir / "objects").rglob("*") if p.is_file()] == []
        assert next(t for t in st["tiers"] if t["name"] == "nvme")["used_bytes"] == 0
    finally:
        s.close()


def test_a_store_closed_during_a_demotion_write_fails_the_waiting_put(tmp_path, monkeypatch):
    s = _full_store(tmp_path)
    entered, go = gate_copies(s, monkeypatch)
    errors: list = []

    def putter():
        try:
            put(s, b"z", data(PAGE, 99))
        except StorageError as exc:
            errors.append(exc)

    t = threading.Thread(target=putter)
    t.start()
    try:
        assert entered.wait(30)
        _in_thread(s.close)  # takes the lock the demotion released
        go.set()
        t.join(30)
        assert not t.is_alive() and errors and "closed" in str(errors[0])
    finally:
        go.set()
        s.close()


def test_concurrent_puts_needing_room_all_land(tmp_path, monkeypatch):
    s = _full_store(tmp_path)
    try:
        threads = [_start_put(s, bytes([b"A"[0] + i]), data(PAGE, 50 + i)) for i in range(6)]
        for t, done in threads:
            t.join(60)
            assert done and done[0].tier == "cpu"
        st = s.stats()
        assert st["demotions"] == 6 and st["evictions"] == 0
        assert sorted(e.tier for e in s.lookup(KEYS)) == ["cpu"] * 2 + ["nvme"] * 6
        for i in range(6):
            assert get_bytes(s, bytes([b"A"[0] + i]), promote=False) == data(PAGE, 50 + i)
        for i, k in enumerate(KEYS):
            assert get_bytes(s, k, promote=False) == data(PAGE, i)  # in the CPU tier or demoted to NVMe, intact
    finally:
        s.close()


_CRASH = textwrap.dedent("""
    import os, signal, sys
    sys.path[:0] = [{repo!r}, {tests!r}]
    from pathlib import Path
    from kvstore.placement import Placement
    from kvstore.store import Store
    from storeutil import PAGE, make_settings, put
    from test_store import data
    s = Store(make_settings(Path({root!r}), cpu_capacity=8 * PAGE, shm_name={shm!r}))
    s.open()
    for i in range(8):
        put(s, bytes([97 + i]), data(PAGE, i))
    real_write, real_copy = Placement.write_backing, Placement.copy
    def after_seal(self, job, quiet=False):  # killed between the sealed write and the settle
        real_write(self, job, quiet)
        os.kill(os.getpid(), signal.SIGKILL)
    def mid_write(self, src, s_, dst, d):  # killed with the .part file half written
        with open(d.path, "r+b") as f:
            f.write(src.view(s_)[: s_.size // 2].numpy().tobytes())
        os.kill(os.getpid(), signal.SIGKILL)
    if {when!r} == "after_seal":
        Placement.write_backing = after_seal
    else:
        Placement.copy = mid_write
    put(s, b"z", data(PAGE, 99))
""")


@pytest.mark.parametrize("when", ["after_seal", "mid_write"])
def test_a_crash_mid_demotion_loses_nothing_committed_and_serves_no_wrong_bytes(tmp_path, when):
    shm = f"kvstore-test-crash-{when}-{tmp_path.name[-8:]}"
    script = _CRASH.format(repo=str(REPO_ROOT), tests=str(Path(__file__).parent), root=str(tmp_path),
                           shm=shm, when=when)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == -9, r.stderr[-2000:]
    s = Store(make_settings(tmp_path, cpu_capacity=8 * PAGE, shm_name=shm))
    s.open()
    try:
        present = [o.key for o in s.list_objects()]
        if when == "after_seal":  # the sealed copy the index did not name yet is adopted from its header
            assert present == [b"a"] and s.stats()["recovered_from_files"] == 1
            assert get_bytes(s, b"a") == data(PAGE, 0)
        else:  # the half-written file is deleted, nothing is served from it
            assert present == []
            assert s.stats()["partial_writes_removed"] == 1
            assert not list((tmp_path / "cache" / "objects").rglob("*.obj"))
        assert s.lookup([b"z"])[0].hit is False  # the put never committed
    finally:
        s.close()
