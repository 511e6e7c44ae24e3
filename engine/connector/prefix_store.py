"""Exact-prefix checkpoints as kvstore daemon objects, next to the signatures: the
CPU/NVMe tiers and cross-engine sharing for prefix reuse (PIC's exact prefixes,
engine.pic.exact_prefix, and `--method prefix` with `--store`).

One object per prefix with states: the merged checkpoint of positions [0, end)
(engine.pic.prefix.merge_path: every full-attention layer's K/V of the whole prefix, and
at `end` the sliding-window rows, every linear layer's state and conv tail), so a hit is
one Get and one restore, whatever the tree of the engine that stored it looked like.

Key space: `prefix_key(fingerprint, token ids [0, end), variant)`, blake2b-256 under its
own tag (never equal to a signature's segment_key); the record's `extra` kind is
"prefix-checkpoint" (OBJECT_KIND), its token count `end`, its cost the prefix length (the
tokens a hit does not compute). Blob tensors: `L<i>.k`, `L<i>.v` (full attention),
`L<i>.rk`, `L<i>.rv` (window rows; header meta `ring_first[i]`: their first position),
`L<i>.state`, `L<i>.tail` (linear layers); header meta `format` ("prefix-checkpoint/1")
and `end`.

`PrefixCheckpointStore.find(ids, bounds)` asks the daemon (one Lookup for every
boundary) for the deepest boundary it holds, Gets it and copies it to the engine's
device (synchronously, on the engine thread: a restore needs all of it before the
request's pass); `put(ids, checkpoint)` queues the object on the connector's put thread.
Nothing here raises into a request: a daemon that is away answers no hit.
"""
from __future__ import annotations

import hashlib
import logging
from typing import Optional, Sequence

import numpy as np
import torch

from engine.connector.codec import SignatureBlob
from engine.connector.errors import StoreUnavailable
from engine.connector.store_cache import StoreSignatureCache
from engine.pic.errors import SignatureFormatError
from engine.pic.prefix import BoundaryCheckpoint
from kvstore import format as fmt
from kvstore.errors import KVStoreError

log = logging.getLogger("engine.connector")

OBJECT_KIND = "prefix-checkpoint"
FORMAT = "prefix-checkpoint/1"
KEY_TAG = b"hypercache/prefix-checkpoint/1\x00"


def prefix_key(fingerprint: str, token_ids: Sequence[int], variant: str = "") -> bytes:
    """blake2b-256 of (tag, model fingerprint, variant, the prefix's token ids)."""
    if not fingerprint:
        raise SignatureFormatError("a prefix checkpoint key needs the model fingerprint; got an empty one")
    h = hashlib.blake2b(digest_size=32)
    h.update(KEY_TAG)
    h.update(fingerprint.encode())
    h.update(b"\x00" + variant.encode() + b"\x00")
    h.update(np.asarray(list(token_ids), dtype=np.int64).tobytes())
    return h.digest()


def checkpoint_blob(cp: BoundaryCheckpoint, fingerprint: str) -> SignatureBlob:
    """The object blob of a merged checkpoint [0, end) with states (module docstring)."""
    if cp.start != 0 or not cp.with_state:
        raise SignatureFormatError(f"a stored prefix checkpoint covers [0, end) with states, not [{cp.start}, {cp.end})")
    tensors: dict[str, torch.Tensor] = {}
    layers: dict[str, int] = {}
    ring_first: dict[str, int] = {}

    def add(name: str, i: int, t: torch.Tensor) -> None:
        tensors[f"L{i}.{name}"] = t.contiguous()
        layers[f"L{i}.{name}"] = i

    for i, (k, v) in cp.kv.items():
        add("k", i, k)
        add("v", i, v)
    for i, (k, v, first) in cp.ring.items():
        add("rk", i, k)
        add("rv", i, v)
        ring_first[str(i)] = int(first)
    for i, (state, tail) in cp.states.items():
        add("state", i, state)
        if tail is not None:
            add("tail", i, tail)
    meta = {"format": FORMAT, "end": cp.end, "ring_first": ring_first}
    return SignatureBlob(tensors, meta, layers, fingerprint, cp.end, kind=OBJECT_KIND)


def checkpoint_from_tensors(meta: dict, tensors: dict, device: torch.device) -> BoundaryCheckpoint:
    """The checkpoint of a decoded blob, copied to `device` (the leased bytes are released
    after this). Raises SignatureFormatError for another format."""
    if meta.get("format") != FORMAT:
        raise SignatureFormatError(f"object is not a prefix checkpoint (format {meta.get('format')!r})")
    cp = BoundaryCheckpoint(0, int(meta["end"]))
    parts: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        layer, part = name[1:].split(".", 1)
        parts.setdefault(int(layer), {})[part] = t.to(device, copy=True)
    first = {int(i): int(f) for i, f in (meta.get("ring_first") or {}).items()}
    for i, p in parts.items():
        if "k" in p:
            cp.kv[i] = (p["k"], p["v"])
        elif "rk" in p:
            cp.ring[i] = (p["rk"], p["rv"], first[i])
        elif "state" in p:
            cp.states[i] = (p["state"], p.get("tail"))
    return cp


class PrefixCheckpointStore:
    """Prefix checkpoints through the connector's link and put thread (module docstring)."""

    def __init__(self, store: StoreSignatureCache, fingerprint: str, variant: str = "") -> None:
        self.store = store
        self.fingerprint = fingerprint
        self.variant = variant

    def key(self, ids: Sequence[int]) -> bytes:
        return prefix_key(self.fingerprint, ids, self.variant)

    def has(self, ids: Sequence[int]) -> bool:
        """The daemon holds the checkpoint of exactly this prefix."""
        return bool(self.store.lookup([self.key(ids)])[0])

    def find(self, ids: Sequence[int], ends: Sequence[int]) -> Optional[tuple[BoundaryCheckpoint, str]]:
        """The deepest of the prefixes ids[:end] (end in `ends`) the daemon holds, loaded
        onto the engine's device, with the tier that held it; None when it holds none
        (or is away, or the object cannot be read)."""
        if not ends or not self.store.available:
            return None
        m = self.store.metrics
        m.inc("prefix_lookups")
        keys = [self.key(ids[:e]) for e in ends]
        try:
            entries = self.store.link.call("lookup", lambda kv: kv.lookup(keys))
        except (StoreUnavailable, KVStoreError):
            return None
        for e in sorted((e for e in entries if e.hit), key=lambda e: -ends[keys.index(e.key)]):
            got = self._get(e.key)
            if got is not None:
                m.inc("prefix_hits")
                return got[0], e.tier or got[1]
        return None

    def _get(self, key: bytes) -> Optional[tuple[BoundaryCheckpoint, str]]:
        try:
            views = self.store.link.call("get", lambda kv: kv.get_many([key], promote=True))
        except (StoreUnavailable, KVStoreError):
            return None
        view = views[0]
        if view is None:  # evicted since the lookup
            return None
        try:
            header, tensors = fmt.decode_tensors(view.tensor(), check=self.store.config.verify)
            if header.fingerprint != self.fingerprint:
                raise SignatureFormatError(f"prefix checkpoint of model {header.fingerprint[:16]!r}")
            cp = checkpoint_from_tensors(dict(header.meta), tensors, self.store.device)
            self.store.metrics.inc("prefix_load_bytes", view.size)
            return cp, view.tier
        except (KVStoreError, SignatureFormatError, RuntimeError, KeyError, ValueError) as exc:
            self.store.metrics.inc("store_errors")
            log.warning("prefix checkpoint %s could not be loaded (%s); computing instead", key.hex()[:16], exc)
            return None
        finally:
            view.release()

    def put(self, ids: Sequence[int], cp: BoundaryCheckpoint) -> bool:
        """Queue the merged checkpoint `cp` of prefix `ids` (= ids[:cp.end]) for storage."""
        if len(ids) != cp.end:
            raise SignatureFormatError(f"prefix of {len(ids)} tokens for a checkpoint ending at {cp.end}")
        device = next(iter(cp.kv.values()))[0].device if cp.kv else self.store.device
        queued = self.store.store_blob(self.key(ids), checkpoint_blob(cp, self.fingerprint), device,
                                       cost=float(cp.end))
        if queued:
            self.store.metrics.inc("prefix_puts")
        return queued
