"""The remote envelope's `PayloadVerifier`: hashing an object as it lands, piece by
piece, gives exactly the verdict of hashing it whole after the get, for any split of
the landings; a damaged byte anywhere (hashed while landing or at `finish`) or a short
object is refused, never passed."""
from __future__ import annotations

import os
import random

import pytest
import xxhash

from kvstore.errors import BadObject
from kvstore.records import ObjectMeta
from kvstore.remote.envelope import MAX_TRAILER_BYTES, PayloadVerifier, encode_trailer, verify_object


def _object(payload: bytes, key: bytes = b"key") -> bytearray:
    xsum = xxhash.xxh3_64_intdigest(payload)
    return bytearray(payload + encode_trailer(key, ObjectMeta("fp", 3, 0.5, {"a": 1}), len(payload), 0x77, xsum))


def _landings(size: int, rng: random.Random) -> list[int]:
    ends = sorted({rng.randrange(1, size + 1) for _ in range(rng.randrange(1, 9))} | {size})
    return ends


def test_hashing_pieces_as_they_land_matches_hashing_the_whole_object_for_any_split():
    rng = random.Random(7)
    for n in (0, 1, 100, MAX_TRAILER_BYTES - 1, MAX_TRAILER_BYTES, 70_000, 1 << 20):
        obj = _object(os.urandom(n))
        whole = verify_object(memoryview(obj), b"key")
        for _ in range(5):
            v = PayloadVerifier(memoryview(obj), b"key")
            for end in _landings(len(obj), rng):
                v.landed(end)
            assert v.finish() == whole and whole.payload_bytes == n
        v = PayloadVerifier(memoryview(obj), b"key")
        v.landed(len(obj) // 2)  # a get that reported only part of its progress
        assert v.finish() == whole


def test_a_flipped_byte_hashed_while_landing_or_at_finish_is_refused():
    n = 200_000
    obj = _object(os.urandom(n))
    for at in (0, 65_535, n - MAX_TRAILER_BYTES - 1, n - MAX_TRAILER_BYTES + 5, n - 1):
        bad = bytearray(obj)
        bad[at] ^= 0x10
        v = PayloadVerifier(memoryview(bad), b"key")
        for end in range(65_536, len(bad) + 65_536, 65_536):
            v.landed(min(end, len(bad)))
        with pytest.raises(BadObject, match="payload hashes"):
            v.finish()


def test_a_truncated_or_foreign_object_fed_in_pieces_is_refused():
    obj = _object(os.urandom(150_000))
    for view, key, why in ((memoryview(obj)[: len(obj) // 2], b"key", "bad magic"),
                           (memoryview(obj)[1:], b"key", "its trailer says"),
                           (memoryview(obj), b"other", "holds key")):
        v = PayloadVerifier(view, key)
        v.landed(len(view) // 3)
        v.landed(len(view))
        with pytest.raises(BadObject, match=why):
            v.finish()


def test_a_faulty_adapters_corrupted_get_is_caught_even_over_an_adapter_that_reports_progress():
    import torch

    from kvstore.remote.base import GetItem
    from kvstore.remote.faulty import FaultyAdapter, RemoteFaults
    from kvstore.remote.memory import MemoryAdapter

    class Progressing(MemoryAdapter):  # reports each object as landed, as the Mooncake adapter's chunked get does
        def get_now(self, items):
            codes = super().get_now(items)
            for it, c in zip(items, codes):
                if c > 0 and it.landed is not None:
                    it.landed(c)
            return codes

    inner = Progressing()
    obj = _object(os.urandom(100_000))
    inner.remote.objects["ns/x"] = bytes(obj)
    a = FaultyAdapter(inner, RemoteFaults(corrupt_gets=True))
    try:
        for corrupt in (False, True):
            a.faults.corrupt_gets = corrupt
            dst = torch.zeros(len(obj), dtype=torch.uint8)
            v = PayloadVerifier(memoryview(dst.numpy()), b"key")
            assert a.call("get", [GetItem("ns/x", ((dst.data_ptr(), len(obj)),), v.landed)], 5.0).codes == (len(obj),)
            if corrupt:
                with pytest.raises(BadObject, match="payload hashes"):
                    v.finish()
            else:
                assert v.finish().payload_bytes == 100_000
        assert a.injected["corrupted_gets"] == 1
    finally:
        a.close()
        inner.close()
