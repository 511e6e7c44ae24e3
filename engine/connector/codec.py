"""Segment signatures as kvstore objects.

A signature travels as one object-format blob (kvstore.format): its parts, named
`L<layer>.<part>` with their layer index, are the blob's tensors (each 4 KiB-aligned,
written straight into the reserved region by `put_tensors`); the signature's meta
(format, token counts, per-layer kinds, live delta heads) is the blob header's `meta`;
the header's `fingerprint` and `token_count` are the model fingerprint and the segment's
token count. The daemon's record gets the same fingerprint and token count (so `kvstore
ls --fingerprint` lists a model's segments) and `cost`, the seconds its alone pass took
(the eviction policy weighs recompute cost per byte).

Parts of the same kind, dtype and shape in several layers (every linear layer's state,
every full-attention layer's K, ...) travel stacked as ONE blob part, `S<n>.<part>`
`[layers, ...]`, and the header meta's `stacked` names the layers' parts in row order: a
bench-size signature has ~6 blob parts instead of ~70, so a load decodes a few parts and
unbinds them (views) instead of building ~70 views from the header one by one (the
loader's per-segment host time). Blobs without `stacked` (written before) read as before.

The stacking is banded: layers are cut into the bands the loader copies as one group
(engine.connector.layer_loads.group_bounds over the layers' byte counts: >= 8 MiB,
doubling up to 64 MiB) and each band's parts are stacked and laid out together, band
after band (`S<n>.<part>` per band and part; the meta's `bands` lists each band's first
layer). A band is then one contiguous run of the blob, so the loader copies a group of
layers in ONE copy instead of one per stacked part (~22 copies a qwen3next-bench
segment): the loader's thread issues those next to the engine's Python and, while that
holds the GIL, fell behind the copy engine (bench_layered_copy). Blobs without `bands`
(written before) load with the loader's own grouping.

Reading is zero copy: `signature_from_blob` builds the signature over the tensors that
`decode_tensors` made over the leased bytes (rows of a stacked part are views of it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from engine.connector.errors import ConnectorError
from engine.connector.layer_loads import COPY_GROUP_GROWTH, MAX_COPY_GROUP_BYTES, MIN_COPY_BYTES, group_bounds
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
    kind: str = OBJECT_KIND  # the daemon record's `extra` kind

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def signature_blob(signature: SegmentSignature, fingerprint: str) -> SignatureBlob:
    """The blob parts of `signature` (see the module docstring)."""
    if not fingerprint:
        raise ConnectorError("a signature needs the model fingerprint to be stored; got an empty one")
    tensors, meta, layers = signature.to_tensors()
    band_of, firsts = layer_bands(tensors, layers)
    groups: dict[tuple, list[str]] = {}
    # to_tensors lists parts layer by layer, so the groups (and the blob) come band by band
    for name, t in tensors.items():
        key = (band_of[layers[name]], name.split(".", 1)[1], t.dtype, tuple(t.shape), t.device)
        groups.setdefault(key, []).append(name)
    out: dict[str, torch.Tensor] = {}
    out_layers: dict[str, int] = {}
    stacked: dict[str, list[str]] = {}
    for i, ((_, part, *_), names) in enumerate(groups.items()):
        if len(names) == 1:
            out[names[0]] = tensors[names[0]]
            out_layers[names[0]] = layers[names[0]]
            continue
        name = f"S{i}.{part}"
        out[name] = torch.stack([tensors[n] for n in names])
        out_layers[name] = layers[names[0]]
        stacked[name] = names
    meta = dict(meta, stacked=stacked, bands=firsts)
    return SignatureBlob(out, meta, out_layers, fingerprint, signature.num_tokens)


def layer_bands(tensors: Mapping[str, torch.Tensor], layers: Mapping[str, int]) -> tuple[dict[int, int], list[int]]:
    """(layer -> band index, each band's first layer): consecutive layers grouped as the
    loader groups a blob's layers for its copies (module docstring)."""
    sizes: dict[int, int] = {}
    for name, t in tensors.items():
        sizes[layers[name]] = sizes.get(layers[name], 0) + t.numel() * t.element_size()
    order = sorted(sizes)
    bounds = group_bounds([sizes[i] for i in order], MIN_COPY_BYTES, COPY_GROUP_GROWTH, MAX_COPY_GROUP_BYTES)
    band_of = {order[i]: b for b, (lo, hi) in enumerate(bounds) for i in range(lo, hi)}
    return band_of, [order[lo] for lo, _ in bounds]


def signature_from_blob(header_meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                        fingerprint: str, expected_fingerprint: str) -> SegmentSignature:
    """The signature over a decoded blob's tensors (views stay views). Raises
    SignatureFormatError when the blob is not a signature of this model."""
    if expected_fingerprint and fingerprint != expected_fingerprint:
        raise SignatureFormatError(
            f"stored signature belongs to model {fingerprint[:16]!r}, this engine serves {expected_fingerprint[:16]!r}")
    parts = dict(tensors)
    for name, rows in (header_meta.get("stacked") or {}).items():
        whole = parts.pop(name, None)
        if whole is None or whole.dim() == 0 or whole.shape[0] != len(rows):
            raise SignatureFormatError(f"stacked part {name!r} does not hold the {len(rows)} rows its meta names")
        parts.update(zip(rows, whole.unbind(0)))
    return SegmentSignature.from_tensors(parts, dict(header_meta))
