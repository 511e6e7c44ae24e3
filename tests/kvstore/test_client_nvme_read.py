"""Reading NVMe-tier objects without promotion through a real daemon: `copy_to` and
`read_into` read the object file (kvstore.client.fileio) byte-exact for any size and
destination alignment, `verify=True` catches a corrupted file that `client_verifies`
let through the daemon, the daemon still catches it otherwise, and a get starts no
read of its own. CUDA destinations run only where CUDA is present."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.client.fileio import aligned_empty, cached_fraction
from kvstore.errors import BadObject, InvalidRequest
from kvstore.testing import drop_page_cache

CUDA = torch.cuda.is_available()
SIZES = [4096, 3 * 4096, 4097, 5000, (1 << 20) + 4096, (2 << 20) + 333]  # 4 KiB multiples and not


def _put_nvme(kv, prefix: str, sizes: list[int]) -> dict[bytes, bytes]:
    objects = {f"{prefix}/{i}".encode(): os.urandom(n) for i, n in enumerate(sizes)}
    for key, data in objects.items():
        assert kv.put(key, data, tier="nvme").tier == "nvme"
    return objects


def _flip_byte(path: str, at: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([b[0] ^ 0x5A]), at)
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("client_verifies", [True, False], ids=["client_verifies", "daemon_verifies"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned_dst", "unaligned_dst"])
def test_copy_to_cpu_tensors_round_trips_several_nvme_objects_byte_exact(daemon, client_verifies, aligned):
    with daemon.client() as kv:
        objects = _put_nvme(kv, f"nvread/{client_verifies}/{aligned}", SIZES)
        views = kv.get_many(list(objects), promote=False, client_verifies=client_verifies)
        try:
            for view, (key, data) in zip(views, objects.items()):
                assert view.tier == "nvme" and view.lease.region.kind == "file"
                raw = torch.from_numpy(aligned_empty(len(data) + 4096 + 64))
                dst = raw[: len(data) + 64] if aligned else raw[1: len(data) + 65]
                dst.fill_(7)
                assert view.copy_to(dst, verify=True) is None
                assert dst[: len(data)].numpy().tobytes() == data, key
                assert bool((dst[len(data):] == 7).all()), "bytes past the object were written"
        finally:
            kv.release_many(views)
        kv.delete(list(objects))


def test_read_into_host_buffers_and_small_pieces_give_the_bytes(daemon):
    with daemon.client() as kv:
        objects = _put_nvme(kv, "nvread/into", [4097, (1 << 20) + 1])
        for key, data in objects.items():
            with kv.get(key, promote=False, client_verifies=True) as view:
                out = bytearray(len(data) + 3)
                view.read_into(out, verify=True)
                assert bytes(out[: len(data)]) == data
                dst = torch.empty(len(data), dtype=torch.uint8)
                view.copy_to(dst, chunk=10_000, verify=True)  # pieces rounded up to 12 KiB
                assert dst.numpy().tobytes() == data
        kv.delete(list(objects))


def test_verify_catches_a_corrupted_object_file_the_client_was_trusted_with(daemon):
    with daemon.client() as kv:
        data = os.urandom((1 << 20) + 100)
        kv.put(b"nvread/rot", data, tier="nvme")
        with kv.get(b"nvread/rot", promote=False) as view:
            path = view.lease.region.path
        _flip_byte(path, 700_000)
        (view,) = kv.get_many([b"nvread/rot"], promote=False, client_verifies=True)  # the daemon skips its read-back
        with view:
            dst = torch.empty(len(data), dtype=torch.uint8)
            view.copy_to(dst)  # unverified: the bytes on disk, flipped byte included
            assert dst.numpy().tobytes() != data
            assert (dst.numpy() != np.frombuffer(data, dtype=np.uint8)).sum() == 1
            with pytest.raises(BadObject, match="nvread/rot"):
                view.copy_to(dst, verify=True)
            with pytest.raises(BadObject, match="hash to"):
                view.read_into(bytearray(len(data)), verify=True)
        assert kv.get_many([b"nvread/rot"], promote=False) == [None]  # the daemon's own check drops it
        assert kv.lookup([b"nvread/rot"])[0].hit is False


def test_a_destination_too_small_or_read_only_is_refused_with_the_size_needed(daemon):
    with daemon.client() as kv:
        kv.put(b"nvread/small", os.urandom(10_000), tier="nvme")
        with kv.get(b"nvread/small", promote=False) as view:
            with pytest.raises(InvalidRequest, match="uint8 tensor of >= 10000 bytes"):
                view.copy_to(torch.empty(9_999, dtype=torch.uint8))
            with pytest.raises(InvalidRequest, match=">= 10000 bytes, got bytearray of 4096 bytes"):
                view.read_into(bytearray(4096))
            with pytest.raises(InvalidRequest, match="read-only bytes"):
                view.read_into(bytes(10_000))
            with pytest.raises(InvalidRequest, match="writable host buffer, got int"):
                view.read_into(5)
        kv.delete([b"nvread/small"])


def test_a_get_without_promotion_starts_no_read_of_the_file(daemon):
    with daemon.client() as kv:
        data = os.urandom(1 << 20)
        kv.put(b"nvread/cold", data, tier="nvme")
        with kv.get(b"nvread/cold", promote=False) as view:
            path = view.lease.region.path
        drop_page_cache(path)
        (view,) = kv.get_many([b"nvread/cold"], promote=False, client_verifies=True)
        with view:
            if cached_fraction(view._host, 0, view.size) != 0.0:
                pytest.skip("this file system keeps the object's pages cached after POSIX_FADV_DONTNEED")
            assert cached_fraction(view._host, 0, view.size) == 0.0  # no read-ahead was started at get
            assert view.array.tobytes() == data  # the zero-copy view reads through the mapping
        kv.delete([b"nvread/cold"])


@pytest.mark.skipif(not CUDA, reason="copies into a GPU tensor need CUDA (not present on this machine)")
@pytest.mark.parametrize("client_verifies", [True, False], ids=["client_verifies", "daemon_verifies"])
def test_copy_to_a_cuda_tensor_round_trips_nvme_objects_through_pinned_staging(daemon, client_verifies):
    with daemon.client() as kv:
        objects = _put_nvme(kv, f"nvread/cuda/{client_verifies}", SIZES + [(20 << 20) + 5])  # > 2 x threads pieces
        views = kv.get_many(list(objects), promote=False, client_verifies=client_verifies)
        try:
            for view, data in zip(views, objects.values()):
                dst = torch.full((len(data) + 64,), 7, dtype=torch.uint8, device="cuda")
                done = view.copy_to(dst, verify=True)
                done.synchronize()
                assert dst[: len(data)].cpu().numpy().tobytes() == data
                assert bool((dst[len(data):] == 7).all())
        finally:
            torch.cuda.synchronize()
            kv.release_many(views)
        kv.delete(list(objects))


@pytest.mark.skipif(not CUDA, reason="copies into a GPU tensor need CUDA (not present on this machine)")
def test_verify_into_a_cuda_tensor_catches_a_corrupted_object_file(daemon):
    with daemon.client() as kv:
        data = os.urandom(3 << 20)
        kv.put(b"nvread/cuda-rot", data, tier="nvme")
        with kv.get(b"nvread/cuda-rot", promote=False) as view:
            path = Path(view.lease.region.path)
        _flip_byte(str(path), 2_500_000)
        (view,) = kv.get_many([b"nvread/cuda-rot"], promote=False, client_verifies=True)
        with view:
            with pytest.raises(BadObject, match="nvread/cuda-rot"):
                view.copy_to(torch.empty(len(data), dtype=torch.uint8, device="cuda"), verify=True)
            torch.cuda.synchronize()
        kv.delete([b"nvread/cuda-rot"])
