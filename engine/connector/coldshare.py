"""Sharing the cold segments of one request with idle engines, through the daemon.

A request with several cold segments (missing in the store, claimed by nobody) is
prefilled faster when idle engines compute some of its segments' signatures while its
own engine computes the others: a signature is computed alone, behind the anchor, so it
does not depend on where in the prompt, or on which engine, it is computed. No new RPC
is needed; the daemon's objects, key prefixes, List and the in-flight claims carry it:

1. *Offer* (requesting engine, in its miss step): it keeps its first cold segments
   (`own_share`: about `share_keep` of the cold tokens) and publishes one small
   *wanted record* per further cold segment (`publish`, on this
   module's thread: the request never waits for it): key `WANTED_TAG + segment key`,
   record fingerprint = the model fingerprint, bytes = the segment's token ids (uint32
   little endian), `meta.extra` = `split`, its `index` among the offered segments, the
   `requester` (a per-connector id), the request id and `expires` (wall-clock seconds).
2. *Take* (idle engine, `take`): lists the wanted records of its model (at most one
   List every `share_poll_s`), skips its own and expired ones (deleting the latter),
   takes the oldest request's highest-index segment first (the requester computes from
   the lowest), and claims the segment through the ordinary in-flight claim. A claim
   that is not won (the requester or another helper holds it; it landed already) moves
   on to the next record. A won claim: the record's token ids are read, the record is
   deleted, and the caller (engine.pic.planner's idle work) checks that the key it derives
   from them equals the segment key, computes the signature and stores it under the
   claim (waiters wake once it is stored). `take_many(max_tokens)` goes on claiming
   while the taken segments' tokens stay within the budget, for one packed alone pass.
3. *Collect* (requesting engine): computes its kept segments (packed passes of at most
   `share_pack_tokens`), then claims and computes, in one more pass, every offered
   segment no helper took; a segment a helper claimed answers INFLIGHT and is waited
   for after its own (bounded by `share_wait_s`; then computed here). A helper
   that dies mid-compute loses its claim when its reservation expires (daemon lease
   TTL), which wakes the waiter, who computes the segment itself: never slower than
   alone by more than that bound, nothing lost. Its records are withdrawn (deleted)
   afterwards.

Counted in the connector metrics: `cold_offered` (records published), `cold_offloaded`
(offered segments another engine computed while this one waited), `cold_wait_ms_total`
(time waited for them), `cold_helped` (segments computed for other engines' requests),
`cold_help_ms_total`, `cold_rejected` (records whose token ids do not give their key).

Thread-safety: `publish`/`withdraw` may be called from the engine loop; they run on one
background thread in call order. `take` is called from the engine loop when idle.
"""
from __future__ import annotations

import array
import logging
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from engine.connector.claims import OWNED, PRESENT, Claim
from engine.connector.config import StoreConnectorConfig
from engine.connector.errors import StoreUnavailable
from engine.connector.link import StoreLink
from engine.connector.metrics import ConnectorMetrics
from kvstore.errors import KVStoreError

log = logging.getLogger("engine.connector")

WANTED_TAG = b"kvengine-wanted-v1\x00"
RECORD_KIND = "kvengine-wanted"
LIST_LIMIT = 256  # wanted records looked at per poll


def wanted_key(key: bytes) -> bytes:
    """The daemon key of the wanted record of segment `key`."""
    return WANTED_TAG + key


@dataclass(frozen=True)
class ColdSegment:
    """One cold segment a request offers: its key, content token ids and seam split."""

    key: bytes
    token_ids: tuple[int, ...]
    split: int


@dataclass(frozen=True)
class WantedSegment:
    """A wanted record another engine published (module docstring)."""

    key: bytes  # the segment key
    token_ids: tuple[int, ...]
    split: int
    index: int
    requester: str
    request_id: str
    expires: float


def own_share(tokens: Sequence[int], keep: float) -> int:
    """How many of a request's first cold segments (token counts in order) its own engine
    keeps: the fewest holding at least `keep` of their tokens, one at least and all but
    one at most (StoreConnectorConfig.share_keep); the rest are offered."""
    if len(tokens) < 2:
        return len(tokens)
    want, held = keep * sum(tokens), 0
    for i, n in enumerate(tokens[:-1]):
        held += n
        if held >= want:
            return i + 1
    return len(tokens) - 1


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    a = array.array("I", (int(t) for t in token_ids))
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        a.byteswap()
    return a.tobytes()


def decode_tokens(data: bytes) -> tuple[int, ...]:
    if len(data) % 4:
        raise ValueError(f"wanted record of {len(data)} bytes is not a sequence of uint32 token ids")
    a = array.array("I")
    a.frombytes(data)
    if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
        a.byteswap()
    return tuple(a)


class ClaimingCache(Protocol):
    """What `ColdShare` uses of the signature cache that owns it (StoreSignatureCache)."""

    config: StoreConnectorConfig
    metrics: ConnectorMetrics
    fingerprint: str
    link: StoreLink

    @property
    def available(self) -> bool: ...

    def claim(self, key: bytes) -> Claim: ...

    def release(self, key: bytes) -> None: ...

    def drop_claim(self, claim: Optional[Claim]) -> None: ...


class ColdShare:
    """Offering and taking cold segments through the daemon (module docstring)."""

    def __init__(self, cache: ClaimingCache) -> None:
        self.cache = cache
        self.config = cache.config
        self.metrics = cache.metrics
        self.fingerprint = cache.fingerprint
        self.requester = uuid.uuid4().hex[:16]
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvconn-share")
        self._next_poll = 0.0
        self._closed = False

    # ------------------------------------------------------------------ requester
    def publish(self, request_id: str, segments: Sequence[ColdSegment]) -> list[bytes]:
        """Offer `segments` (index = position in the list) to idle engines, on the
        background thread. Returns the record keys (for `withdraw`)."""
        if not segments or self._closed:
            return []
        expires = time.time() + self.config.share_wait_s
        records = [(wanted_key(s.key), encode_tokens(s.token_ids),
                    {"kind": RECORD_KIND, "split": int(s.split), "index": i, "requester": self.requester,
                     "request": str(request_id)[:200], "expires": expires, "tokens": len(s.token_ids)})
                   for i, s in enumerate(segments)]
        self._pool.submit(self._publish, records)
        return [r[0] for r in records]

    def _publish(self, records: list) -> None:
        try:
            kv = self.cache.link.client()
            tier = "cpu" if kv.info is not None and "cpu" in kv.info.tiers else None
            for key, data, extra in records:
                self.cache.link.call("share", lambda c: c.put(key, data, tier=tier, fingerprint=self.fingerprint,
                                                              token_count=extra["tokens"], extra=extra))
                self.metrics.inc("cold_offered")
        except (StoreUnavailable, KVStoreError) as exc:
            log.debug("offering cold segments failed: %s", exc)  # the requester computes them itself
        except Exception:  # never into the engine
            log.exception("offering cold segments failed")

    def withdraw(self, record_keys: Sequence[bytes]) -> None:
        """Delete published records (taken ones are gone already), on the background thread."""
        if record_keys and not self._closed:
            self._pool.submit(self._delete, list(record_keys))

    def _delete(self, keys: list[bytes]) -> None:
        try:
            self.cache.link.call("share", lambda c: c.delete(keys))
        except (StoreUnavailable, KVStoreError):
            pass  # a stale record expires for helpers (`expires`) and is deleted by the next one to see it
        except Exception:
            log.exception("withdrawing cold segment offers failed")

    def settle(self, timeout: float = 10.0) -> None:
        """Wait until every publish/withdraw queued so far ran (tests, shutdown)."""
        self._pool.submit(lambda: None).result(timeout)

    # ------------------------------------------------------------------ helper
    def take(self) -> Optional[tuple[WantedSegment, Claim]]:
        """One offered segment of another engine, claimed by this one, or None (nothing
        offered, not yet time to poll, daemon away). The caller computes and stores it
        with the claim, or drops the claim (`cache.drop_claim`)."""
        taken = self.take_many(0)
        return taken[0] if taken else None

    def take_many(self, max_tokens: int) -> list[tuple[WantedSegment, Claim]]:
        """Offered segments of other engines, claimed by this one, in `take`'s order, while
        their tokens stay within `max_tokens` (at least one when any is offered): the
        caller computes them in one packed pass. Empty when nothing is offered, it is not
        yet time to poll, or the daemon is away. Each is stored with its claim, or its
        claim dropped."""
        now = time.monotonic()
        if self._closed or now < self._next_poll or not self.cache.available:
            return []
        self._next_poll = now + self.config.share_poll_s
        try:
            objs = self.cache.link.call("share", lambda c: c.list(fingerprint=self.fingerprint, prefix=WANTED_TAG,
                                                                  limit=LIST_LIMIT))
        except (StoreUnavailable, KVStoreError):
            return []
        wall = time.time()
        offers, stale = [], []
        for o in objs:
            extra = o.meta.extra or {}
            if extra.get("kind") != RECORD_KIND or extra.get("requester") == self.requester:
                continue
            if float(extra.get("expires", 0)) < wall:
                stale.append(o.key)
                continue
            offers.append((o.created, -int(extra.get("index", 0)), o))
        if stale:
            self._delete(stale)
        taken: list[tuple[WantedSegment, Claim]] = []
        tokens = 0
        for _, _, o in sorted(offers, key=lambda t: (t[0], t[1])):
            n = int((o.meta.extra or {}).get("tokens", 0))
            if taken and tokens + n > max_tokens:
                break
            seg_key = o.key[len(WANTED_TAG):]
            claim = self.cache.claim(seg_key)
            if claim.status == PRESENT:  # computed already: the offer is moot
                self.cache.release(seg_key)
                self._delete([o.key])
                continue
            if claim.status != OWNED:
                continue  # the requester or another helper computes it (or the daemon is away)
            wanted = self._read(o, seg_key)
            self._delete([o.key])
            if wanted is None:
                self.cache.drop_claim(claim)
                continue
            taken.append((wanted, claim))
            tokens += len(wanted.token_ids)
        return taken

    def _read(self, info, seg_key: bytes) -> Optional[WantedSegment]:
        extra = info.meta.extra
        try:
            views = self.cache.link.call("share", lambda c: c.get_many([info.key], promote=False))
        except (StoreUnavailable, KVStoreError):
            return None
        view = views[0]
        if view is None:  # withdrawn meanwhile
            return None
        try:
            tokens = decode_tokens(view.tobytes())
        except ValueError as exc:
            log.warning("ignoring wanted record %s: %s", info.key.hex()[:16], exc)
            return None
        finally:
            view.release()
        return WantedSegment(seg_key, tokens, int(extra.get("split", 0)), int(extra.get("index", 0)),
                             str(extra.get("requester", "")), str(extra.get("request", "")),
                             float(extra.get("expires", 0)))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
