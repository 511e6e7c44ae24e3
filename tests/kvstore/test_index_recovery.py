"""A damaged or missing LMDB index loses no object: the real daemon, real files, real LMDB.

data.mdb truncated to 0 bytes, to half, and while the daemon runs; the whole index
removed after a kill -9; `--index-recovery refuse` and `kvstore repair --dir D`; a
dropped object's file is not brought back by a crash before its last reader let go.
Each test counts the objects it checks byte for byte and asserts none is lost.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from kvstore.testing import REPO_ROOT, DaemonProcess, record_figures

N = 12
FIGURES: Counter[str] = Counter()


def figures(**counts: int) -> None:
    """Add this test's counts to the module's and report the totals (docs/RELIABILITY.md)."""
    FIGURES.update(counts)
    record_figures("test_index_recovery", **FIGURES)


def blob(i: int, size: int = 5000 + 37) -> bytes:
    seed = hashlib.sha256(str(i).encode()).digest()
    return (seed * (size // len(seed) + 1))[: size + i]


def put_all(d: DaemonProcess, keys: range) -> None:
    with d.client() as kv:
        for i in keys:
            kv.put(f"obj/{i}".encode(), blob(i), tier="nvme")


def check_all(d: DaemonProcess, keys: range) -> int:
    """Every key served with exactly its bytes; returns how many were checked."""
    with d.client() as kv:
        for i in keys:
            view = kv.get(f"obj/{i}".encode(), promote=False)
            assert view is not None, f"obj/{i} was lost"
            with view:
                assert view.tobytes() == blob(i), f"obj/{i} served wrong bytes"
    return len(keys)


def object_files(d: DaemonProcess) -> list[Path]:
    return sorted(p for p in (d.dir / "objects").glob("??/*.obj"))


def data_mdb(d: DaemonProcess) -> Path:
    return d.dir / "index.lmdb" / "data.mdb"


def test_index_truncated_while_stopped_to_0_then_to_half_is_rebuilt_from_the_files(start_daemon):
    d = start_daemon()
    put_all(d, range(N))
    files = object_files(d)
    assert len(files) == N
    for fraction in (0.0, 0.5):
        assert d.stop() == 0
        os.truncate(data_mdb(d), int(data_mdb(d).stat().st_size * fraction))
        d.start()  # no SIGBUS: the file is checked against its meta pages before LMDB maps it
        assert check_all(d, range(N)) == N
        assert object_files(d) == files  # nothing deleted
        with d.client() as kv:
            st = kv.stats()
        assert st["index_rebuilds"] == 1 and st["recovered_objects"] == N, fraction
    assert len(list(d.dir.glob("index.lmdb.damaged-*"))) == 2, "damaged indexes are moved aside, not deleted"
    figures(operations=N + 2, objects_verified=2 * N, losses=0, restarts=2, index_rebuilds=2)
    log = d.log_path.read_text()
    assert "no valid LMDB meta page" in log and "(truncated)" in log


def test_index_truncated_while_running_or_removed_after_a_kill_loses_nothing(start_daemon):
    d = start_daemon()
    put_all(d, range(N))
    os.truncate(data_mdb(d), data_mdb(d).stat().st_size // 2)
    put_all(d, range(N, 2 * N))  # the next index write finds the damage before LMDB touches it
    assert d.proc is not None and d.proc.poll() is None, "the daemon died (SIGBUS?)"
    assert check_all(d, range(2 * N)) == 2 * N
    assert "shrank" in d.log_path.read_text()
    d.kill()
    d.start()
    assert check_all(d, range(2 * N)) == 2 * N
    d.kill()
    shutil.rmtree(d.dir / "index.lmdb")
    d.start()
    assert check_all(d, range(2 * N)) == 2 * N
    with d.client() as kv:
        assert kv.stats()["recovered_from_files"] == 2 * N
    figures(operations=2 * N + 3, objects_verified=3 * 2 * N, losses=0, kills=2, index_rebuilds=2)


def _repair(d: DaemonProcess) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "KVSTORE_CONFIG": os.devnull}
    return subprocess.run([sys.executable, "-m", "kvstore.cli", "repair", "--dir", str(d.dir)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_refuse_mode_names_kvstore_repair_which_rebuilds_the_index(start_daemon):
    d = start_daemon(extra_args=["--index-recovery", "refuse"])
    put_all(d, range(N))
    done = _repair(d)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [f"kvstore: error: cache directory {d.dir} is in use by a running "
                                                f"daemon; stop it first"]
    d.stop()
    os.truncate(data_mdb(d), data_mdb(d).stat().st_size // 2)
    with pytest.raises(RuntimeError) as exc:
        d.start(timeout=60)
    errors = [ln for ln in str(exc.value).splitlines() if "kvstore: error:" in ln]
    assert len(errors) == 1 and f"kvstore repair --dir {d.dir}" in errors[0] and "truncated" in errors[0], exc.value
    assert len(object_files(d)) == N
    done = _repair(d)
    assert done.returncode == 0, done.stderr
    assert f"{N} objects" in done.stdout and "old index is at" in done.stdout
    d.start()
    assert check_all(d, range(N)) == N
    figures(operations=N + 2, objects_verified=N, losses=0, index_rebuilds=1)


DROP_WHILE_READ = """
import os, signal, sys, threading, time
from pathlib import Path
sys.path.insert(0, {testdir!r})
from kvstore.store import Store
from kvstore.tiers.faulty import FaultyTier
from storeutil import get_bytes, make_settings, put
settings = make_settings(Path({root!r}), shm_name={shm!r})
with Store(settings) as s:
    put(s, b"gone", b"g" * 9000, "nvme")
    put(s, b"kept", b"k" * 9000, "nvme")
slow = lambda t: FaultyTier(t, delay_s=2.0) if t.name == "nvme" else t
s = Store(settings, wrap_tier=slow)
s.open()
threading.Thread(target=get_bytes, args=(s, b"gone"), kwargs=dict(promote=False), daemon=True).start()
time.sleep(0.5)  # the get is verifying "gone" outside the lock: the object is pinned
assert s.delete([b"gone"]) == 1
os.kill(os.getpid(), signal.SIGKILL)  # before the verify ends and frees the file
"""


def test_a_dropped_object_still_pinned_at_a_crash_does_not_come_back(tmp_path):
    from kvstore.store import Store

    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from storeutil import get_bytes, make_settings
    finally:
        sys.path.pop(0)
    settings = make_settings(tmp_path)
    script = DROP_WHILE_READ.format(testdir=str(Path(__file__).parent), root=str(tmp_path), shm=settings.shm_name)
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert len(list((settings.dir / "objects").glob("??/*.obj"))) == 2  # the dropped file outlived the crash
    with Store(settings) as s:
        assert [e.hit for e in s.lookup([b"gone", b"kept"])] == [False, True]
        assert get_bytes(s, b"kept") == b"k" * 9000
        st = s.stats()
        assert st["orphans_removed"] == 1 and st["recovered_from_files"] == 0
    assert len(list((settings.dir / "objects").glob("??/*.obj"))) == 1
    figures(operations=3, objects_verified=1, losses=0, kills=1, resurrected=0)
