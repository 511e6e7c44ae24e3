"""LeaseTable: pins with TTL expiry, renew per client, idempotent release."""

import pytest

from kvstore.errors import InvalidRequest
from kvstore.leases import LeaseTable


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_acquire_pins_and_release_unpins_idempotently():
    lt = LeaseTable(10.0, clock=Clock())
    a = lt.acquire(b"k", "c1")
    b = lt.acquire(b"k", "c2")
    assert lt.count(b"k") == 2 and lt.is_leased(b"k") and len(lt) == 2 and a.lease_id != b.lease_id
    assert lt.release(a.lease_id) is a
    assert lt.release(a.lease_id) is None
    lt.release(b.lease_id)
    assert not lt.is_leased(b"k") and len(lt) == 0


def test_leases_expire_after_ttl_unless_renewed():
    clock = Clock()
    lt = LeaseTable(10.0, clock=clock)
    dead = lt.acquire(b"a", "dead")
    alive = lt.acquire(b"b", "alive")
    clock.t += 8
    assert lt.renew("alive") == 1
    clock.t += 5  # 13s after acquire; "alive" renewed at 8s
    expired = lt.expire()
    assert [e.lease_id for e in expired] == [dead.lease_id]
    assert lt.get(alive.lease_id) is not None and not lt.is_leased(b"a")
    clock.t += 10
    assert [e.lease_id for e in lt.expire()] == [alive.lease_id] and len(lt) == 0


def test_keep_callback_holds_a_lease_past_its_expiry():
    clock = Clock()
    lt = LeaseTable(1.0, clock=clock)
    e = lt.acquire(b"a", "c", payload="busy")
    clock.t += 5
    assert lt.expire(keep=lambda x: x.payload == "busy") == []
    e.payload = "done"
    clock.t += 5
    assert lt.expire(keep=lambda x: x.payload == "busy") == [e]


def test_non_positive_ttl_is_rejected():
    with pytest.raises(InvalidRequest, match="ttl"):
        LeaseTable(0)
