"""Helpers for Store tests: write/read a Region the way a client on the host does."""

from __future__ import annotations

import mmap
import os
import threading
import uuid
from pathlib import Path

from kvstore.format import checksum
from kvstore.store import LookupEntry, ObjectMeta, Region, Store, StoreSettings

PAGE = 4096


def make_settings(root: Path, **kw) -> StoreSettings:
    """Settings of an in-process test store: background write-back off (its tests turn it
    on), so demotions happen exactly where a test makes room."""
    base = dict(dir=root / "cache", cpu_capacity=16 * PAGE, nvme_capacity=64 * PAGE,
                shm_name=f"kvstore-test-{uuid.uuid4().hex[:12]}", lease_ttl_s=30.0, eviction="lru",
                writeback_watermark=1.0)
    base.update(kw)
    return StoreSettings(**base)


def write_region(region: Region, data: bytes) -> None:
    assert region.length == len(data)
    if region.kind == "shm":
        with open(region.path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
            mm[region.offset : region.offset + len(data)] = data
    elif region.kind == "file":
        fd = os.open(region.path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, region.offset)
        finally:
            os.close(fd)
    else:
        raise AssertionError(f"cannot write region kind {region.kind}")


def read_region(region: Region) -> bytes:
    if region.kind == "shm":
        with open(region.path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
            return bytes(mm[region.offset : region.offset + region.length])
    if region.kind == "file":
        fd = os.open(region.path, os.O_RDONLY)
        try:
            return os.pread(fd, region.length, region.offset)
        finally:
            os.close(fd)
    raise AssertionError(f"cannot read region kind {region.kind}")


def put(store: Store, key: bytes, data: bytes, tier: str = "cpu", cost: float = 0.0,
        fingerprint: str = "") -> LookupEntry:
    r = store.reserve(key, len(data), tier, ObjectMeta(fingerprint=fingerprint, cost=cost))
    assert r.status == "reserved", r
    write_region(r.region, data)
    return store.commit(r.reservation_id, checksum(data))


def get_bytes(store: Store, key: bytes, **kw) -> bytes | None:
    (lease,) = store.get([key], "test-client", **kw)
    if lease is None:
        return None
    try:
        return read_region(lease.region)
    finally:
        store.release([lease.lease_id])


def gate_copies(s: Store, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Hold the store's tier copies (a write-back's or a demotion's, made outside the
    lock) until `go` is set, after setting `entered`; returns (entered, go)."""
    real, entered, go = s._place.copy, threading.Event(), threading.Event()

    def gated(*args):
        entered.set()
        assert go.wait(30)
        real(*args)

    monkeypatch.setattr(s._place, "copy", gated)
    return entered, go
