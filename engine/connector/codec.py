"""Segment signatures as kvstore objects.

A signature travels as one object-format blob (kvstore.format): its parts, named
`L<layer>.<part>` with their layer index, are the blob's tensors (each 4 KiB-aligned,
written straight into the reserved region by `put_tensors`); the signature's meta
(format, token counts, per-layer kinds, live delta heads) is the blob header's `meta`;
the header's `fingerprint` and `token_count` are the model fingerprint and the segment's
token count. The daemon's record gets the same fingerprint and token count (so `kvstore
ls --fingerprint` lists a model's segments) and `cost`, the seconds its alone pass took
(the eviction policy weighs recompute cost per byte).

Reading is zero copy: `signature_from_blob` builds the signature over the tensors that
`decode_tensors` made over the leased bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from engine.connector.errors import ConnectorError
from engine.pic.errors import SignatureFormatError
from engine.pic.signature import SegmentSignature

OBJECT_KIND = "pic-signature"


@dataclass(frozen=True)
class SignatureBlob:
    """What `put_tensors` takes for one signature."""

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    layers: dict[str, int]
    fingerprint: str
    token_count: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def signature_blob(signature: SegmentSignature, fingerprint: str) -> SignatureBlob:
    """The blob parts of `signature` (see the module docstring)."""
    if not fingerprint:
        raise ConnectorError("a signature needs the model fingerprint to be stored; got an empty one")
    tensors, meta, layers = signature.to_tensors()
    return SignatureBlob(tensors, meta, layers, fingerprint, signature.num_tokens)


def signature_from_blob(header_meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                        fingerprint: str, expected_fingerprint: str) -> SegmentSignature:
    """The signature over a decoded blob's tensors (views stay views). Raises
    SignatureFormatError when the blob is not a signature of this model."""
    if expected_fingerprint and fingerprint != expected_fingerprint:
        raise SignatureFormatError(
            f"stored signature belongs to model {fingerprint[:16]!r}, this engine serves {expected_fingerprint[:16]!r}")
    return SegmentSignature.from_tensors(dict(tensors), dict(header_meta))
