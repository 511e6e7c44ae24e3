"""Tiers: CpuArena (shared-memory file), NvmeTier (file per object), FaultyTier, GpuArena."""

import mmap
import os
import uuid

import pytest
import torch

from kvstore.errors import AlreadyExists, InvalidRequest, StorageError
from kvstore.format import checksum
from kvstore.tiers.cpu_arena import CpuArena, arena_path
from kvstore.tiers.faulty import FaultyTier
from kvstore.tiers.gpu_arena import GpuArena
from kvstore.tiers.nvme import NvmeTier

PAGE = 4096


def payload(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.fixture
def arena():
    a = CpuArena(8 * PAGE, f"kvstore-tier-test-{uuid.uuid4().hex[:10]}")
    a.open()
    yield a
    a.close()


def test_cpu_arena_is_a_private_shm_file_other_processes_can_map(arena):
    st = os.stat(arena.path)
    assert str(arena.path).startswith("/dev/shm/") and st.st_mode & 0o777 == 0o600 and st.st_size == 8 * PAGE
    slot = arena.allocate(5000, "x")
    src = payload(5000)
    arena.write_from(slot, src)
    region = arena.region(slot)
    assert (region.kind, region.path, region.offset, region.length) == ("shm", str(arena.path), slot.offset, 5000)
    with open(region.path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
        assert mm[region.offset : region.offset + 5000] == bytes(src.numpy())
    assert arena.checksum(slot) == checksum(bytes(src.numpy()))
    dst = torch.empty(5000, dtype=torch.uint8)
    arena.read_into(slot, dst)
    assert torch.equal(dst, src)


def test_cpu_arena_hands_out_a_slots_address_and_whole_extent_as_plain_memory(arena, tmp_path):
    slot = arena.allocate(5000, "x")  # 5000 bytes in a two-page extent
    addr, ext = arena.host_extent(slot)
    view = arena.view(slot)
    assert addr == view.data_ptr() and len(ext) == slot.length == 2 * PAGE and not ext.readonly
    ext[:5000] = bytes(payload(5000, 3).numpy())  # writes through the view are the slot's bytes
    assert torch.equal(view, payload(5000, 3))
    ext[5000:5010] = b"\x07" * 10  # the room past the object is the slot's too, and nobody else's
    other = arena.allocate(PAGE, "y")
    assert arena.host_extent(other)[0] == addr + 2 * PAGE and not any(bytes(arena.view(other).numpy()))
    t = NvmeTier(tmp_path / "objects", 4 * PAGE, io_threads=1)
    t.open()
    try:  # a file tier, and a wrapper, hand out no host memory
        assert t.host_extent(t.allocate(100, "z")) is None and FaultyTier(arena).host_extent(slot) is None
    finally:
        t.close()
    del ext
    arena.close()
    with pytest.raises(StorageError, match="not open"):
        arena.host_extent(slot)


def test_cpu_arena_accounts_and_reports_fragmentation(arena):
    slots = [arena.allocate(PAGE, str(i)) for i in range(8)]
    assert arena.allocate(1, "full") is None and arena.used_bytes == 8 * PAGE
    arena.free(slots[1])
    arena.free(slots[5])
    s = arena.stats()
    assert s["used_bytes"] == 6 * PAGE and s["free_extents"] == 2 and s["fragmentation"] == 0.5


def test_second_arena_with_the_same_name_is_refused_and_close_unlinks(arena):
    other = CpuArena(PAGE, arena.shm_name)
    with pytest.raises(AlreadyExists, match="in use"):
        other.open()
    path = arena.path
    arena.close()
    assert not path.exists()


def test_stale_arena_file_from_a_dead_daemon_is_removed_and_a_fresh_one_made():
    name = f"kvstore-stale-{uuid.uuid4().hex[:10]}"
    stale = arena_path(name)
    stale.write_bytes(b"\xff" * 2 * PAGE)
    a = CpuArena(2 * PAGE, name)
    a.open()
    try:
        assert not stale.exists() and a.path != stale
        slot = a.allocate(PAGE, "x")
        assert int(a.view(slot).max()) == 0
    finally:
        a.close()


def test_bad_arena_names_and_sizes_are_invalid():
    with pytest.raises(InvalidRequest, match="shm name"):
        arena_path("../etc")
    with pytest.raises(InvalidRequest, match="capacity"):
        CpuArena(0, "x")


@pytest.fixture
def nvme(tmp_path):
    t = NvmeTier(tmp_path / "objects", 16 * PAGE, io_threads=2)
    t.open()
    yield t
    t.close()


def test_nvme_slot_is_invisible_until_sealed_then_durable_at_its_final_path(nvme, monkeypatch):
    monkeypatch.setattr("kvstore.tiers.nvme.CHUNK", PAGE)  # exercise the chunked, threaded path
    src = payload(3 * PAGE + 5)
    slot = nvme.allocate(src.numel(), "abcdef")
    assert slot.path.endswith(".part") and nvme.list_sealed() == []
    nvme.write_from(slot, src)
    sealed = nvme.seal(slot, "abcdef")
    assert sealed.path.startswith(str(nvme.root / "ab" / "abcdef.")) and sealed.path.endswith(".obj")
    assert not os.path.exists(slot.path)
    assert nvme.list_sealed() == [sealed] and nvme.used_bytes == 4 * PAGE
    dst = torch.empty(src.numel(), dtype=torch.uint8)
    nvme.read_into(sealed, dst)
    assert torch.equal(dst, src) and nvme.checksum(sealed) == checksum(bytes(src.numpy()))
    assert nvme.region(sealed).kind == "file"
    nvme.free(sealed)
    assert nvme.used_bytes == 0 and not os.path.exists(sealed.path)


def test_nvme_pipelined_hash_and_read_into_hashed_match_the_bytes(nvme, monkeypatch):
    monkeypatch.setattr("kvstore.tiers.nvme.CHUNK", PAGE)  # several chunks in flight
    monkeypatch.setattr("kvstore.tiers.nvme.HASH_CHUNK", PAGE)
    src = payload(5 * PAGE + 7, seed=3)
    slot = nvme.allocate(src.numel(), "pipe")
    nvme.write_from(slot, src)
    want = checksum(bytes(src.numpy()))
    assert nvme.checksum(slot) == want  # unsealed: hashed while its writeback runs
    sealed = nvme.seal(slot, "pipe")
    dst = torch.zeros(src.numel() + 3, dtype=torch.uint8)
    assert nvme.checksum(sealed) == want and nvme.read_into_hashed(sealed, dst) == want
    assert torch.equal(dst[: src.numel()], src)
    os.truncate(sealed.path, 2 * PAGE)
    with pytest.raises(StorageError, match="short"):
        nvme.checksum(sealed)
    with pytest.raises(StorageError, match="short read"):
        nvme.read_into_hashed(sealed, dst)


def test_nvme_capacity_is_enforced_and_leftover_parts_are_discarded(nvme):
    a = nvme.allocate(10 * PAGE, "a")
    assert nvme.allocate(7 * PAGE, "b") is None
    assert nvme.discard_unsealed() == 1 and not os.path.exists(a.path)


def test_nvme_short_file_is_a_storage_error(nvme):
    slot = nvme.seal(nvme.allocate(PAGE, "cd"), "cd")
    os.truncate(slot.path, 10)
    with pytest.raises(StorageError, match="short"):
        nvme.checksum(slot)
    with pytest.raises(StorageError, match="short read"):
        nvme.read_into(slot, torch.empty(PAGE, dtype=torch.uint8))


def test_faulty_tier_fails_the_armed_calls_then_recovers(nvme):
    f = FaultyTier(nvme)
    f.fail("write_from", times=2)
    slot = f.allocate(PAGE, "ef")
    for _ in range(2):
        with pytest.raises(StorageError, match="injected fault: nvme.write_from"):
            f.write_from(slot, payload(PAGE))
    f.write_from(slot, payload(PAGE))
    assert f.injected["write_from"] == 2 and f.stats()["injected_faults"] == {"write_from": 2}
    before = f.checksum(slot)
    f.corrupt(slot)
    assert f.checksum(slot) != before
    with pytest.raises(InvalidRequest, match="free"):
        f.fail("free")


def test_gpu_arena_without_cuda_is_a_clear_storage_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the GPU path is tested in test_store")
    with pytest.raises(StorageError, match="CUDA is not available"):
        GpuArena(PAGE).open()
