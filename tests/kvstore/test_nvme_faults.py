"""The NVMe tier under operator accidents, with the real daemon: its working directory
removed, a full disk (a small tmpfs, mounted when the tests run as root), and keys at
the length limit the index (LMDB: 511 bytes) can hold."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess

import pytest

from kvstore.errors import CapacityExhausted, InvalidRequest, UnknownKey
from kvstore.testing import record_figures

MiB = 1 << 20


def blob(i: int, size: int) -> bytes:
    seed = hashlib.sha256(str(i).encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def test_removed_tmp_directory_is_recreated_and_puts_keep_working(start_daemon):
    d = start_daemon()
    with d.client() as kv:
        kv.put(b"tmp/before", blob(0, 10000), tier="nvme")
        shutil.rmtree(d.dir / "objects" / "tmp")
        kv.put(b"tmp/after", blob(1, 10000), tier="nvme")
        with kv.get(b"tmp/after", promote=False) as v:
            assert v.tobytes() == blob(1, 10000)
        shutil.rmtree(d.dir / "objects")  # the whole object directory, files and all
        kv.put(b"tmp/after-all", blob(2, 10000), tier="nvme")
        with pytest.raises(UnknownKey):  # its file was removed with the directory: a miss, not an error
            kv.get(b"tmp/after", promote=False)
        with kv.get(b"tmp/after-all", promote=False) as v:
            assert v.tobytes() == blob(2, 10000)
        nvme = next(t for t in kv.stats()["tiers"] if t["name"] == "nvme")
        assert nvme["tmp_recreated"] == 2
    assert (d.dir / "objects" / "tmp").stat().st_mode & 0o777 == 0o700
    record_figures("test_nvme_faults_tmp", operations=4, objects_verified=2, losses=0, directories_removed=2)


@pytest.fixture
def small_disk(tmp_path):
    """A 12 MiB tmpfs: a disk that fills up."""
    if os.geteuid() != 0:
        pytest.skip("a full disk needs a small tmpfs, and mounting one needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m,mode=0700", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_evicts_nvme_objects_and_gives_kvstore_errors_not_oserror(start_daemon, small_disk):
    # the configured capacity (256 MiB) is far over the disk (12 MiB): the real free space bounds the tier
    d = start_daemon(cpu_capacity="2MiB", nvme_capacity="256MiB")
    d.stop()
    d.args[d.args.index("--dir") + 1] = str(small_disk / "cache")
    d.dir = small_disk / "cache"
    d.start()
    n, size = 30, MiB
    with d.client() as kv:
        for i in range(n):  # 30 MiB of puts onto a 12 MiB disk: every put succeeds, older objects go
            kv.put(f"full/{i}".encode(), blob(i, size), tier="nvme")
        st = kv.stats()
        nvme = next(t for t in st["tiers"] if t["name"] == "nvme")
        assert st["evictions"] >= n - 12 and nvme["disk_full"] >= 1
        present = [i for i in range(n) if kv.lookup([f"full/{i}".encode()])[0].hit]
        assert present and n - 1 in present and len(present) <= 11
        for i in present:
            with kv.get(f"full/{i}".encode(), promote=False) as v:
                assert v.tobytes() == blob(i, size)
        with pytest.raises(CapacityExhausted, match="free now"):  # more than the whole disk
            kv.put(b"full/huge", blob(99, 16 * MiB), tier="nvme")
        kv.put(b"full/after", blob(100, size), tier="nvme")  # the tier still works
        record_figures("test_nvme_faults_disk", operations=n + 2, objects_verified=len(present), losses=0,
                       evictions=st["evictions"], disk_full=nvme["disk_full"], oserrors=0)
    assert d.proc is not None and d.proc.poll() is None
    d.stop()
    d.start()  # and restarts with what it had
    with d.client() as kv:
        with kv.get(b"full/after", promote=False) as v:
            assert v.tobytes() == blob(100, size)


def test_key_limit_agrees_across_tiers_and_config(start_daemon, tmp_path):
    d = start_daemon(cpu_capacity="1MiB")
    longest, over = b"k" * 511, b"k" * 512
    with d.client() as kv:
        assert kv.info.max_key_bytes == 511
        kv.put(longest, blob(1, 300 << 10), tier="nvme")
        kv.put(longest[:-1] + b"c", blob(2, 300 << 10), tier="cpu")
        for i in range(4):  # 1.2 MiB into a 1 MiB CPU tier: the long-keyed object is demoted, not dropped
            kv.put(f"fill/{i}".encode(), blob(10 + i, 300 << 10), tier="cpu")
        assert kv.lookup([longest[:-1] + b"c"])[0].tier == "nvme"
        st = kv.stats()
        assert st["demotions"] >= 1 and st["evictions"] == 0 and st["writeback_failures"] == 0
        for key, i in ((longest, 1), (longest[:-1] + b"c", 2)):
            with kv.get(key, promote=False) as v:
                assert v.tobytes() == blob(i, 300 << 10)
        with pytest.raises(InvalidRequest, match="over the limit of 511"):
            kv.put(over, b"x", tier="cpu")
        record_figures("test_nvme_faults_keys", operations=7, objects_verified=2, losses=0,
                       demotions=st["demotions"], refused_long_keys=1)
    from kvstore.testing import DaemonProcess

    bad = DaemonProcess(tmp_path / "bad", extra_args=["--max-key-bytes", "1024"])
    try:
        with pytest.raises(RuntimeError, match="max_key_bytes .* must be <= 511"):
            bad.start(timeout=60)
    finally:
        bad.cleanup()
