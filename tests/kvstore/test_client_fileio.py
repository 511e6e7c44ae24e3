"""kvstore.client.fileio on real files: parallel piecewise reads of a file region into
host memory, O_DIRECT and buffered, into aligned and unaligned destinations, ragged tails,
hashing as the pieces land, the page-cache probe, and the errors for short files and bad
arguments."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from kvstore.checksums import host_checksum
from kvstore.client import fileio
from kvstore.client.fileio import FileReadSettings, aligned_empty, cached_fraction, plan_pieces, read_file
from kvstore.errors import BadObject, InvalidRequest, KVStoreError
from kvstore.testing import drop_page_cache

SMALL = FileReadSettings(threads=3, piece_bytes=64 << 10)  # many pieces from small files


def _file(path: Path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return str(path)


def test_pieces_cover_the_region_once_with_aligned_offsets_and_split_small_objects_across_threads():
    for length in (1, 4095, 4096, 5000, (1 << 20) + 7, 40 << 20):
        pieces = plan_pieces(length)
        assert sum(n for _, n in pieces) == length
        assert [o for o, _ in pieces] == [sum(n for _, n in pieces[:i]) for i in range(len(pieces))]
        assert all(o % fileio.ALIGN == 0 and n <= fileio.DEFAULT_SETTINGS.piece_bytes for o, n in pieces)
    assert len(plan_pieces(4 << 20)) == 4  # 4 threads: four 1 MiB pieces, not one 4 MiB piece
    assert len(plan_pieces(100 << 10)) == 1  # under MIN_PIECE: not split


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
@pytest.mark.parametrize("size", [1, 4096, 4097, 3 * 4096, (300 << 10) + 1234])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned_dst", "unaligned_dst"])
def test_read_file_gives_the_exact_bytes_and_their_checksum(tmp_path, direct, size, aligned):
    data = os.urandom(size)
    path = _file(tmp_path / "obj", data + os.urandom(5000))  # bytes past the region are not copied
    drop_page_cache(path)
    dst = aligned_empty(size + 4096 + 1)
    dst = dst[:size] if aligned else dst[1: size + 1]
    settings = FileReadSettings(threads=SMALL.threads, piece_bytes=SMALL.piece_bytes, direct=direct)
    digest = read_file(path, 0, size, dst, hash_bytes=True, settings=settings)
    assert dst.tobytes() == data
    assert digest == host_checksum(data)
    assert read_file(path, 0, size, dst, settings=settings) is None  # no hash asked, none computed


def test_read_file_at_an_offset_inside_the_file(tmp_path):
    data = os.urandom(200_000)
    path = _file(tmp_path / "obj", data)
    for offset in (8192, 1000):  # aligned (O_DIRECT) and not (buffered)
        dst = np.zeros(100_000, dtype=np.uint8)
        read_file(path, offset, 100_000, dst, settings=SMALL)
        assert dst.tobytes() == data[offset: offset + 100_000]


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
@pytest.mark.parametrize("size", [4096, 10_000])
def test_a_file_shorter_than_its_region_is_a_bad_object_naming_the_file(tmp_path, direct, size):
    path = _file(tmp_path / "short.obj", os.urandom(size))
    settings = FileReadSettings(threads=2, piece_bytes=4096, direct=direct)
    with pytest.raises(BadObject, match=r"short\.obj is short"):
        read_file(path, 0, size + 5000, aligned_empty(size + 5000), settings=settings)


def test_read_file_rejects_a_small_or_read_only_destination_and_bad_settings(tmp_path):
    path = _file(tmp_path / "obj", os.urandom(10_000))
    with pytest.raises(InvalidRequest, match=">= 10000 bytes"):
        read_file(path, 0, 10_000, np.zeros(9_999, dtype=np.uint8))
    ro = np.zeros(10_000, dtype=np.uint8)
    ro.flags.writeable = False
    with pytest.raises(InvalidRequest, match="writable"):
        read_file(path, 0, 10_000, ro)
    with pytest.raises(InvalidRequest, match="thread"):
        FileReadSettings(threads=0)
    with pytest.raises(InvalidRequest, match="multiple of 4096"):
        FileReadSettings(piece_bytes=5000)


def test_a_missing_object_file_is_reported_as_gone(tmp_path):
    with pytest.raises(KVStoreError, match="missing is gone"):
        read_file(str(tmp_path / "missing"), 0, 10, np.zeros(10, dtype=np.uint8))


def test_the_page_cache_probe_sees_pages_read_and_pages_dropped(tmp_path):
    data = os.urandom(256 << 10)
    path = _file(tmp_path / "obj", data)
    with open(path, "rb") as f:
        mapping = np.frombuffer(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ), dtype=np.uint8)
    assert cached_fraction(None, 0, len(data)) == 0.0
    _read_all(path)
    assert cached_fraction(mapping, 0, len(data)) == 1.0
    drop_page_cache(path)
    if cached_fraction(mapping, 0, len(data)) != 0.0:
        pytest.skip("this file system keeps the pages cached after POSIX_FADV_DONTNEED (tmpfs?)")
    probe = fileio._OpenFile(path, fileio.DEFAULT_SETTINGS)
    direct = probe.dfd is not None
    probe.close()
    dst = aligned_empty(len(data))
    read_file(path, 0, len(data), dst, mapping=mapping)
    assert dst.tobytes() == data
    if direct:  # a cold read went around the page cache
        assert cached_fraction(mapping, 0, len(data)) == 0.0


def _read_all(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.read(fd, 1 << 20):
            pass
    finally:
        os.close(fd)
