"""In-flight claims: the record `StoreSignatureCache.claim` answers, and what it means.

Before computing a missing segment, an engine claims it in the daemon (a reservation of
the segment's *claim key*, engine.connector.store_cache describes the protocol). The
outcome is a `Claim` whose `status` is one of the constants below. This module holds
only the record, so that the cache (store_cache) and the cold sharing on top of it
(coldshare) both read it without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.connector.loader import LoadedSegment

CLAIM_TAG = b"kvengine-claim-v1\x00"
CLAIM_BYTES = 1

# Claim outcomes
OWNED = "owned"  # this engine computes the segment and stores it
WAITED = "waited"  # another engine computed it while this one waited: `segment` holds it
PRESENT = "present"  # it landed before the claim: `segment` holds it
INFLIGHT = "in_flight"  # another engine computes it: `wait_inflight(claim)` next
COMPUTE = "compute"  # compute it here without a claim (dedup off, daemon away, wait timed out)


def claim_key(key: bytes) -> bytes:
    """The daemon key that marks `key` as being computed by some engine."""
    return CLAIM_TAG + key


@dataclass
class Claim:
    """The outcome of `StoreSignatureCache.claim` (engine.connector.store_cache)."""

    key: bytes
    status: str
    segment: Optional[LoadedSegment] = None
    reservation_id: int = 0
    generation: int = 0
    wait_ms: float = 0.0

    @property
    def owned(self) -> bool:
        return self.status == OWNED
