"""Where HiSparse blocks live off the device: the `BlockStore` interface, host copies of
device blocks, and `MemoryBlockStore` (this process's memory; the fallback without a
kvstore daemon). The daemon-backed store is engine/hisparse/daemon_store.py.

Contract of a `BlockStore` (all calls from the engine thread unless stated):
- `put(key, k, v, meta)` returns at once. It first takes a host copy of `k`/`v` `[block,
  Hkv, D]` (on CUDA an asynchronous device-to-host copy on the current stream, into
  pinned memory), so the caller may overwrite the device rows right after. From the
  moment `put` returns the block is readable (a block still queued for its write is
  served from its host copy).
- `put_host(key, block, meta)` is `put` of a block already on the host (a `HostBlock`
  whose `event`, if any, marks when its bytes are complete; the layer caches pass views of
  their pinned mirror). The store may keep the views: the caller leaves those bytes alone
  until it discards the key.
- `read_into(keys, k_dst, v_dst, rows)` copies block `keys[i]` into the rows
  `k_dst[rows[i]]`, `v_dst[rows[i]]` of device tensors `[N, block, Hkv, D]`, all of them
  or none: a block it cannot read raises `BlocksLost` naming every missing key, and then
  the destination rows hold nothing the caller may use. On CUDA the copies are ordered
  before any later work on the current stream.
- `discard(keys)` forgets blocks (a freed sequence's); `flush()` waits for queued puts;
  `close()` flushes and stops. Both are idempotent.
- `tier_of_last_read` is not offered: bytes and seconds per tier go to the metrics.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from engine.hisparse.errors import BlocksLost
from engine.hisparse.metrics import HiSparseMetrics

#: key space of HiSparse blocks in the kvstore daemon (docs/hisparse.md)
KEY_PREFIX = b"kvengine-hisparse-v1\x00"
#: record `extra["kind"]` of a HiSparse block object
OBJECT_KIND = "hisparse-block"


def block_key(engine_nonce: bytes, sequence_nonce: bytes, layer: int, block: int) -> bytes:
    """The key of one block: prefix, the engine's and the sequence's random nonces (so no
    other engine can name, and no later sequence reuses, a block), layer, block index."""
    return KEY_PREFIX + engine_nonce + sequence_nonce + layer.to_bytes(2, "little") + block.to_bytes(4, "little")


@dataclass(frozen=True)
class BlockMeta:
    """What the store records beside a block's bytes."""

    layer: int
    block: int
    tokens: int
    fingerprint: str = ""


@dataclass
class HostBlock:
    """A host copy of one block; `event` (CUDA) marks when the copy is complete."""

    k: torch.Tensor
    v: torch.Tensor
    event: Any = None

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


def host_copy(k: torch.Tensor, v: torch.Tensor) -> HostBlock:
    """Copy device rows to the host: a clone on the CPU; on CUDA a non-blocking copy into
    pinned memory with an event recorded after it on the current stream."""
    if k.device.type != "cuda":
        return HostBlock(k.clone(), v.clone())
    hk = torch.empty(k.shape, dtype=k.dtype, pin_memory=True)
    hv = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
    hk.copy_(k, non_blocking=True)
    hv.copy_(v, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return HostBlock(hk, hv, event)


def scatter_rows(src_k: Sequence[torch.Tensor], src_v: Sequence[torch.Tensor], k_dst: torch.Tensor,
                 v_dst: torch.Tensor, rows: Sequence[int]) -> None:
    """Copy host blocks `src_k[i]`/`src_v[i]` into `k_dst[rows[i]]`/`v_dst[rows[i]]` in one
    batch: on CUDA the blocks are gathered into one pinned staging buffer (a host copy),
    sent in one non-blocking transfer on the current stream and scattered with one
    `index_copy_`; on the CPU one `index_copy_`."""
    if not rows:
        return
    idx = torch.tensor(list(rows), dtype=torch.long)
    cuda = k_dst.device.type == "cuda"
    if cuda:
        idx = idx.pin_memory().to(k_dst.device, non_blocking=True)
    for srcs, dst in ((src_k, k_dst), (src_v, v_dst)):
        shape = (len(srcs), *dst.shape[1:])
        parts = [t.view(dst.shape[1:]) for t in srcs]
        if cuda:
            stage = torch.empty(shape, dtype=dst.dtype, pin_memory=True)
            torch.stack(parts, out=stage)
            dst.index_copy_(0, idx, stage.to(dst.device, non_blocking=True))
        else:
            dst.index_copy_(0, idx, torch.stack(parts).to(dst.dtype))


class BlockStore(ABC):
    """See the module docstring for the contract."""

    def __init__(self, metrics: Optional[HiSparseMetrics] = None) -> None:
        self.metrics = metrics or HiSparseMetrics()

    @abstractmethod
    def put(self, key: bytes, k: torch.Tensor, v: torch.Tensor, meta: BlockMeta) -> None:
        """Queue block `key` (module docstring)."""

    def put_host(self, key: bytes, block: HostBlock, meta: BlockMeta) -> None:
        """Queue a block already on the host (module docstring); by default a `put` once its
        bytes are complete."""
        block.wait()
        self.put(key, block.k, block.v, meta)

    @abstractmethod
    def read_into(self, keys: Sequence[bytes], k_dst: torch.Tensor, v_dst: torch.Tensor, rows: Sequence[int]) -> None:
        """Copy blocks into rows of device tensors, all or none (module docstring)."""

    @abstractmethod
    def discard(self, keys: Sequence[bytes]) -> None:
        """Forget blocks."""

    def flush(self) -> None:
        """Wait until every queued put is done (nothing to wait for by default)."""

    def close(self) -> None:
        self.flush()

    @property
    def name(self) -> str:
        return type(self).__name__


class MemoryBlockStore(BlockStore):
    """Blocks in this process's memory (pinned on CUDA): the store without a daemon.
    Puts are complete when `put` returns (a host copy); reads are one copy back."""

    TIER = "process"

    def __init__(self, metrics: Optional[HiSparseMetrics] = None) -> None:
        super().__init__(metrics)
        self._blocks: dict[bytes, HostBlock] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, key: bytes, k: torch.Tensor, v: torch.Tensor, meta: BlockMeta) -> None:
        t0 = time.perf_counter()
        hb = host_copy(k, v)
        self._blocks[key] = hb
        self.metrics.add_write(self.TIER, hb.nbytes, time.perf_counter() - t0)

    def put_host(self, key: bytes, block: HostBlock, meta: BlockMeta) -> None:
        self._blocks[key] = block  # the caller's host bytes, kept as they are (no copy)
        self.metrics.add_write(self.TIER, block.nbytes, 0.0)

    def read_into(self, keys: Sequence[bytes], k_dst: torch.Tensor, v_dst: torch.Tensor, rows: Sequence[int]) -> None:
        missing = [key for key in keys if key not in self._blocks]
        if missing:
            self.metrics.blocks_lost += len(missing)
            raise BlocksLost(missing, "not in this process's block store")
        t0 = time.perf_counter()
        blocks = [self._blocks[key] for key in keys]
        for b in blocks:
            b.wait()
        scatter_rows([b.k for b in blocks], [b.v for b in blocks], k_dst, v_dst, rows)
        self.metrics.add_read(self.TIER, sum(b.nbytes for b in blocks), time.perf_counter() - t0)

    def discard(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._blocks.pop(key, None)
