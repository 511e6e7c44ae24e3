"""Signatures as blobs (engine.connector.codec): parts of one kind, dtype and shape across
layers travel stacked as one blob part, and decode back to the same signature (rows as
views of the blob, no copy); blobs written before stacking (no `stacked` meta) still
decode; a stacked part that does not match its meta is a format error."""
from __future__ import annotations

import pytest
import torch

from engine.connector.codec import signature_blob, signature_from_blob
from engine.models.config import FULL, GDN, MAMBA2, SWA
from engine.pic.compute import compute_signature
from engine.pic.errors import SignatureFormatError
from kvstore import format as fmt


@pytest.fixture
def signature_of(make_config, make_model):
    """(layers) -> the signature of a 40-token segment (seam 8, BOS anchor) on a small model."""
    def make(layers):
        model = make_model(make_config(layers))
        ids = torch.randint(2, 50, (40,), generator=torch.Generator().manual_seed(3)).tolist()
        with torch.inference_mode():
            return compute_signature(model, ids, [1], 8)
    return make


def _round_trip(blob):
    buf = torch.frombuffer(fmt.encode_tensors(blob.tensors, fingerprint="fp", token_count=blob.token_count,
                                              meta=blob.meta, layers=blob.layers), dtype=torch.uint8)
    header, tensors = fmt.decode_tensors(buf)
    return buf, header, tensors


def _assert_same(a, b):
    ta, ma, _ = a.to_tensors()
    tb, mb, _ = b.to_tensors()
    assert ma == mb and set(ta) == set(tb)
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name


def test_parts_of_a_kind_are_stacked_into_one_blob_part_and_decode_to_the_same_signature(signature_of):
    sig = signature_of([GDN, GDN, FULL, GDN, FULL, MAMBA2, SWA])
    per_layer, _, _ = sig.to_tensors()
    blob = signature_blob(sig, "fp")
    assert len(blob.tensors) < len(per_layer)
    assert blob.meta["stacked"] and all(name.startswith("S") for name in blob.meta["stacked"])
    assert sum(len(rows) for rows in blob.meta["stacked"].values()) + \
        sum(1 for n in blob.tensors if n not in blob.meta["stacked"]) == len(per_layer)
    buf, header, tensors = _round_trip(blob)
    back = signature_from_blob(header.meta, tensors, header.fingerprint, "fp")
    _assert_same(back, sig)
    base = buf.untyped_storage().data_ptr()
    span = range(base, base + buf.numel())
    back_tensors, _, _ = back.to_tensors()
    assert all(t.untyped_storage().data_ptr() in span for t in back_tensors.values())  # views of the blob


def test_a_blob_written_without_stacking_still_decodes(signature_of):
    sig = signature_of([GDN, FULL, GDN])
    tensors, meta, layers = sig.to_tensors()
    buf = torch.frombuffer(fmt.encode_tensors(tensors, fingerprint="fp", token_count=sig.num_tokens, meta=meta,
                                              layers=layers), dtype=torch.uint8)
    header, parts = fmt.decode_tensors(buf)
    _assert_same(signature_from_blob(header.meta, parts, header.fingerprint, "fp"), sig)


def test_a_stacked_part_that_does_not_match_its_meta_is_a_format_error(signature_of):
    blob = signature_blob(signature_of([GDN, GDN, FULL]), "fp")
    _, header, tensors = _round_trip(blob)
    name, rows = next(iter(blob.meta["stacked"].items()))
    bad = dict(header.meta, stacked={name: rows + ["L99.state"]})
    with pytest.raises(SignatureFormatError, match=name):
        signature_from_blob(bad, tensors, header.fingerprint, "fp")
    missing = dict(header.meta, stacked={"S999.state": rows})
    with pytest.raises(SignatureFormatError, match="S999"):
        signature_from_blob(missing, tensors, header.fingerprint, "fp")
