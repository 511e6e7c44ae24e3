"""Request validation and record <-> message conversion for the kvstore RPCs.

Owns: the checks every request passes before it reaches the Store (key count and length,
tier names, sizes, JSON metadata, timeouts), raising InvalidRequest with a message that
names the bad value, and the conversions between the Store's records and the
proto messages in both directions (the client library uses the same functions).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

from kvstore import records as st
from kvstore.errors import InvalidRequest
from kvstore.rpc import kvstore_pb2 as pb
from kvstore.tiers.registry import TIERS

MAX_EXTRA_JSON_BYTES = 64 << 10
MAX_EXTRA_DEPTH = 32  # nesting of arrays/objects in meta.extra_json
EXTRA_INT_RANGE = (-(1 << 63), (1 << 64) - 1)  # what the index's msgpack records hold
MAX_WAIT_S = 300.0
MAX_CLIENT_ID = 256


@dataclass(frozen=True)
class Limits:
    """What the daemon accepts; `tiers` are the enabled tiers, fastest first."""

    max_batch: int
    max_key_bytes: int
    tiers: tuple[str, ...]
    default_tier: str
    list_limit: int = 100_000
    max_message_bytes: int = 16 << 20


def _key_repr(key: bytes) -> str:
    text = key[:48]
    shown = text.decode() if text.isascii() and text.decode().isprintable() else text.hex()
    return repr(shown + ("..." if len(key) > 48 else ""))


def check_key(key: bytes, limits: Limits) -> bytes:
    if not key:
        raise InvalidRequest("empty key: keys must be 1 or more bytes")
    if len(key) > limits.max_key_bytes:
        raise InvalidRequest(f"key {_key_repr(key)} is {len(key)} bytes, over the limit of {limits.max_key_bytes}")
    return bytes(key)


def check_keys(keys: Sequence[bytes], limits: Limits) -> list[bytes]:
    if len(keys) > limits.max_batch:
        raise InvalidRequest(f"batch of {len(keys)} keys is over the limit of {limits.max_batch}")
    return [check_key(k, limits) for k in keys]


def check_tier(tier: str, limits: Limits, *, default: Optional[str] = None, what: str = "tier") -> str:
    """A valid, enabled tier name; `default` when empty and a default is given."""
    if not tier:
        if default is None:
            raise InvalidRequest(f"{what} is required; one of: {', '.join(limits.tiers)}")
        return default
    if tier not in TIERS:
        raise InvalidRequest(f"unknown {what} {tier!r}; tiers are: {', '.join(TIERS.names)}")
    if tier not in limits.tiers:
        raise InvalidRequest(f"{what} {tier!r} is not enabled on this daemon (capacity 0); enabled: "
                             f"{', '.join(limits.tiers) or 'none'}")
    return tier


def check_client_id(client_id: str, *, required: bool) -> str:
    if required and not client_id:
        raise InvalidRequest("client_id is required (leases are owned and renewed by it)")
    if len(client_id) > MAX_CLIENT_ID:
        raise InvalidRequest(f"client_id is {len(client_id)} characters, over the limit of {MAX_CLIENT_ID}")
    return client_id


def check_timeout(timeout_s: float) -> float:
    if not math.isfinite(timeout_s) or timeout_s < 0:
        raise InvalidRequest(f"timeout_s must be a finite number >= 0, got {timeout_s!r}")
    return min(timeout_s, MAX_WAIT_S)


# ------------------------------------------------------------------ records <-> messages


def meta_from_pb(m: pb.ObjectMeta) -> st.ObjectMeta:
    if not math.isfinite(m.cost) or m.cost < 0:
        raise InvalidRequest(f"meta.cost must be a finite number >= 0, got {m.cost!r}")
    extra: dict[str, Any] = {}
    if m.extra_json:
        if len(m.extra_json) > MAX_EXTRA_JSON_BYTES:
            raise InvalidRequest(f"meta.extra_json is {len(m.extra_json)} bytes, over the limit of "
                                 f"{MAX_EXTRA_JSON_BYTES}")
        nesting = _json_nesting(m.extra_json)
        if nesting > MAX_EXTRA_DEPTH:
            raise InvalidRequest(f"meta.extra_json nests {nesting} levels deep, over the limit of {MAX_EXTRA_DEPTH}")
        try:
            extra = json.loads(m.extra_json)
        except (ValueError, RecursionError) as exc:  # ValueError: also an integer of > 4300 digits
            raise InvalidRequest(f"meta.extra_json is not valid JSON: {str(exc)[:200]}") from None
        if not isinstance(extra, dict):
            raise InvalidRequest(f"meta.extra_json must be a JSON object, got {type(extra).__name__}")
        _check_extra_values(extra)
    return st.ObjectMeta(fingerprint=m.fingerprint, token_count=m.token_count, cost=m.cost, extra=extra)


def _json_nesting(text: str) -> int:
    """The deepest bracket nesting of JSON text (brackets inside strings not counted),
    measured before parsing so a deep document never reaches the recursive parser."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _check_extra_values(value: Any, path: str = "meta.extra_json") -> None:
    """InvalidRequest naming the first integer the index cannot store (outside int64 /
    uint64)."""
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        lo, hi = EXTRA_INT_RANGE
        if not lo <= value <= hi:
            digits = len(str(abs(value)))
            raise InvalidRequest(f"{path} holds an integer of {digits} digits, outside the 64-bit range "
                                 f"{lo}..{hi}")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_extra_values(v, f"{path}.{k[:40]}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_extra_values(v, f"{path}[{i}]")


def meta_to_pb(m: st.ObjectMeta) -> pb.ObjectMeta:
    return pb.ObjectMeta(
        fingerprint=m.fingerprint or "",
        token_count=int(m.token_count or 0),
        cost=float(m.cost or 0.0),
        extra_json=json.dumps(m.extra, sort_keys=True, default=str) if m.extra else "",
    )


def region_to_pb(r: st.Region) -> pb.Region:
    return pb.Region(kind=r.kind, path=r.path, offset=r.offset, length=r.length, handle=r.handle)


def region_from_pb(r: pb.Region) -> st.Region:
    return st.Region(kind=r.kind, path=r.path, offset=r.offset, length=r.length, handle=r.handle)


def lookup_entry_to_pb(e: st.LookupEntry) -> pb.LookupEntry:
    return pb.LookupEntry(key=e.key, hit=e.hit, tier=e.tier or "", size=e.size)


def lookup_entry_from_pb(e: pb.LookupEntry) -> st.LookupEntry:
    return st.LookupEntry(key=e.key, hit=e.hit, tier=e.tier or None, size=e.size)


def reservation_to_pb(r: st.Reservation) -> pb.ReserveResponse:
    msg = pb.ReserveResponse(reservation_id=r.reservation_id, key=r.key, tier=r.tier, status=r.status)
    if r.region is not None:
        msg.region.CopyFrom(region_to_pb(r.region))
    return msg


def lease_to_pb(lease: Optional[st.Lease]) -> pb.Lease:
    if lease is None:
        return pb.Lease(found=False)
    return pb.Lease(
        found=True, lease_id=lease.lease_id, key=lease.key, tier=lease.tier,
        region=region_to_pb(lease.region), size=lease.size, checksum=lease.checksum,
        expires_at=lease.expires_at, meta=meta_to_pb(lease.meta),
    )


def lease_from_pb(m: pb.Lease) -> Optional[st.Lease]:
    if not m.found:
        return None
    return st.Lease(
        lease_id=m.lease_id, key=m.key, tier=m.tier, region=region_from_pb(m.region), size=m.size,
        checksum=m.checksum, expires_at=m.expires_at, meta=meta_from_pb(m.meta),
    )


def object_info_to_pb(o: st.ObjectInfo) -> pb.ObjectInfo:
    return pb.ObjectInfo(
        key=o.key, tier=o.tier, size=o.size, checksum=o.checksum, meta=meta_to_pb(o.meta),
        hits=o.hits, last_access=o.last_access, created=o.created, leases=o.leases,
    )


def object_info_from_pb(m: pb.ObjectInfo) -> st.ObjectInfo:
    return st.ObjectInfo(
        key=m.key, tier=m.tier, size=m.size, checksum=m.checksum, meta=meta_from_pb(m.meta),
        hits=m.hits, last_access=m.last_access, created=m.created, leases=m.leases,
    )


def stats_to_pb(s: dict[str, Any]) -> pb.StatsResponse:
    tiers = [
        pb.TierStats(name=t["name"], capacity_bytes=int(t["capacity_bytes"]), used_bytes=int(t["used_bytes"]),
                     objects=int(t.get("objects", 0)))
        for t in s.get("tiers", [])
    ]
    return pb.StatsResponse(
        tiers=tiers, hits=int(s.get("hits", 0)), misses=int(s.get("misses", 0)),
        evictions=int(s.get("evictions", 0)), leases=int(s.get("leases", 0)),
        details_json=json.dumps(s, sort_keys=True, default=str),
    )


def stats_from_pb(m: pb.StatsResponse) -> dict[str, Any]:
    """The daemon's full stats dict (details_json), with the typed fields guaranteed."""
    out: dict[str, Any] = json.loads(m.details_json) if m.details_json else {}
    out["tiers"] = [
        {**next((t for t in out.get("tiers", []) if t.get("name") == ts.name), {}),
         "name": ts.name, "capacity_bytes": ts.capacity_bytes, "used_bytes": ts.used_bytes, "objects": ts.objects}
        for ts in m.tiers
    ]
    out.update(hits=m.hits, misses=m.misses, evictions=m.evictions, leases=m.leases)
    return out


def key_text(key: bytes) -> str:
    """A key for people: its UTF-8 text when printable, else "hex:" + its hex digits."""
    try:
        text = key.decode()
        if text.isprintable():
            return text
    except UnicodeDecodeError:
        pass
    return "hex:" + key.hex()


def key_from_text(text: str) -> bytes:
    """Inverse of key_text: "hex:..." -> those bytes, anything else -> its UTF-8."""
    if text.startswith("hex:"):
        try:
            return bytes.fromhex(text[4:])
        except ValueError:
            raise InvalidRequest(f"key {text!r} starts with 'hex:' but the rest is not hex digits") from None
    return text.encode()


def tiers_enabled(capacities: Iterable[tuple[str, int]]) -> tuple[str, ...]:
    return tuple(name for name, cap in capacities if cap > 0)
