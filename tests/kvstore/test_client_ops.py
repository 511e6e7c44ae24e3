"""kvstore.client.ops: the one client core both faces drive. Each operation is run with a
scripted step handler, blocking (`drive`) and awaiting (`drive_async`): the same steps
come out in the same order, failures thrown into an operation run its cleanup (a put
aborts its reservation), and results are decoded once. The real faces against a real
daemon are covered by test_client_library.py and test_aio_server.py."""
from __future__ import annotations

import asyncio
from typing import Any, Callable

import pytest

from kvstore.client.common import ClientCore
from kvstore.client.ops import Call, ClientOps, Write, drive, drive_async
from kvstore.errors import CapacityExhausted, DaemonNotRunning, StorageError
from kvstore.rpc import kvstore_pb2 as pb


def _ops(tmp_path) -> ClientOps:
    return ClientOps(ClientCore(tmp_path / "kv.sock", None, "cid", 5.0, 1 << 20))


class Script:
    """Answers steps from `replies` (rpc name -> a reply, or a callable of the step
    giving one or raising), recording each step."""

    def __init__(self, replies: dict[str, Any]) -> None:
        self.replies = replies
        self.steps: list[str] = []

    def answer(self, step: Any) -> Any:
        name = step.rpc if isinstance(step, Call) else type(step).__name__
        self.steps.append(name)
        r = self.replies[name]
        return r(step) if callable(r) else r

    async def answer_async(self, step: Any) -> Any:
        await asyncio.sleep(0)
        return self.answer(step)


def _both(make_op: Callable[[], Any], replies: dict[str, Any]) -> tuple[list[tuple[str, Any]], list[str]]:
    """Run a fresh op under both drivers: [(outcome kind, value)] and the steps of each."""
    outcomes, steps = [], []
    for run in (lambda s: drive(make_op(), s.answer), lambda s: asyncio.run(drive_async(make_op(), s.answer_async))):
        script = Script(replies)
        try:
            outcomes.append(("ok", run(script)))
        except Exception as exc:  # noqa: BLE001 - compared below
            outcomes.append(("raised", f"{type(exc).__name__}: {exc}"))
        steps.append(script.steps)
    assert outcomes[0] == outcomes[1] and steps[0] == steps[1], (outcomes, steps)
    return outcomes, steps[0]


def _reserve(status: str) -> pb.ReserveResponse:
    return pb.ReserveResponse(reservation_id=7 if status == "reserved" else 0, status=status, tier="cpu",
                              region=pb.Region(kind="shm", path="/dev/shm/x", offset=0, length=5))


def _commit(step: Call) -> pb.CommitResponse:
    assert step.request.reservation_id == 7 and step.request.checksum == 1234 and step.request.client_id == "cid"
    return pb.CommitResponse(entry=pb.LookupEntry(key=b"k", hit=True, tier="cpu", size=5))


def test_a_put_reserves_writes_and_commits(tmp_path):
    ops = _ops(tmp_path)
    outcomes, steps = _both(lambda: ops.put(b"k", b"hello", None, "", 0, 0.0, None),
                            {"Reserve": _reserve("reserved"), "Write": 1234, "Commit": _commit})
    assert steps == ["Reserve", "Write", "Commit"]
    kind, res = outcomes[0]
    assert kind == "ok" and (res.status, res.tier, res.size, res.checksum) == ("stored", "cpu", 5, 1234)


def test_a_failed_write_aborts_the_reservation_and_raises(tmp_path):
    def broken(step: Write) -> int:
        assert step.size == 5 and step.region.path == "/dev/shm/x"
        raise StorageError("arena gone")

    outcomes, steps = _both(lambda: _ops(tmp_path).put(b"k", b"hello", None, "", 0, 0.0, None),
                            {"Reserve": _reserve("reserved"), "Write": broken, "Abort": pb.AbortResponse()})
    assert steps == ["Reserve", "Write", "Abort"]
    assert outcomes[0] == ("raised", "StorageError: arena gone")


def test_an_abort_that_fails_too_still_raises_the_first_error(tmp_path):
    def gone(step: Call) -> Any:
        raise DaemonNotRunning("the daemon went away")

    outcomes, steps = _both(lambda: _ops(tmp_path).put(b"k", b"hello", None, "", 0, 0.0, None),
                            {"Reserve": _reserve("reserved"), "Write": 1234, "Commit": gone, "Abort": gone})
    assert steps == ["Reserve", "Write", "Commit", "Abort"]
    assert outcomes[0] == ("raised", "DaemonNotRunning: the daemon went away")


def test_a_put_in_flight_elsewhere_waits_and_reports_exists(tmp_path):
    outcomes, steps = _both(lambda: _ops(tmp_path).put(b"k", b"hello", None, "", 0, 0.0, None),
                            {"Reserve": _reserve("in_flight"), "WaitFor": pb.WaitForResponse(present=True)})
    assert steps == ["Reserve", "WaitFor"] and outcomes[0][1].status == "exists"


def test_a_put_whose_other_writer_keeps_aborting_gives_up(tmp_path):
    outcomes, steps = _both(lambda: _ops(tmp_path).put(b"k", b"hello", None, "", 0, 0.0, None),
                            {"Reserve": _reserve("in_flight"), "WaitFor": pb.WaitForResponse(present=False)})
    assert steps == ["Reserve", "WaitFor"] * 8
    assert outcomes[0][0] == "raised" and outcomes[0][1].startswith(f"{CapacityExhausted.__name__}: ")


def test_lookup_uses_the_fast_socket_and_falls_back_to_grpc(tmp_path):
    ops = _ops(tmp_path)
    outcomes, steps = _both(lambda: ops.lookup([b"a", "b"]), {"FastLookup": [("cpu", 3), None]})
    assert steps == ["FastLookup"]
    assert [(e.key, e.hit, e.tier, e.size) for e in outcomes[0][1]] == [(b"a", True, "cpu", 3), (b"b", False, None, 0)]
    grpc_reply = pb.LookupResponse(entries=[pb.LookupEntry(key=b"a", hit=True, tier="nvme", size=9)])
    outcomes, steps = _both(lambda: ops.lookup([b"a"]), {"FastLookup": None, "Lookup": grpc_reply})
    assert steps == ["FastLookup", "Lookup"] and outcomes[0][1][0].tier == "nvme"


def test_releasing_on_a_closed_client_is_skipped_not_an_error(tmp_path):
    ops = _ops(tmp_path)
    seen = []
    drive(ops.release_ids([1, 2]), lambda step: seen.append(step) or None)
    assert len(seen) == 1 and seen[0].if_connected and list(seen[0].request.lease_ids) == [1, 2]


def test_a_get_miss_raises_unknown_key_from_both_faces(tmp_path):
    outcomes, steps = _both(lambda: _ops(tmp_path).get(b"nope", True, False, lambda i: None),
                            {"Get": pb.GetResponse(leases=[pb.Lease(found=False)])})
    assert steps == ["Get"] and outcomes[0][0] == "raised" and "UnknownKey" in outcomes[0][1]


@pytest.mark.parametrize("rpc, make, reply, want", [
    ("Delete", lambda o: o.delete([b"a", "b"]), pb.DeleteResponse(deleted=2), 2),
    ("Evict", lambda o: o.evict("cpu"), pb.EvictResponse(moved=4), 4),
    ("Prefetch", lambda o: o.prefetch([b"a"], None), pb.PrefetchResponse(in_tier=1), 1),
    ("WaitFor", lambda o: o.wait_for(b"a", 1.0), pb.WaitForResponse(present=True), True),
])
def test_simple_calls_decode_their_replies_once(tmp_path, rpc, make, reply, want):
    ops = _ops(tmp_path)
    outcomes, steps = _both(lambda: make(ops), {rpc: reply})
    assert steps == [rpc] and outcomes[0] == ("ok", want)
