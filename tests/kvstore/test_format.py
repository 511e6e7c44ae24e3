"""Object format: layout, zero-copy decode, checksums, clear errors on bad input."""

import mmap
import struct

import pytest
import torch

from kvstore import format as fmt
from kvstore.errors import BadObject, InvalidRequest, VersionMismatch


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "k": torch.randn(3, 5, 7, generator=g),
        "v": torch.randn(3, 5, 7, generator=g).to(torch.bfloat16),
        "T": torch.randn(2, 4, 4, generator=g, dtype=torch.float64),
        "ids": torch.arange(11, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4, dtype=torch.float16),
        "scalar": torch.tensor(3.5),
    }


def test_round_trip_preserves_every_tensor_dtype_and_shape():
    ts = _tensors()
    blob = fmt.encode_tensors(ts, fingerprint="m1", token_count=11, meta={"seg": 4}, layers={"k": 3, "v": 3})
    header, out = fmt.decode_tensors(blob)
    assert header.fingerprint == "m1" and header.token_count == 11 and header.meta == {"seg": 4}
    assert header.part("k").layer == 3 and header.part("ids").layer == -1
    assert list(out) == list(ts)
    for name, t in ts.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t), name


def test_parts_start_4k_aligned_and_size_matches_plan():
    ts = _tensors()
    plan = fmt.plan_blob(ts, fingerprint="m", token_count=1)
    assert fmt.blob_size(ts, fingerprint="m", token_count=1) == plan.total_size
    for p in plan.header.parts:
        assert p.offset % fmt.ALIGN == 0
    assert plan.total_size == plan.header.parts[-1].offset + plan.header.parts[-1].length + fmt.TRAILER_SIZE


def test_decode_is_zero_copy_views_over_the_buffer():
    ts = {"a": torch.arange(1024, dtype=torch.float32)}
    blob = fmt.encode_tensors(ts, fingerprint="m", token_count=0)
    _, out = fmt.decode_tensors(memoryview(blob))
    off = fmt.read_header(blob).part("a").offset
    struct.pack_into("<f", blob, off, 42.0)  # write through the buffer ...
    assert out["a"][0].item() == 42.0  # ... and the decoded tensor sees it


def test_write_blob_into_a_shared_mapping_returns_the_store_checksum():
    ts = _tensors()
    plan = fmt.plan_blob(ts, fingerprint="fp", token_count=3)
    m = mmap.mmap(-1, plan.total_size + 8192)
    c = fmt.write_blob(memoryview(m), plan, ts)
    region = memoryview(m)[: plan.total_size]
    assert c == fmt.checksum(region)
    assert c == fmt.checksum(fmt.encode_tensors(ts, fingerprint="fp", token_count=3))  # deterministic
    _, out = fmt.decode_tensors(region)
    assert torch.equal(out["v"], ts["v"])
    del out, region
    m.close()


def test_uint8_tensor_buffer_is_accepted_for_write_and_decode():
    ts = {"x": torch.randn(64)}
    plan = fmt.plan_blob(ts, fingerprint="f", token_count=1)
    buf = torch.zeros(plan.total_size, dtype=torch.uint8)
    c = fmt.write_blob(buf, plan, ts)
    assert c == fmt.checksum(buf)
    _, out = fmt.decode_tensors(buf)
    assert torch.equal(out["x"], ts["x"])


def test_flipped_byte_fails_verify_with_checksum_mismatch():
    blob = fmt.encode_tensors({"a": torch.ones(100)}, fingerprint="m", token_count=0)
    blob[fmt.read_header(blob).part("a").offset + 7] ^= 0xFF
    with pytest.raises(BadObject, match="checksum mismatch"):
        fmt.verify(blob)
    fmt.decode_tensors(blob, check=False)  # structure is still fine


def test_truncated_blob_is_bad_object_naming_sizes():
    blob = fmt.encode_tensors({"a": torch.ones(2000)}, fingerprint="m", token_count=0)
    with pytest.raises(BadObject, match="truncated"):
        fmt.decode_tensors(bytes(blob[: len(blob) - 100]))
    with pytest.raises(BadObject, match="too short"):
        fmt.read_header(b"KVS")


def test_garbage_is_bad_object_and_not_a_blob():
    junk = bytes(range(256)) * 20
    assert not fmt.is_blob(junk)
    with pytest.raises(BadObject, match="magic"):
        fmt.read_header(junk)


def test_other_format_version_is_version_mismatch():
    blob = fmt.encode_tensors({"a": torch.ones(4)}, fingerprint="m", token_count=0)
    struct.pack_into("<H", blob, 8, 99)
    with pytest.raises(VersionMismatch, match="99"):
        fmt.read_header(blob)


def test_corrupt_header_is_bad_object():
    blob = fmt.encode_tensors({"a": torch.ones(4)}, fingerprint="m", token_count=0)
    blob[16:40] = b"\xc1" * 24  # 0xc1 is never valid msgpack
    with pytest.raises(BadObject, match="header"):
        fmt.read_header(blob)


def test_unsupported_dtype_and_mismatched_tensors_are_invalid_requests():
    with pytest.raises(InvalidRequest, match="complex64"):
        fmt.plan_blob({"c": torch.zeros(2, dtype=torch.complex64)}, fingerprint="m", token_count=0)
    plan = fmt.plan_blob({"a": torch.zeros(4)}, fingerprint="m", token_count=0)
    with pytest.raises(InvalidRequest, match="plan says"):
        fmt.write_blob(bytearray(plan.total_size), plan, {"a": torch.zeros(5)})
    with pytest.raises(InvalidRequest, match="too small"):
        fmt.write_blob(bytearray(10), plan, {"a": torch.zeros(4)})
    with pytest.raises(InvalidRequest, match="unknown parts"):
        fmt.plan_blob({"a": torch.zeros(4)}, fingerprint="m", token_count=0, layers={"b": 1})


def test_many_parts_header_larger_than_first_guess_still_fits():
    ts = {f"layer{i}.k": torch.full((2,), float(i)) for i in range(300)}
    blob = fmt.encode_tensors(ts, fingerprint="m" * 200, token_count=5, meta={"x": "y" * 5000})
    header, out = fmt.decode_tensors(blob)
    assert len(header.parts) == 300 and out["layer299.k"][0].item() == 299.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; this machine has none")
def test_cuda_buffer_write_and_zero_copy_decode_stay_on_the_gpu():  # pragma: no cover - GPU only
    ts = {"k": torch.randn(4, 8, device="cuda").to(torch.bfloat16), "T": torch.randn(2, 3, 3, device="cuda")}
    plan = fmt.plan_blob(ts, fingerprint="f", token_count=4)
    buf = torch.empty(plan.total_size, dtype=torch.uint8, device="cuda")
    c = fmt.write_blob(buf, plan, ts)
    assert c == fmt.checksum(buf.cpu())
    _, out = fmt.decode_tensors(buf)
    assert out["k"].is_cuda and out["k"].data_ptr() == buf.data_ptr() + plan.header.part("k").offset
    assert torch.equal(out["k"], ts["k"]) and torch.equal(out["T"], ts["T"])
