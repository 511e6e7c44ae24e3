"""No other local user, and no other client of the same user, reaches a client's cache.

The real daemon in a subprocess; a second local user (created with useradd when the
tests run as root, skipped with the reason otherwise) plants files and symlinks where
the old daemon put its arena and tries to open what the daemon made. Clients of one
user: readers map the arena read-only, lease and reservation ids are random and bound
to the client that took them, and `--verify-memory always` catches bytes changed in
shared memory after commit before they are served.
"""

from __future__ import annotations

import mmap
import os
import pwd
import shutil
import stat
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from kvstore.errors import UnknownKey
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.codec import region_from_pb
from kvstore.rpc.service import PROTOCOL_METADATA_KEY
from kvstore.testing import record_figures

OTHER_USER = "kvstore-other"
FIGURES: Counter[str] = Counter()  # what the client-isolation tests counted, for docs/RELIABILITY.md


@pytest.fixture(scope="module")
def other_user() -> tuple[int, int]:
    """(uid, gid) of a second local user (made with useradd when missing)."""
    if os.geteuid() != 0:
        pytest.skip("a second local user is needed: these tests create one with useradd, which needs root")
    try:
        pw = pwd.getpwnam(OTHER_USER)
    except KeyError:
        if shutil.which("useradd") is None:
            pytest.skip("useradd is not installed: cannot create a second local user")
        done = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/sh", OTHER_USER],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"useradd {OTHER_USER} failed: {done.stderr.strip()}")
        pw = pwd.getpwnam(OTHER_USER)
    return pw.pw_uid, pw.pw_gid


def as_user(user: tuple[int, int], script: str) -> subprocess.CompletedProcess:
    """Run a shell script as the other user (no supplementary groups)."""
    uid, gid = user
    return subprocess.run(["sh", "-c", script], user=uid, group=gid, extra_groups=[], capture_output=True,
                          text=True, timeout=60)


def test_files_and_symlinks_another_user_plants_under_the_arena_name_are_never_used(start_daemon, other_user,
                                                                                    tmp_path):
    from kvstore.testing import DaemonProcess

    d = DaemonProcess(tmp_path / "d")
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.chmod(tmp_path, 0o755)
    shm = Path("/dev/shm")
    planted = [shm / f"{d.shm_name}.arena", shm / f"{d.shm_name}.{'0' * 32}.arena"]
    link = shm / f"{d.shm_name}.{'1' * 32}.arena"
    done = as_user(other_user, f"umask 000; echo attacker > {planted[0]}; echo attacker > {planted[1]}; "
                               f"ln -s {victim} {link}")
    assert done.returncode == 0, done.stderr
    try:
        d.start()
        (arena,) = [p for p in d.arena_files() if p not in planted and p != link]
        st = os.lstat(arena)
        assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o600
        with d.client() as kv:
            kv.put(b"secret", b"s" * 8192, tier="cpu")
            with kv.get(b"secret") as view:
                assert view.tobytes() == b"s" * 8192
        assert victim.read_bytes() == b"precious", "a planted symlink made the daemon write through it"
        for p in planted:
            assert p.read_text() == "attacker\n" and os.lstat(p).st_uid == other_user[0]
        assert os.path.islink(link)
        # the other user can neither read the arena nor an object file
        with d.client() as kv:
            kv.put(b"secret/nvme", b"n" * 8192, tier="nvme")
        (obj,) = (d.dir / "objects").glob("??/*.obj")
        for path in (arena, obj):
            done = as_user(other_user, f"head -c 16 {path}")
            assert done.returncode != 0 and "Permission denied" in done.stderr, (path, done)
        record_figures("test_local_isolation_arena", operations=4, objects_verified=1, losses=0, planted_paths=3,
                       planted_used=0, other_user_reads_refused=2)
    finally:
        d.cleanup()
        for p in planted + [link]:
            p.unlink(missing_ok=True)


def test_arena_is_shared_with_the_group_only_when_asked(start_daemon):
    d = start_daemon(extra_args=["--arena-mode", "0640"])
    (arena,) = d.arena_files()
    assert os.stat(arena).st_mode & 0o777 == 0o640
    d2 = start_daemon("d2")
    (arena2,) = d2.arena_files()
    assert os.stat(arena2).st_mode & 0o777 == 0o600


def test_a_second_daemon_with_the_same_shm_name_is_refused(start_daemon, tmp_path):
    from kvstore.testing import DaemonProcess

    d = start_daemon()
    other = DaemonProcess(tmp_path / "other")
    other.args[other.args.index("--shm-name") + 1] = d.shm_name
    try:
        with pytest.raises(RuntimeError, match="is in use by another daemon"):
            other.start(timeout=60)
    finally:
        other.cleanup()
    assert len(d.arena_files()) == 1


def _mappings_of(path: str) -> list[str]:
    """The permission fields of this process's mappings of `path` (from /proc/self/maps)."""
    with open("/proc/self/maps") as fh:
        return [line.split()[1] for line in fh if line.rstrip().endswith(path)]


def test_readers_map_the_arena_read_only(daemon):
    with daemon.client() as kv:
        kv.put(b"iso/ro", b"r" * 8192, tier="nvme")  # a put to NVMe: no arena write by this process
        (path,) = [t["path"] for t in kv.stats()["tiers"] if t["name"] == "cpu"]
        kv.prefetch([b"iso/ro"], tier="cpu")
        with kv.get(b"iso/ro") as view:
            assert view.tier == "cpu" and view.tobytes() == b"r" * 8192
            assert not view.array.flags.writeable
            perms = _mappings_of(path)
            assert perms and all(p.startswith("r-") for p in perms), perms  # PROT_READ only
        kv.put(b"iso/rw", b"w" * 8192, tier="cpu")  # writing a put maps the arena read-write as well
        assert any(p.startswith("rw") for p in _mappings_of(path))
        kv.delete([b"iso/ro", b"iso/rw"])


def test_lease_and_reservation_ids_are_random_and_bound_to_their_client(daemon):
    md = ((PROTOCOL_METADATA_KEY, "1"),)
    with daemon.client() as owner, daemon.client() as thief:
        owner.put(b"iso/leased", b"L" * 4096, tier="cpu")
        views = [owner.get(b"iso/leased") for _ in range(4)]
        ids = [v.lease_id for v in views]
        assert len(set(ids)) == 4
        assert min(abs(a - b) for a in ids for b in ids if a != b) > 1 << 20, f"sequential lease ids: {ids}"
        before = thief.stats()["foreign_requests_refused"]
        thief._call("Release", pb.ReleaseRequest(lease_ids=ids, client_id=thief.client_id))
        assert thief.stats()["leases"] == 4, "another client's release must not end the leases"
        assert thief.delete([b"iso/leased"]) == 0  # still leased: not deleted
        res = owner._stub.Reserve(pb.ReserveRequest(key=b"iso/reserved", size=4096, tier="cpu",
                                                    client_id=owner.client_id), metadata=md, timeout=10)
        owner._core.regions.write(region_from_pb(res.region), memoryview(b"R" * 4096))
        with pytest.raises(UnknownKey):  # commit by another client: refused as unknown
            thief._call("Commit", pb.CommitRequest(reservation_id=res.reservation_id, checksum=0,
                                                   client_id=thief.client_id))
        thief._call("Abort", pb.AbortRequest(reservation_id=res.reservation_id, client_id=thief.client_id))
        assert thief.stats()["foreign_requests_refused"] - before == 4 + 2
        from kvstore.format import checksum

        entry = owner._call("Commit", pb.CommitRequest(reservation_id=res.reservation_id,
                                                       checksum=checksum(b"R" * 4096), client_id=owner.client_id))
        assert entry.entry.hit
        for v in views:
            v.release()
        with owner.get(b"iso/reserved") as v:
            assert v.tobytes() == b"R" * 4096
        FIGURES.update(operations=6, foreign_requests_refused=6, objects_verified=1, losses=0)
        record_figures("test_local_isolation_clients", **FIGURES)
        owner.delete([b"iso/leased", b"iso/reserved"])


def test_memory_bytes_changed_after_commit_are_caught_before_served_with_verify_memory_always(start_daemon):
    d = start_daemon(extra_args=["--verify-memory", "always"])
    with d.client() as kv:
        kv.put(b"iso/victim", b"V" * 8192, tier="cpu")
        kv.put(b"iso/other", b"O" * 8192, tier="cpu")
        with kv.get(b"iso/victim") as view:
            assert view.tobytes() == b"V" * 8192
            region = view.lease.region
        fd = os.open(region.path, os.O_RDWR)  # a client of the same user writing through its own mapping
        try:
            with mmap.mmap(fd, 0) as mm:
                mm[region.offset] = ord("X")
        finally:
            os.close(fd)
        with pytest.raises(UnknownKey):  # a miss: the changed bytes are not served
            kv.get(b"iso/victim")
        st = kv.stats()
        assert st["corrupt_dropped"] == 1 and kv.lookup([b"iso/victim"])[0].hit is False
        with kv.get(b"iso/other") as view:
            assert view.tobytes() == b"O" * 8192
        FIGURES.update(operations=4, objects_verified=1, losses=0, changed_bytes_served=0,
                       corrupt_dropped=st["corrupt_dropped"])
        record_figures("test_local_isolation_clients", **FIGURES)


def test_a_cache_directory_another_user_owns_is_refused(other_user, tmp_path):
    from kvstore.errors import StorageError
    from kvstore.store import Store, StoreSettings

    planted = tmp_path / "cache"
    planted.mkdir()
    os.chown(planted, *other_user)  # e.g. pre-created by that user under a shared /tmp
    settings = StoreSettings(dir=planted, cpu_capacity=1 << 20, nvme_capacity=1 << 20, shm_name="kvstore-iso-dir")
    with pytest.raises(StorageError, match=f"belongs to uid {other_user[0]}"):
        Store(settings).open()
    assert list(planted.iterdir()) == []  # nothing was created in it
