"""The kvstore object format: one self-describing blob of named tensors per key.

The store itself treats an object as opaque bytes plus a checksum (`checksum`); this
module is the client-side convention for tensors, which the daemon can also validate
(`kvstore show`). Layout of a blob, all integers little-endian::

    offset 0      preamble, 16 bytes: magic b"KVSBLOB\\0" | u16 format version
                  | u16 flags (bits 0-3: the checksum algorithm, kvstore.checksums)
                  | u32 header length H
    offset 16     msgpack header, H bytes: {"version", "fingerprint", "token_count", "meta",
                  "size", "parts": [{"name", "layer", "dtype", "shape", "offset", "length"}]}
    ...           zero padding; each part's raw bytes start at a multiple of 4096 from the
                  blob start (the arenas hand out 4 KiB-aligned extents, so the bytes are
                  4 KiB-aligned in memory and on disk too: O_DIRECT and DMA friendly)
    size - 16     trailer, 16 bytes: u64 xxh3_64 of bytes [0, size - 16) | magic b"KVSEND\\0\\0"

Where the checksums live: the *blob* checksum sits in the trailer, computed last, so a
writer fills a reserved shared-memory region in one sweep and a torn or truncated blob
fails `verify`. The *store* checksum (what `Store.commit` takes) is `checksum(whole
blob)`: the blob's algorithm over every byte including the trailer. `write_blob` returns
it from the same streaming pass that produced the trailer, so a client hashes its bytes once.

Which algorithm: the preamble's flags (low 4 bits) name it (kvstore.checksums): 0 =
xxh3_64, 1 = kvsum64, a sum a GPU computes in one pass over device memory
(kernels.blob_checksum). `write_blob` into a CUDA buffer writes kvsum64 blobs (hashing
on the host would copy every byte off the device), into host memory xxh3_64 ones;
`checksum`, `verify` and the daemon read the flags, so bytes are always checked with the
algorithm they were written with, on whatever tier they lie.

xxh3_64 (the `xxhash` package) runs at memory speed (~15 GB/s on one core here, vs ~2
GB/s for zlib.crc32) and has 64 bits, so accidental collisions across a cache are not a
concern. It is a checksum against corruption, not a MAC.

Writing without an intermediate copy::

    plan = plan_blob(tensors, fingerprint=fp, token_count=n)
    region = ... reserve plan.total_size bytes, map them as a writable memoryview ...
    store_checksum = write_blob(region, plan, tensors)

Reading is zero copy: `decode_tensors(buf)` returns tensors that are views over `buf`
(`torch.frombuffer`), so they alias the arena and stay valid only while it is mapped and
the lease is held. `buf` may be a memoryview/bytes-like object or a uint8 torch tensor
(a CUDA one for the GPU tier).
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

import msgpack
import torch
import xxhash

from kvstore import checksums as cks
from kvstore.errors import BadObject, InvalidRequest, VersionMismatch

FORMAT_VERSION = 1
ALIGN = 4096
MAGIC = b"KVSBLOB\x00"
TRAILER_MAGIC = b"KVSEND\x00\x00"
_PREAMBLE = struct.Struct("<8sHHI")
_TRAILER = struct.Struct("<Q8s")
PREAMBLE_SIZE = _PREAMBLE.size  # 16
TRAILER_SIZE = _TRAILER.size  # 16
MAX_HEADER_BYTES = 64 << 20

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
#: bytes per element of each dtype name
ITEMSIZE: dict[str, int] = {name: torch.empty(0, dtype=dt).element_size() for name, dt in DTYPES.items()}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

Buffer = Union[memoryview, bytes, bytearray, torch.Tensor]


def align_up(n: int, align: int = ALIGN) -> int:
    """Round `n` up to a multiple of `align`."""
    return (n + align - 1) // align * align


def checksum(buf: Buffer) -> int:
    """The store checksum of a byte object, with the algorithm its bytes call for
    (kvstore.checksums: a blob's flags, else xxh3_64), as an unsigned int.

    `buf` is any contiguous bytes-like object or a uint8 tensor. A CUDA tensor holding a
    kvsum64 blob is hashed on the device; any other CUDA tensor is copied to the host.
    """
    if isinstance(buf, torch.Tensor) and buf.device.type == "cuda":
        u8 = _as_u8(buf)
        if cks.algorithm_of(_read_prefix(u8, min(u8.numel(), cks.PREFIX_BYTES))) == cks.KVSUM64:
            return _device_kvsum(u8)
    return cks.host_checksum(_host_bytes(buf))


def _device_kvsum(u8: torch.Tensor) -> int:
    from kernels.blob_checksum import kvsum64

    return kvsum64(u8)


@dataclass(frozen=True)
class PartInfo:
    """One tensor inside a blob: where its raw bytes lie and how to view them."""

    name: str
    layer: int
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "layer": self.layer,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "offset": self.offset,
            "length": self.length,
        }


@dataclass(frozen=True)
class BlobHeader:
    """The decoded header of a blob."""

    version: int
    fingerprint: str
    token_count: int
    meta: dict[str, Any]
    total_size: int
    parts: tuple[PartInfo, ...]
    header_len: int = 0
    algorithm: int = cks.XXH3  # the checksum algorithm the preamble names (not part of to_dict)

    def part(self, name: str) -> PartInfo:
        for p in self.parts:
            if p.name == name:
                return p
        raise InvalidRequest(f"blob has no part named {name!r}; parts: {[p.name for p in self.parts]}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "fingerprint": self.fingerprint,
            "token_count": self.token_count,
            "meta": self.meta,
            "size": self.total_size,
            "parts": [p.to_dict() for p in self.parts],
        }


@dataclass(frozen=True)
class BlobPlan:
    """Everything needed to write a blob: its header bytes and total size."""

    header: BlobHeader
    header_bytes: bytes = field(repr=False)

    @property
    def total_size(self) -> int:
        return self.header.total_size


def _tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_blob(
    tensors: Mapping[str, torch.Tensor],
    *,
    fingerprint: str,
    token_count: int,
    meta: Mapping[str, Any] | None = None,
    layers: Mapping[str, int] | None = None,
) -> BlobPlan:
    """Lay out a blob for `tensors` (name -> tensor, in iteration order) without writing it.

    `layers` maps a part name to its layer index (-1 when absent). `meta` is a free-form
    msgpack-serialisable dict. Raises InvalidRequest for an unsupported dtype, a
    non-string name, or a layer for an unknown part.
    """
    if not isinstance(fingerprint, str):
        raise InvalidRequest(f"fingerprint must be a str, got {type(fingerprint).__name__}")
    if not isinstance(token_count, int) or token_count < 0:
        raise InvalidRequest(f"token_count must be an int >= 0, got {token_count!r}")
    layers = dict(layers or {})
    unknown = set(layers) - set(tensors)
    if unknown:
        raise InvalidRequest(f"layers given for unknown parts: {sorted(unknown)}")
    specs = []
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise InvalidRequest(f"part names must be str, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise InvalidRequest(f"part {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.dtype not in DTYPE_NAMES:
            raise InvalidRequest(f"part {name!r} has unsupported dtype {t.dtype}; supported: {sorted(DTYPES)}")
        specs.append((name, int(layers.get(name, -1)), DTYPE_NAMES[t.dtype], tuple(t.shape), _tensor_nbytes(t)))
    meta_d = dict(meta or {})

    data_start = align_up(PREAMBLE_SIZE + 256 + 96 * len(specs))
    while True:
        parts = []
        cursor = data_start
        for name, layer, dtype, shape, length in specs:
            off = align_up(cursor)
            parts.append(PartInfo(name, layer, dtype, shape, off, length))
            cursor = off + length
        total = cursor + TRAILER_SIZE
        header = BlobHeader(FORMAT_VERSION, fingerprint, token_count, meta_d, total, tuple(parts))
        try:
            hb = msgpack.packb(header.to_dict(), use_bin_type=True)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"blob meta is not msgpack-serialisable: {exc}") from exc
        if PREAMBLE_SIZE + len(hb) <= data_start:
            break
        data_start = align_up(PREAMBLE_SIZE + len(hb))
    header = BlobHeader(FORMAT_VERSION, fingerprint, token_count, meta_d, total, tuple(parts), len(hb))
    return BlobPlan(header, hb)


def blob_size(tensors: Mapping[str, torch.Tensor], **kwargs: Any) -> int:
    """Total bytes of the blob `plan_blob(tensors, **kwargs)` would write."""
    return plan_blob(tensors, **kwargs).total_size


def _as_u8(buf: Buffer, *, writable: bool = False) -> torch.Tensor:
    """A flat uint8 tensor aliasing `buf` (no copy)."""
    if isinstance(buf, torch.Tensor):
        if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
            raise InvalidRequest(f"tensor buffer must be a contiguous 1-D uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
        return buf
    mv = memoryview(buf)
    if writable and mv.readonly:
        raise InvalidRequest("write_blob needs a writable buffer, got a read-only one")
    if mv.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers: we never write through them
        return torch.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=torch.uint8)


def _host_bytes(buf: Buffer) -> memoryview:
    if isinstance(buf, torch.Tensor):
        t = buf.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return memoryview(buf)


def write_blob(buf: Buffer, plan: BlobPlan, tensors: Mapping[str, torch.Tensor], *,
               algorithm: int | None = None) -> int:
    """Write the blob laid out by `plan` into `buf[:plan.total_size]`; return its store checksum.

    `algorithm` (kvstore.checksums.XXH3 or KVSUM64) defaults to KVSUM64 for a CUDA `buf`
    and XXH3 otherwise; it is recorded in the preamble's flags.

    `buf` is a writable bytes-like object (a mapped shared-memory region, a bytearray) or
    a uint8 tensor (CPU or CUDA); `tensors` must be the same name -> tensor mapping the
    plan was made from (same names, dtypes, shapes). Source tensors may live on any
    device; each is copied once, straight into place. Padding is zeroed so equal inputs
    give byte-identical blobs.
    """
    dst = _as_u8(buf, writable=True)
    total = plan.total_size
    if dst.numel() < total:
        raise InvalidRequest(f"buffer of {dst.numel()} bytes is too small for a blob of {total} bytes")
    dst = dst[:total]
    names = [p.name for p in plan.header.parts]
    if list(tensors.keys()) != names:
        raise InvalidRequest(f"tensors {list(tensors.keys())} do not match the plan's parts {names}")
    if algorithm is None:
        algorithm = cks.KVSUM64 if dst.device.type == "cuda" else cks.XXH3
    if algorithm not in cks.ALGORITHMS:
        raise InvalidRequest(f"unknown checksum algorithm {algorithm!r}; known: {cks.ALGORITHMS}")
    hb = plan.header_bytes
    pre = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, algorithm, len(hb))
    head = torch.frombuffer(bytearray(pre + hb), dtype=torch.uint8)
    dst[: head.numel()].copy_(head)
    cursor = head.numel()
    for p in plan.header.parts:
        t = tensors[p.name]
        if DTYPE_NAMES.get(t.dtype) != p.dtype or tuple(t.shape) != p.shape:
            raise InvalidRequest(
                f"part {p.name!r} is {t.dtype} {tuple(t.shape)}, the plan says {p.dtype} {p.shape}"
            )
        if p.offset > cursor:
            dst[cursor : p.offset].zero_()
        if p.length:
            src = t.detach().contiguous().reshape(-1).view(torch.uint8)
            dst[p.offset : p.offset + p.length].copy_(src)
        cursor = p.offset + p.length
    body_end = total - TRAILER_SIZE
    if cursor < body_end:
        dst[cursor:body_end].zero_()
    if algorithm == cks.KVSUM64 and dst.device.type == "cuda":  # on the device: two passes, no copy out
        trailer = _TRAILER.pack(_device_kvsum(dst[:body_end]), TRAILER_MAGIC)
        dst[body_end:total].copy_(torch.frombuffer(bytearray(trailer), dtype=torch.uint8))
        return _device_kvsum(dst)
    hasher = xxhash.xxh3_64() if algorithm == cks.XXH3 else cks.KvsumHasher()
    hasher.update(_host_bytes(dst[:body_end]))
    body_sum = hasher.intdigest()
    trailer = _TRAILER.pack(body_sum, TRAILER_MAGIC)
    dst[body_end:total].copy_(torch.frombuffer(bytearray(trailer), dtype=torch.uint8))
    hasher.update(trailer)
    return hasher.intdigest()


def encode_tensors(
    tensors: Mapping[str, torch.Tensor],
    *,
    fingerprint: str,
    token_count: int,
    meta: Mapping[str, Any] | None = None,
    layers: Mapping[str, int] | None = None,
) -> bytearray:
    """Convenience: a blob as a new bytearray (one copy; prefer plan_blob + write_blob into
    a reserved region on the hot path)."""
    plan = plan_blob(tensors, fingerprint=fingerprint, token_count=token_count, meta=meta, layers=layers)
    out = bytearray(plan.total_size)
    write_blob(out, plan, tensors)
    return out


def _read_prefix(u8: torch.Tensor, n: int) -> bytes:
    return bytes(u8[:n].cpu().numpy()) if u8.device.type != "cpu" else bytes(_host_bytes(u8[:n]))


def is_blob(buf: Buffer) -> bool:
    """True when `buf` starts with the blob magic (a cheap sniff, not a validation)."""
    u8 = _as_u8(buf)
    return u8.numel() >= PREAMBLE_SIZE and _read_prefix(u8, len(MAGIC)) == MAGIC


def read_header(buf: Buffer) -> BlobHeader:
    """Parse and validate the preamble and header of a blob (no checksum pass).

    Raises BadObject for truncated, garbage or inconsistent input and VersionMismatch
    for a blob written by another format version.
    """
    u8 = _as_u8(buf)
    n = u8.numel()
    if n < PREAMBLE_SIZE + TRAILER_SIZE:
        raise BadObject(f"object of {n} bytes is too short to be a blob (min {PREAMBLE_SIZE + TRAILER_SIZE})")
    magic, version, _flags, hlen = _PREAMBLE.unpack(_read_prefix(u8, PREAMBLE_SIZE))
    if magic != MAGIC:
        raise BadObject(f"not a kvstore blob: magic {magic!r}, expected {MAGIC!r}")
    if _flags & cks.FLAG_ALGORITHM_MASK not in cks.ALGORITHMS or _flags & ~cks.FLAG_ALGORITHM_MASK:
        raise BadObject(f"blob preamble flags {_flags:#06x} name no known checksum algorithm "
                        f"(known: {cks.ALGORITHMS})")
    if version != FORMAT_VERSION:
        raise VersionMismatch(f"blob format version {version}, this code reads version {FORMAT_VERSION}")
    if hlen > MAX_HEADER_BYTES or PREAMBLE_SIZE + hlen > n:
        raise BadObject(f"blob header length {hlen} exceeds the object's {n} bytes")
    raw = _read_prefix(u8, PREAMBLE_SIZE + hlen)[PREAMBLE_SIZE:]
    try:
        d = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        parts = tuple(
            PartInfo(str(p["name"]), int(p["layer"]), str(p["dtype"]), tuple(int(s) for s in p["shape"]),
                     int(p["offset"]), int(p["length"]))
            for p in d["parts"]
        )
        header = BlobHeader(int(d["version"]), str(d["fingerprint"]), int(d["token_count"]),
                            dict(d.get("meta") or {}), int(d["size"]), parts, hlen,
                            _flags & cks.FLAG_ALGORITHM_MASK)
    except (msgpack.UnpackException, ValueError, KeyError, TypeError) as exc:
        raise BadObject(f"blob header does not decode: {exc!r}") from exc
    if header.version != FORMAT_VERSION:
        raise VersionMismatch(f"blob header version {header.version}, this code reads version {FORMAT_VERSION}")
    if header.total_size > n:
        raise BadObject(f"blob truncated: header says {header.total_size} bytes, object has {n}")
    if header.total_size < PREAMBLE_SIZE + hlen + TRAILER_SIZE:
        raise BadObject(f"blob header says size {header.total_size}, smaller than its own header")
    seen: set[str] = set()
    for p in parts:
        if p.name in seen:
            raise BadObject(f"blob has part {p.name!r} twice")
        seen.add(p.name)
        if p.dtype not in DTYPES:
            raise BadObject(f"blob part {p.name!r} has unknown dtype {p.dtype!r}")
        numel = 1
        for s in p.shape:
            if s < 0:
                raise BadObject(f"blob part {p.name!r} has negative shape {p.shape}")
            numel *= s
        itemsize = ITEMSIZE[p.dtype]
        if p.length != numel * itemsize:
            raise BadObject(f"blob part {p.name!r}: length {p.length} != {p.shape} x {itemsize} bytes")
        if p.offset % ALIGN or p.offset < PREAMBLE_SIZE + hlen or p.offset + p.length > header.total_size - TRAILER_SIZE:
            raise BadObject(f"blob part {p.name!r} at offset {p.offset} length {p.length} is out of bounds or unaligned")
    return header


def verify(buf: Buffer) -> BlobHeader:
    """Validate a blob fully: header, bounds and the trailer checksum. Returns the header.

    Raises BadObject (naming what is wrong) or VersionMismatch.
    """
    header = read_header(buf)
    u8 = _as_u8(buf)[: header.total_size]
    body_end = header.total_size - TRAILER_SIZE
    stored, tmagic = _TRAILER.unpack(bytes(_host_bytes(u8[body_end:])))
    if tmagic != TRAILER_MAGIC:
        raise BadObject(f"blob trailer magic {tmagic!r} is wrong (torn or truncated write?)")
    algorithm = cks.algorithm_of(_read_prefix(u8, PREAMBLE_SIZE))
    if algorithm == cks.KVSUM64 and u8.device.type == "cuda":
        actual = _device_kvsum(u8[:body_end])
    elif algorithm == cks.KVSUM64:
        h = cks.KvsumHasher()
        h.update(_host_bytes(u8[:body_end]))
        actual = h.intdigest()
    else:
        actual = xxhash.xxh3_64_intdigest(_host_bytes(u8[:body_end]))
    if actual != stored:
        raise BadObject(f"blob checksum mismatch: trailer says {stored:#018x}, bytes hash to {actual:#018x}")
    return header


def decode_tensors(buf: Buffer, *, check: bool = True) -> tuple[BlobHeader, dict[str, torch.Tensor]]:
    """Decode a blob into (header, name -> tensor) without copying tensor bytes.

    Each tensor is a view over `buf` (same device as `buf`), valid while `buf` is. With
    `check=True` the trailer checksum is verified first (one pass over the bytes); pass
    `check=False` when the store has verified the object already (it does before it
    first serves an object, and on reads from NVMe).
    """
    header = verify(buf) if check else read_header(buf)
    return header, tensors_over(header, buf)


def tensors_over(header: BlobHeader, buf: Buffer) -> dict[str, torch.Tensor]:
    """name -> tensor view over `buf` for each part of `header`: `buf` holds the blob's
    bytes (the leased region itself, or a copy of it on another device, so a blob moved
    to the GPU in one DMA is decoded from its host header without reading device memory)."""
    u8 = _as_u8(buf)
    if u8.numel() < header_span(header):
        raise BadObject(f"buffer of {u8.numel()} bytes is shorter than the blob's parts ({header_span(header)})")
    out: dict[str, torch.Tensor] = {}
    typed: dict[str, torch.Tensor] = {}  # the buffer viewed once per dtype; parts are strided views of it
    for p in header.parts:
        dtype = DTYPES[p.dtype]
        if p.length == 0:
            out[p.name] = torch.empty(p.shape, dtype=dtype, device=u8.device)
            continue
        size = ITEMSIZE[p.dtype]
        base = typed.get(p.dtype)
        if base is None:
            base = typed[p.dtype] = u8[: u8.numel() - u8.numel() % size].view(dtype)
        strides, acc = [], 1
        for d in reversed(p.shape):
            strides.append(acc)
            acc *= d
        out[p.name] = base.as_strided(p.shape, tuple(reversed(strides)), base.storage_offset() + p.offset // size)
    return out


def header_span(header: BlobHeader) -> int:
    """Bytes from the blob's start to the end of its last part."""
    return max((p.offset + p.length for p in header.parts), default=0)
