"""Position-independent caching (PIC) for hybrid models, and its baselines.

- `signature`: `SegmentSignature`, what a cached segment holds per layer (and its
  named-tensor form for the store's blob format);
- `signature_cache`: the `SignatureCache` interface, `InMemorySignatureCache`, `segment_key`;
- `compute`: a segment computed alone -> its signature;
- `splice`: signatures written into a request's caches at an offset (RoPE re-rotation,
  SWA rings, linear-state composition, conv tails);
- `planner`: the prefill planners (`full`, `naive`, `pic`) for the scheduler's hook;
- `prefix`: the prefix-caching baseline (radix tree with state checkpoints);
- `report`: per-request token and time accounting;
- `run`: `kvengine run`.
See docs/pic.md for the algorithm and the choices made.

A layer kind's PIC behaviour is found by the cache the kind keeps, in one table per
pass: `splice.SPLICE_LAYERS` (writing signatures at an offset) and
`fused.FUSED_LAYERS` (the fused compute-and-splice prefill); a new family adds its
entry to each.
"""
from engine.pic.config import METHODS, PicConfig
from engine.pic.signature import AttentionPart, LinearPart, SegmentSignature
from engine.pic.signature_cache import (InMemorySignatureCache, SignatureCache, SignatureCacheStats, segment_key,
                                        signature_variant)

__all__ = ["METHODS", "AttentionPart", "InMemorySignatureCache", "LinearPart", "PicConfig", "SegmentSignature",
           "SignatureCache", "SignatureCacheStats", "segment_key", "signature_variant"]
