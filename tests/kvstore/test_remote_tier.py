"""kvstore.remote on real in-process Stores (real shared-memory arenas, real files and
LMDB) over the in-memory remote store, wrapped in the fault-injecting adapter: two
stores on one remote share objects; a damaged, short or foreign remote object is dropped
and counted, never served; an unreachable or slow remote store costs a bounded wait
(none once known unreachable), is counted, and reconnects by itself; the policy decides
what is written; the adapter contract (exactly-once results, buffers kept until the end)."""
from __future__ import annotations

import ctypes
import os
import time

import pytest
import torch

from kvstore.errors import InvalidRequest
from kvstore.records import ObjectMeta
from kvstore.remote.base import NOT_FOUND, GetItem, PutItem, RemoteConfigError, RemoteError
from kvstore.remote.envelope import (FOOTER_BYTES, decode_trailer, encode_trailer, remote_name, trailer_body,
                                     verify_object)
from kvstore.remote.faulty import FaultyAdapter, RemoteFaults
from kvstore.remote.memory import MemoryAdapter, MemoryRemote
from kvstore.remote.mooncake import MooncakeTarget
from kvstore.remote.policy import CostThreshold, WriteAll, WriteNone, parse_policy
from kvstore.errors import BadObject
from kvstore.store import Store

from storeutil import PAGE, get_bytes, make_settings, put
from test_store import data


def _pair(tmp_path, remote=None, faults=None, policy="all", timeout=1.0, **kw):
    remote = remote or MemoryRemote()
    out = []
    for name in ("host1", "host2"):
        f = faults if name == "host2" and faults is not None else RemoteFaults()
        adapter = FaultyAdapter(MemoryAdapter(remote), f)
        s = Store(make_settings(tmp_path / name, remote_policy=policy, remote_timeout_s=timeout, **kw),
                  remote_adapter=adapter)
        s.open()
        out.append((s, adapter))
    return remote, out


def _drain(s, timeout=10.0):
    deadline = time.monotonic() + timeout
    while s.stats()["remote"]["pending_writes"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert s.stats()["remote"]["pending_writes"] == 0


def _remote_stats(s):
    return s.stats()["remote"]


def test_an_object_put_on_one_host_is_served_verified_on_another(tmp_path):
    remote, [(s1, _), (s2, _)] = _pair(tmp_path)
    try:
        body = data(3 * PAGE + 17, 1)
        put(s1, b"seg-1", body, cost=0.5, fingerprint="fp")
        _drain(s1)
        assert _remote_stats(s1)["objects_written"] == 1 and _remote_stats(s1)["bytes_written"] == len(body)
        obj = remote.objects[remote_name("kvstore", b"seg-1")]  # the payload, then its trailer
        assert obj[: len(body)] == body and decode_trailer(memoryview(obj), b"seg-1").payload_bytes == len(body)
        # a lookup on host 2 finds it (filled into the CPU tier), and the get serves equal bytes
        (entry,) = s2.lookup([b"seg-1"])
        assert entry.hit and entry.tier == "cpu" and entry.size == len(body)
        assert get_bytes(s2, b"seg-1") == body
        info = s2.object_info(b"seg-1")
        assert info.meta.fingerprint == "fp" and info.meta.cost == 0.5
        r2 = _remote_stats(s2)
        assert r2["hits"] == 1 and r2["bytes_read"] == len(body) and r2["corrupt_dropped"] == 0
        # absent everywhere: a remote miss, counted
        assert s2.lookup([b"nowhere"])[0].hit is False and _remote_stats(s2)["misses"] == 1
        # a get of a key only the remote holds fills it too
        put(s1, b"seg-2", data(PAGE, 2))
        _drain(s1)
        assert get_bytes(s2, b"seg-2") == data(PAGE, 2)
    finally:
        s1.close()
        s2.close()


def test_presence_without_waiting_defers_local_misses_to_a_worker(tmp_path):
    _, [(s1, _), (s2, _)] = _pair(tmp_path)
    try:
        put(s1, b"k", data(PAGE, 3))
        _drain(s1)
        assert s2.presence([b"k"], wait=False) is None  # the fast path retries on a thread
        assert s2.presence([b"k"], wait=True) == [("cpu", PAGE)]
        assert s2.presence([b"k"], wait=False) == [("cpu", PAGE)]  # local now: answered inline
    finally:
        s1.close()
        s2.close()


def test_with_a_remote_tier_the_cpu_arena_keeps_room_so_an_object_and_its_trailer_go_as_one_range(tmp_path):
    ranges = []

    class Recording(MemoryAdapter):
        def put_now(self, items):
            ranges.extend(len(i.ranges) for i in items)
            return super().put_now(items)

    remote = MemoryRemote()
    s = Store(make_settings(tmp_path / "h", remote_policy="all", remote_timeout_s=1.0),
              remote_adapter=Recording(remote))
    s.open()
    try:
        body = data(4 * PAGE, 7)  # a page multiple: only the room the arena reserves fits the trailer
        put(s, b"pages", body)
        _drain(s)
        assert ranges == [1]
        obj = remote.objects[remote_name("kvstore", b"pages")]
        assert obj[: len(body)] == body and verify_object(memoryview(obj), b"pages").payload_bytes == len(body)
        assert get_bytes(s, b"pages") == body
        assert s.stats()["tiers"][0]["used_bytes"] == 5 * PAGE  # the room: one page more, past the object
    finally:
        s.close()


def test_a_kvsum64_blob_travels_with_its_store_checksum_and_is_verified_by_its_xxh3(tmp_path):
    import xxhash

    from kvstore import checksums as cks
    from kvstore import format as fmt
    from kvstore.format import checksum

    t = {"k": torch.arange(3 * 33, dtype=torch.float16).reshape(3, 33)}
    plan = fmt.plan_blob(t, fingerprint="fp", token_count=3)
    blob = bytearray(plan.total_size)
    fmt.write_blob(blob, plan, t, algorithm=cks.KVSUM64)
    blob = bytes(blob)
    remote, [(s1, _), (s2, _)] = _pair(tmp_path)
    try:
        put(s1, b"blob", blob)
        _drain(s1)
        h = decode_trailer(memoryview(remote.objects[remote_name("kvstore", b"blob")]), b"blob")
        assert h.checksum == checksum(blob) and h.transfer_checksum == xxhash.xxh3_64_intdigest(blob)
        assert h.checksum != h.transfer_checksum  # two algorithms: the store's kvsum64, the transfer's xxh3
        assert get_bytes(s2, b"blob") == blob
        assert s2.object_info(b"blob").checksum == checksum(blob)  # adopted with the store checksum
    finally:
        s1.close()
        s2.close()


def test_a_corrupted_remote_object_is_dropped_and_counted_never_served(tmp_path):
    remote, [(s1, _), (s2, a2)] = _pair(tmp_path)
    try:
        put(s1, b"k", data(2 * PAGE, 4))
        _drain(s1)
        a2.faults.corrupt_gets = True  # one payload byte flipped on the way
        assert s2.lookup([b"k"])[0].hit is False
        assert get_bytes(s2, b"k") is None
        r = _remote_stats(s2)
        assert r["corrupt_dropped"] >= 1 and r["hits"] == 0
        deadline = time.monotonic() + 5
        while remote_name("kvstore", b"k") in remote.objects and time.monotonic() < deadline:
            time.sleep(0.01)
        assert remote_name("kvstore", b"k") not in remote.objects  # dropped from the remote store
        assert s2.stats()["tiers"][0]["used_bytes"] == 0  # the fill's slot was freed
    finally:
        s1.close()
        s2.close()


def test_a_short_or_foreign_remote_object_is_never_visible(tmp_path):
    remote, [(s1, a1), (s2, _)] = _pair(tmp_path)
    try:
        a1.faults.truncate_puts = 100  # the writer's object ends 100 bytes short
        put(s1, b"short", data(2 * PAGE, 5))
        _drain(s1)
        assert s2.lookup([b"short"])[0].hit is False
        # an object under our key written by someone else (wrong key in its header)
        a1.faults.truncate_puts = 0
        put(s1, b"other", data(PAGE, 6))
        _drain(s1)
        remote.objects[remote_name("kvstore", b"victim")] = remote.objects[remote_name("kvstore", b"other")]
        assert s2.lookup([b"victim"])[0].hit is False
        assert _remote_stats(s2)["corrupt_dropped"] == 2
    finally:
        s1.close()
        s2.close()


def test_an_unreachable_remote_store_costs_one_bounded_wait_then_none_and_reconnects(tmp_path):
    faults = RemoteFaults()
    _, [(s1, _), (s2, a2)] = _pair(tmp_path, faults=faults, timeout=0.5)
    try:
        put(s1, b"k", data(PAGE, 7))
        _drain(s1)
        put(s2, b"local", data(PAGE, 8))
        _drain(s2)
        faults.down = True
        t0 = time.monotonic()
        assert s2.lookup([b"k"])[0].hit is False  # the first failure marks it unreachable
        calls = a2.injected["unreachable"]
        assert calls >= 1
        assert s2.lookup([b"k"])[0].hit is False  # then: no remote call at all
        assert a2.injected["unreachable"] == calls
        assert time.monotonic() - t0 < 2.0  # far below two timeouts (1 s each)
        assert get_bytes(s2, b"local") == data(PAGE, 8)  # local tiers keep serving
        r = _remote_stats(s2)
        assert r["reachable"] is False and r["errors"] >= 1 and r["lookups_skipped_unreachable"] >= 1
        put(s2, b"written-while-down", data(PAGE, 9))
        _drain(s2)
        assert _remote_stats(s2)["put_skipped_unreachable"] == 1
        faults.down = False
        deadline = time.monotonic() + 5
        while not _remote_stats(s2)["reachable"] and time.monotonic() < deadline:
            time.sleep(0.02)
        r = _remote_stats(s2)
        assert r["reachable"] is True and r["reconnects"] == 1
        assert get_bytes(s2, b"k") == data(PAGE, 7)
    finally:
        s1.close()
        s2.close()


def test_a_slow_remote_store_times_out_within_the_bound_then_fails_fast_and_recovers(tmp_path):
    faults = RemoteFaults()
    _, [(s1, _), (s2, a2)] = _pair(tmp_path, faults=faults, timeout=0.2)
    try:
        put(s1, b"k", data(PAGE, 10))
        _drain(s1)
        faults.delay_s = 1.0  # every call (and the probe) takes 1 s: a hung master
        t0 = time.monotonic()
        assert s2.lookup([b"k"])[0].hit is False
        assert time.monotonic() - t0 < 0.8  # one bounded wait (0.2 s), not the 1 s call
        r = _remote_stats(s2)
        assert r["timeouts"] == 1 and r["reachable"] is False  # suspected after the timeout
        calls = a2.injected["delays"]
        assert s2.lookup([b"k"])[0].hit is False  # fails fast: no remote call, no wait
        assert a2.injected["delays"] == calls and _remote_stats(s2)["lookups_skipped_unreachable"] >= 1
        faults.delay_s = 0.0
        deadline = time.monotonic() + 10
        while not _remote_stats(s2)["reachable"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert get_bytes(s2, b"k") == data(PAGE, 10)  # back once the probe answered
        time.sleep(1.2)  # the late calls end; their results go nowhere, their buffers are freed
        s2.delete([b"k"])
        assert s2.stats()["tiers"][0]["used_bytes"] == 0
    finally:
        s1.close()
        s2.close()


def test_the_policy_decides_what_is_written(tmp_path):
    remote, [(s1, _), (s2, _)] = _pair(tmp_path, policy="cost:0.1")
    try:
        put(s1, b"cheap", data(PAGE, 11), cost=0.01)
        put(s1, b"dear", data(PAGE, 12), cost=0.5)
        _drain(s1)
        assert set(remote.objects) == {remote_name("kvstore", b"dear")}
        assert _remote_stats(s1)["put_skipped_policy"] == 1
    finally:
        s1.close()
        s2.close()
    assert isinstance(parse_policy("all"), WriteAll) and isinstance(parse_policy("NONE"), WriteNone)
    assert parse_policy("cost:0.25") == CostThreshold(0.25)
    for bad in ("some", "cost:", "cost:-1", "cost:nan"):
        with pytest.raises(InvalidRequest, match="remote_policy"):
            parse_policy(bad)
    with pytest.raises(InvalidRequest, match="remote_policy"):
        Store(make_settings(tmp_path / "x", remote_policy="bogus"), remote_adapter=MemoryAdapter())


def test_nvme_tier_objects_are_written_through_a_staging_copy(tmp_path):
    remote, [(s1, _), (s2, _)] = _pair(tmp_path)
    try:
        put(s1, b"on-disk", data(2 * PAGE, 13), tier="nvme")
        _drain(s1)
        assert get_bytes(s2, b"on-disk") == data(2 * PAGE, 13)
        assert s2.object_info(b"on-disk").tier == "cpu"
    finally:
        s1.close()
        s2.close()


def test_a_remote_tier_needs_a_cpu_tier(tmp_path):
    s = Store(make_settings(tmp_path, cpu_capacity=0), remote_adapter=MemoryAdapter())
    with pytest.raises(InvalidRequest, match="CPU tier"):
        s.open()
    s.close()


def test_adapter_results_are_delivered_exactly_once(tmp_path):
    import torch

    a = MemoryAdapter()
    try:
        src = torch.arange(100, dtype=torch.uint8)
        tid = a.submit_put([PutItem("x", ((src.data_ptr(), 100),))])
        res = a.wait(tid, 5)
        assert res.ok and res.codes == (100,)
        with pytest.raises(RemoteError):
            a.wait(tid, 0)
        dst = torch.zeros(100, dtype=torch.uint8)
        tid = a.submit_get([GetItem("x", ((dst.data_ptr(), 40), (dst.data_ptr() + 40, 60))),
                            GetItem("y", ((dst.data_ptr(), 100),))])
        got = []
        a.add_done_callback(tid, got.append)
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got[0].codes == (100, NOT_FOUND) and got[0].ok
        assert torch.equal(dst, src)
        with pytest.raises(RemoteError):
            a.poll(tid)
    finally:
        a.close()


def test_the_envelope_trailer_round_trips_and_rejects_damage():
    import xxhash

    meta = ObjectMeta("fp", 12, 0.5, {"kind": "pic-signature"})
    payload = os.urandom(1000)
    xsum = xxhash.xxh3_64_intdigest(payload)
    obj = bytearray(payload + encode_trailer(b"key", meta, 1000, 0xABC, xsum))
    got = verify_object(memoryview(obj), b"key")
    assert got.meta == meta and got.checksum == 0xABC and got.transfer_checksum == xsum and got.payload_bytes == 1000
    with pytest.raises(BadObject, match="holds key"):
        verify_object(memoryview(obj), b"kez")
    with pytest.raises(BadObject, match="its trailer says"):
        verify_object(memoryview(obj)[1:], b"key")  # a byte short at the front
    with pytest.raises(BadObject, match="bad magic"):
        verify_object(memoryview(obj)[:-10], b"key")  # cut short: no trailer at the end
    with pytest.raises(BadObject, match="shorter than"):
        verify_object(memoryview(obj)[:FOOTER_BYTES - 1], b"key")
    for at, why in ((len(obj) - 20, "trailer checksum"), (len(obj) - FOOTER_BYTES - 2, "trailer checksum"),
                    (0, "payload hashes"), (999, "payload hashes")):
        bad = bytearray(obj)
        bad[at] ^= 1  # one flipped bit anywhere: in the trailer's fields, the meta, the payload
        with pytest.raises(BadObject, match=why):
            verify_object(memoryview(bad), b"key")
    with pytest.raises(BadObject, match="trailer"):
        encode_trailer(b"k" * 5000, meta, 1, 0, 0)
    assert remote_name("ns", b"\x01\x02") == "ns/0102"
    assert remote_name("ns", b"x" * 65).startswith("ns/h") and len(remote_name("ns", b"x" * 65)) == 4 + 64


def test_object_ranges_use_tail_room_and_a_kvsum_blob_gets_an_xxh3_transfer_checksum():
    import struct

    import torch
    import xxhash

    from kvstore.checksums import BLOB_MAGIC, KVSUM64
    from kvstore.remote.tier import object_ranges

    meta = ObjectMeta("fp", 1, 0.0, {})
    body = torch.frombuffer(bytearray(os.urandom(3000)), dtype=torch.uint8)
    # no room: the payload, then the trailer as a second range
    ranges, keep = object_ranges(b"k", meta, xxhash.xxh3_64_intdigest(body.numpy()), body.data_ptr(), 3000)
    assert len(ranges) == 2 and ranges[0] == (body.data_ptr(), 3000)
    two = _joined(ranges)
    assert verify_object(memoryview(two), b"k").payload_bytes == 3000
    # room after the bytes (a page-rounded slot): one range, the trailer written there
    room = torch.zeros(4096, dtype=torch.uint8)
    room[:3000] = body
    ranges, keep = object_ranges(b"k", meta, xxhash.xxh3_64_intdigest(body.numpy()), room.data_ptr(), 3000, 4096)
    assert ranges == ((room.data_ptr(), len(two)),) and bytes(room[: len(two)].numpy()) == two
    assert bytes(room[len(two):].numpy()) == bytes(4096 - len(two))  # nothing written past the trailer
    # room too small for the trailer: two ranges, nothing written past the payload
    room[3000:] = 0
    ranges, keep = object_ranges(b"k", meta, xxhash.xxh3_64_intdigest(body.numpy()), room.data_ptr(), 3000, 3010)
    assert len(ranges) == 2 and _joined(ranges) == two and bytes(room[3000:].numpy()) == bytes(1096)
    # a kvsum64 blob: the store checksum is recorded as given, readers verify an xxh3 of the bytes
    blob = bytearray(os.urandom(3000))
    blob[:16] = struct.pack("<8sHHI", BLOB_MAGIC, 1, KVSUM64, 0)
    bt = torch.frombuffer(blob, dtype=torch.uint8)
    ranges, keep = object_ranges(b"b", meta, 0x1234, bt.data_ptr(), 3000)
    h = verify_object(memoryview(_joined(ranges)), b"b")
    assert h.checksum == 0x1234 and h.transfer_checksum == xxhash.xxh3_64_intdigest(bytes(blob))


def test_object_ranges_through_a_memoryview_extent_use_the_trailer_made_in_advance_only_where_it_holds():
    import struct

    import xxhash

    from kvstore.checksums import BLOB_MAGIC, KVSUM64
    from kvstore.remote.tier import object_ranges

    meta = ObjectMeta("fp", 1, 0.0, {})
    payload = os.urandom(3000)
    xsum = xxhash.xxh3_64_intdigest(payload)
    slot = torch.zeros(4096, dtype=torch.uint8)
    slot[:3000] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    ext = memoryview(slot.numpy())
    made = encode_trailer(b"k", meta, 3000, xsum, xsum)
    # an xxh3 object with room: the made trailer written through the view, one range, as the ctypes path makes it
    ranges, keep = object_ranges(b"k", meta, xsum, slot.data_ptr(), 3000, 4096, None, made, ext)
    assert ranges == ((slot.data_ptr(), 3000 + len(made)),) and keep is None
    assert bytes(ext[:3000 + len(made)]) == payload + made and not any(ext[3000 + len(made):])
    assert verify_object(ext[:3000 + len(made)], b"k").checksum == xsum
    # no room: the same trailer as a second range
    ranges, keep = object_ranges(b"k", meta, xsum, slot.data_ptr(), 3000, 3000, None, made, ext[:3000])
    assert len(ranges) == 2 and _joined(ranges) == payload + made
    # a kvsum64 blob: the made trailer (store checksum as transfer checksum) is not used
    blob = bytearray(os.urandom(3000))
    blob[:16] = struct.pack("<8sHHI", BLOB_MAGIC, 1, KVSUM64, 0)
    slot[:3000] = torch.frombuffer(blob, dtype=torch.uint8)
    wrong = encode_trailer(b"b", meta, 3000, 0x1234, 0x1234)
    ranges, keep = object_ranges(b"b", meta, 0x1234, slot.data_ptr(), 3000, 4096, None, wrong, ext)
    h = verify_object(memoryview(_joined(ranges)), b"b")
    assert h.checksum == 0x1234 and h.transfer_checksum == xxhash.xxh3_64_intdigest(bytes(blob))
    # objects shorter than a blob header are raw bytes
    ranges, keep = object_ranges(b"s", meta, xxhash.xxh3_64_intdigest(b"tiny"), slot.data_ptr(), 4, 4096, None,
                                 None, ext)
    slot[:4] = torch.frombuffer(bytearray(b"tiny"), dtype=torch.uint8)
    assert verify_object(memoryview(_joined(ranges)), b"s").payload_bytes == 4


def test_a_trailer_made_at_offer_is_used_only_for_the_object_it_was_made_for(tmp_path):
    from kvstore.remote.tier import _Made

    remote, [(s1, _), (s2, _)] = _pair(tmp_path)
    try:
        body = data(3 * PAGE + 100, 5)
        put(s1, b"k", body)  # the commit offers it with its checksum: the writer uses the made trailer
        _drain(s1)
        h = verify_object(memoryview(remote.objects[remote_name("kvstore", b"k")]), b"k")
        info = s1.object_info(b"k")
        assert h.checksum == h.transfer_checksum == info.checksum and h.payload_bytes == len(body)
        # a made trailer for other bytes (a stale checksum, as if the key had been replaced): not used
        del remote.objects[remote_name("kvstore", b"k")]
        meta = ObjectMeta(info.meta.fingerprint, info.meta.token_count, info.meta.cost, dict(info.meta.extra))
        stale = _Made(info.meta, trailer_body(b"k", info.meta), len(body), info.checksum ^ 1,
                      encode_trailer(b"k", meta, len(body), info.checksum ^ 1, info.checksum ^ 1))
        s1._remote.write([b"k"], {b"k": stale})
        h = verify_object(memoryview(remote.objects[remote_name("kvstore", b"k")]), b"k")
        assert h.checksum == info.checksum and h.meta == meta
        assert get_bytes(s2, b"k") == body
    finally:
        s1.close()
        s2.close()


def _joined(ranges):
    """The bytes a put of these (address, length) ranges sends."""
    return b"".join(ctypes.string_at(a, n) for a, n in ranges)


def test_mooncake_urls_parse_and_bad_ones_name_the_problem():
    t = MooncakeTarget.from_url("mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/metadata&protocol=tcp")
    assert t.master == "127.0.0.1:50051" and t.metadata == "http://127.0.0.1:8080/metadata"
    assert t.protocol == "tcp" and t.local_hostname == "127.0.0.1" and t.segment_bytes == 256 << 20
    t = MooncakeTarget.from_url("mooncake://10.0.0.5:1234?segment=1GiB&namespace=prod&host=10.0.0.9")
    assert t.metadata == "http://10.0.0.5:8080/metadata" and t.segment_bytes == 1 << 30
    assert t.namespace == "prod" and t.local_hostname == "10.0.0.9"
    for url, what in (("redis://h:1", "scheme"), ("mooncake://h", "MASTER_HOST:PORT"),
                      ("mooncake://h:1?protocol=udp", "protocol"), ("mooncake://h:1?foo=1", "unknown parameter"),
                      ("mooncake://h:1?segment=lots", "segment"), ("mooncake://h:1?namespace=a/b", "namespace")):
        with pytest.raises(InvalidRequest, match=what):
            MooncakeTarget.from_url(url)


def test_a_bad_remote_url_is_refused_before_the_store_opens(tmp_path):
    with pytest.raises(InvalidRequest, match="MASTER_HOST:PORT"):
        Store(make_settings(tmp_path, remote_url="mooncake://127.0.0.1?protocol=tcp"))
    with pytest.raises(InvalidRequest, match="unknown scheme 'redis'"):
        Store(make_settings(tmp_path, remote_url="redis://127.0.0.1:6379"))


def test_stats_of_a_store_without_a_remote_tier_have_the_same_remote_keys(tmp_path):
    s = Store(make_settings(tmp_path))
    s.open()
    try:
        r = s.stats()["remote"]
        assert r["enabled"] is False and r["url"] == "" and r["reachable"] is False
        assert {"hits", "misses", "errors", "objects_written", "bytes_written", "get_latency"} <= set(r)
    finally:
        s.close()


class _LateCluster:
    """Stands in for Mooncake's client class: setup fails until `joins_after` attempts
    were made (a master that is not up yet), then joins; the cluster holds nothing."""

    attempts = 0
    joins_after = 2

    def setup(self, *args):
        type(self).attempts += 1
        return 0 if type(self).attempts > type(self).joins_after else -1

    def batch_is_exist(self, names):
        return [0] * len(names)

    def close(self):
        pass


def test_a_mooncake_adapter_started_before_its_master_serves_unreachable_then_joins():
    from kvstore.remote.mooncake import MooncakeAdapter

    _LateCluster.attempts = 0
    a = MooncakeAdapter(MooncakeTarget.from_url("mooncake://127.0.0.1:1"), probe_interval_s=0.02,
                        connect_wait_s=1.0, client_class=_LateCluster)
    try:
        assert a.reachable() is False  # the daemon starts anyway
        res = a.wait(a.submit_stat(["kvstore/x"]), 1)
        assert not res.ok and res.codes[0] < 0 and res.seconds == 0.0  # fails at once, no wait
        deadline = time.monotonic() + 10
        while not a.reachable() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert a.reachable() and a.join_failures == 2 and a.stats()["reconnects"] == 1
        assert a.wait(a.submit_stat(["kvstore/x"]), 1).codes == (NOT_FOUND,)
    finally:
        a.close()


def test_the_remote_options_come_from_flags_env_and_toml(tmp_path):
    from kvstore.config import load_config
    from kvstore.server.daemon import store_settings

    url = "mooncake://10.1.2.3:50051?metadata=http://10.1.2.3:8080/metadata&protocol=tcp"
    toml = tmp_path / "c.toml"
    toml.write_text(f'remote = "{url}"\nremote_policy = "cost:0.05"\n')
    c = load_config(config_file=toml, env={"KVSTORE_REMOTE_TIMEOUT": "0.5"})
    assert (c.remote, c.remote_policy, c.remote_timeout) == (url, "cost:0.05", 0.5)
    assert c.sources["remote"].startswith("file:") and c.sources["remote_timeout"] == "env:KVSTORE_REMOTE_TIMEOUT"
    s = store_settings(c, cuda_available=lambda: False)
    assert (s.remote_url, s.remote_policy, s.remote_timeout_s) == (url, "cost:0.05", 0.5)
    c = load_config(cli={"remote": "mooncake://h:1"}, config_file=toml, env={"KVSTORE_REMOTE": url})
    assert c.remote == "mooncake://h:1" and c.sources["remote"] == "flag:--remote"
    assert load_config(env={}, config_file=os.devnull).remote == ""


def test_the_mooncake_url_takes_an_rpc_timeout_and_a_read_chunk():
    t = MooncakeTarget.from_url("mooncake://127.0.0.1:5?rpc_timeout=0.25")
    assert t.rpc_timeout_s == 0.25 and MooncakeTarget.from_url("mooncake://h:5").rpc_timeout_s == 1.0
    for bad, why in (("x", "must be seconds"), ("0", "0.01..600")):
        with pytest.raises(RemoteConfigError, match=why):
            MooncakeTarget.from_url(f"mooncake://h:5?rpc_timeout={bad}")
    assert MooncakeTarget.from_url("mooncake://h:5").read_chunk_bytes == 8 << 20
    assert MooncakeTarget.from_url("mooncake://h:5?read_chunk=0").read_chunk_bytes == 0
    with pytest.raises(RemoteConfigError, match="read_chunk must be 0"):
        MooncakeTarget.from_url("mooncake://h:5?read_chunk=1000")


def test_the_mooncake_url_takes_a_read_split_and_pieces_follow_it():
    from kvstore.remote.mooncake import piece_bytes

    t = MooncakeTarget.from_url("mooncake://h:5")
    assert (t.read_split_bytes, t.read_chunk_bytes) == (3 << 20, 8 << 20)
    assert MooncakeTarget.from_url("mooncake://h:5?read_split=8MiB").read_split_bytes == 8 << 20
    with pytest.raises(RemoteConfigError, match="read_split must be at least 64KiB"):
        MooncakeTarget.from_url("mooncake://h:5?read_split=1000")
    mib, trailer = 1 << 20, 114
    split, chunk = t.read_split_bytes, t.read_chunk_bytes
    assert piece_bytes(mib + trailer, chunk, split) == mib + trailer  # within read_split: one get
    four = 4 * mib + trailer  # over read_split, within read_chunk: two even pieces
    assert piece_bytes(four, chunk, split) == 2 * mib + 4096 and 2 * (2 * mib + 4096) >= four
    sixteen = 16 * mib + trailer  # over read_chunk: as many as read_chunk needs (three), as before
    assert piece_bytes(sixteen, chunk, split) == piece_bytes(sixteen, chunk) == 5595136
    assert piece_bytes(four, chunk, 8 * mib) == four  # read_split 8MiB: the former rule
    assert piece_bytes(four, 0, split) == four  # read_chunk 0: never in pieces
    assert piece_bytes(300 << 10, 64 << 10, split) == 60 << 10  # read_chunk below read_split decides
