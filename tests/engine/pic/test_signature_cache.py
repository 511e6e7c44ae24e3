"""segment_key and InMemorySignatureCache: stable content keys, hit/miss counters, LRU by
bytes."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from engine.pic.signature import AttentionPart, SegmentSignature
from engine.pic.signature_cache import InMemorySignatureCache, segment_key, signature_variant


def sig_of_bytes(n_rows: int) -> SegmentSignature:
    k = torch.zeros(n_rows, 1, 4)
    return SegmentSignature(max(n_rows, 1), 0, 0, (AttentionPart("full", k, k.clone()),))


def test_segment_key_depends_on_model_variant_and_tokens_only():
    base = segment_key("fp", [1, 2, 3], signature_variant([256], 8))
    assert len(base) == 32
    assert base == segment_key("fp", (1, 2, 3), "anchor=256;split=8")
    assert base != segment_key("fp2", [1, 2, 3], "anchor=256;split=8")
    assert base != segment_key("fp", [1, 2, 3], signature_variant([256], 4))
    assert base != segment_key("fp", [1, 2, 4], signature_variant([256], 8))
    assert base != segment_key("fp", [1, 2, 3], signature_variant([], 8))


def test_segment_key_is_the_same_in_another_process_with_another_hash_seed():
    code = "from engine.pic.signature_cache import segment_key; print(segment_key('fp', [5, 6, 7], 'v').hex())"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": os.environ.get("PYTHONPATH", ".")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == segment_key("fp", [5, 6, 7], "v").hex()


def test_get_counts_hits_and_misses_and_returns_none_on_a_miss_while_lookup_counts_nothing():
    cache = InMemorySignatureCache(1 << 20)
    sig = sig_of_bytes(4)
    assert cache.get(b"a") is None
    assert cache.put(b"a", sig)
    assert cache.lookup([b"a", b"b"]) == [True, False]
    assert cache.get(b"a") is sig
    s = cache.stats()
    assert (s.hits, s.misses, s.puts, s.entries, s.bytes) == (1, 1, 1, 1, sig.nbytes())
    assert s.hit_rate == 0.5


def test_lru_by_bytes_evicts_the_least_recently_used_first():
    one = sig_of_bytes(8).nbytes()  # 256 bytes
    cache = InMemorySignatureCache(3 * one)
    for key in (b"a", b"b", b"c"):
        cache.put(key, sig_of_bytes(8))
    cache.get(b"a")  # b is now the oldest
    cache.put(b"d", sig_of_bytes(8))
    assert cache.lookup([b"a", b"b", b"c", b"d"]) == [True, False, True, True]
    cache.put(b"e", sig_of_bytes(16))  # two entries' worth: evicts c, then a
    assert cache.lookup([b"a", b"c", b"d", b"e"]) == [False, False, True, True]
    s = cache.stats()
    assert s.evictions == 3 and s.bytes == 3 * one


def test_a_signature_larger_than_the_whole_cache_is_rejected():
    cache = InMemorySignatureCache(100)
    assert not cache.put(b"x", sig_of_bytes(8))
    s = cache.stats()
    assert (s.rejected, s.entries, s.bytes) == (1, 0, 0)


def test_discard_drops_held_keys_and_their_bytes_and_ignores_absent_ones():
    cache = InMemorySignatureCache(1 << 20)
    for key in (b"a", b"b"):
        cache.put(key, sig_of_bytes(8))
    assert cache.discard([b"a", b"zz"]) == 1
    assert cache.lookup([b"a", b"b"]) == [False, True]
    s = cache.stats()
    assert (s.entries, s.bytes) == (1, sig_of_bytes(8).nbytes())


def test_clear_drops_everything_and_keeps_the_counters():
    cache = InMemorySignatureCache(1 << 20)
    for key in (b"a", b"b", b"c"):
        cache.put(key, sig_of_bytes(8))
    cache.get(b"a")
    assert cache.clear() == 3
    assert cache.lookup([b"a", b"b", b"c"]) == [False, False, False]
    s = cache.stats()
    assert (s.entries, s.bytes, s.puts, s.hits) == (0, 0, 3, 1)
    assert cache.put(b"d", sig_of_bytes(8)) and cache.stats().bytes == sig_of_bytes(8).nbytes()
