"""kvstore.checksums: the algorithm a blob's preamble names, the host kvsum64 against the
kernels' torch reference, and kvsum64 blobs stored, verified and served by the real
daemon on the CPU and NVMe tiers (as a GPU-tier blob is after demotion)."""

from __future__ import annotations

import os

import pytest
import torch
import xxhash

from kernels.blob_checksum import kvsum64_reference
from kvstore import checksums as cks
from kvstore import format as fmt
from kvstore.errors import BadObject
from kvstore.rpc import codec
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.rpc.service import PROTOCOL_METADATA_KEY


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    return {"k": torch.randn(3, 33, generator=g), "v": torch.randn(5, generator=g).half(),
            "odd": torch.randint(0, 2, (7,), generator=g).bool()}


def _blob(algorithm: int) -> bytearray:
    t = _tensors()
    plan = fmt.plan_blob(t, fingerprint="fp", token_count=3)
    out = bytearray(plan.total_size)
    fmt.write_blob(out, plan, t, algorithm=algorithm)
    return out


def test_host_kvsum_matches_the_kernel_reference_on_fresh_random_bytes_in_any_chunking():
    for n in (1, 5, 4096 + 3, (1 << 20) + 9):
        data = os.urandom(n)
        want = kvsum64_reference(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        whole = cks.KvsumHasher()
        whole.update(data)
        assert whole.intdigest() == want
        pieces = cks.KvsumHasher()
        cuts = sorted({0, n, *(int.from_bytes(os.urandom(3), "little") % n for _ in range(5))})
        for a, b in zip(cuts, cuts[1:]):
            pieces.update(data[a:b])
        assert pieces.intdigest() == want, cuts


def test_the_preamble_flags_name_the_algorithm_and_raw_bytes_use_xxh3():
    assert cks.algorithm_of(_blob(cks.KVSUM64)) == cks.KVSUM64
    assert cks.algorithm_of(_blob(cks.XXH3)) == cks.XXH3
    assert cks.algorithm_of(b"just some raw bytes, longer than a preamble") == cks.XXH3
    raw = os.urandom(100)
    assert fmt.checksum(raw) == xxhash.xxh3_64_intdigest(raw)
    assert fmt.read_header(_blob(cks.KVSUM64)).algorithm == cks.KVSUM64


def test_a_kvsum_blob_verifies_and_its_store_checksum_is_kvsum_of_every_byte():
    blob = _blob(cks.KVSUM64)
    fmt.verify(blob)
    assert fmt.checksum(blob) == kvsum64_reference(torch.frombuffer(blob, dtype=torch.uint8))
    header, tensors = fmt.decode_tensors(blob)
    assert set(tensors) == {"k", "v", "odd"}
    blob[header.parts[0].offset + 5] ^= 0x40
    with pytest.raises(BadObject, match="checksum mismatch"):
        fmt.verify(blob)


def test_unknown_algorithm_flags_are_a_bad_object_naming_them():
    blob = _blob(cks.XXH3)
    blob[10:12] = (9).to_bytes(2, "little")  # the u16 flags after magic and version
    with pytest.raises(BadObject, match="0x0009"):
        fmt.read_header(blob)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_the_daemon_stores_verifies_and_serves_kvsum_blobs(daemon, tier):
    blob = bytes(_blob(cks.KVSUM64))
    key = f"cks/{tier}".encode()
    with daemon.client() as kv:
        res = kv.put(key, blob, tier=tier)
        assert res.status == "stored" and res.checksum == fmt.checksum(blob)
        with kv.get(key) as view:
            assert view.tobytes() == blob
            view.verify()
        with kv.get_tensors(key, verify=True) as (header, tensors):
            assert header.algorithm == cks.KVSUM64 and tensors["k"].shape == (3, 33)
        assert kv.show(key).header["checksum_algorithm"] == "kvsum64"
        kv.delete([key])


def test_the_daemon_rejects_a_kvsum_blob_committed_with_an_xxh3_checksum(daemon):
    blob = bytes(_blob(cks.KVSUM64))
    with daemon.client() as kv:
        md = ((PROTOCOL_METADATA_KEY, "1"),)
        res = kv._stub.Reserve(pb.ReserveRequest(key=b"cks/wrong", size=len(blob), tier="cpu", client_id="c"),
                               metadata=md, timeout=10)
        kv._core.regions.write(codec.region_from_pb(res.region), memoryview(blob))
        with pytest.raises(BadObject):
            kv._call("Commit", pb.CommitRequest(reservation_id=res.reservation_id, client_id="c",
                                                checksum=xxhash.xxh3_64_intdigest(blob)))
        assert kv.lookup([b"cks/wrong"])[0].hit is False
