"""`DaemonBlockStore`: HiSparse blocks in the kvstore daemon (CPU tier, spilling to NVMe
when the daemon's CPU tier is full), written asynchronously and read back zero-copy.

Puts: `put` takes the host copy (engine/hisparse/store.py) and queues the block; a put
thread waits for the copy's event and writes it with `put_tensors` (reserve -> write in
place into the daemon's shared arena -> commit), record `extra` `{"kind":
"hisparse-block", "layer", "block"}`. Until its commit the block is served from the host
copy. A put that fails (daemon away, no capacity) keeps the host copy in this process
(logged once per failure streak, counted as `put_failures`): the block stays readable.

Reads: `get_many` for every block of the call (batches of GET_BATCH keys); each leased
object is decoded in place (`decode_view`: tensor views over the arena or the NVMe
file's mapping, no copy by the client), and the blocks go to their device rows in one
batch (`scatter_rows`: one host copy into a pinned staging buffer, one transfer, one
scatter); leases are released once the host copy is done. A block the daemon does not
have (it restarted without it) or a daemon that cannot be reached raises `BlocksLost`.
Discards (a freed sequence's blocks) are deletes on the put thread.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from engine.hisparse.errors import BlocksLost
from engine.hisparse.metrics import HiSparseMetrics
from engine.hisparse.store import OBJECT_KIND, BlockMeta, BlockStore, HostBlock, host_copy, scatter_rows
from kvstore.client import KVStoreClient
from kvstore.client.views import decode_view
from kvstore.errors import KVStoreError

log = logging.getLogger("engine.hisparse")
_STOP = object()
#: keys per Get request (the daemon refuses batches over its max_batch, 4096 by default)
GET_BATCH = 1024


class DaemonBlockStore(BlockStore):
    """HiSparse blocks in a kvstore daemon (module docstring)."""

    LOCAL_TIER = "process"

    def __init__(self, socket: Optional[Union[str, Path]] = None, metrics: Optional[HiSparseMetrics] = None,
                 tier: Optional[str] = None, client: Optional[KVStoreClient] = None) -> None:
        super().__init__(metrics)
        self._client = client if client is not None else KVStoreClient(socket)
        self._tier = tier
        self._lock = threading.Lock()
        self._pending: dict[bytes, tuple[HostBlock, BlockMeta]] = {}
        self._kept: dict[bytes, HostBlock] = {}
        self._jobs: queue.Queue = queue.Queue()
        self._failing = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hisparse-put", daemon=True)
        self._thread.start()

    @property
    def target(self) -> str:
        return self._client.target

    # ------------------------------------------------------------------ puts
    def put(self, key: bytes, k: torch.Tensor, v: torch.Tensor, meta: BlockMeta) -> None:
        hb = host_copy(k, v)
        with self._lock:
            self._pending[key] = (hb, meta)
        self._jobs.put(("put", key))

    def put_host(self, key: bytes, block: HostBlock, meta: BlockMeta) -> None:
        with self._lock:
            self._pending[key] = (block, meta)
        self._jobs.put(("put", key))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is _STOP:
                    return
                kind, arg = job
                if kind == "put":
                    self._write(arg)
                else:
                    self._delete(arg)
            finally:
                self._jobs.task_done()

    def _write(self, key: bytes) -> None:
        with self._lock:
            item = self._pending.get(key)
        if item is None:  # discarded before its turn
            return
        hb, meta = item
        hb.wait()
        t0 = time.perf_counter()
        try:
            res = self._client.put_tensors(
                key, {"k": hb.k, "v": hb.v}, fingerprint=meta.fingerprint, token_count=meta.tokens, tier=self._tier,
                meta={"layer": meta.layer, "block": meta.block},
                extra={"kind": OBJECT_KIND, "layer": meta.layer, "block": meta.block})
        except KVStoreError as exc:
            with self._lock:
                if self._pending.pop(key, None) is not None:
                    self._kept[key] = hb
            self.metrics.put_failures += 1
            if not self._failing:
                log.warning("hisparse: put of a block to the kvstore daemon failed (%s: %s); keeping such blocks "
                            "in this process's memory until the daemon takes them again", type(exc).__name__, exc)
            self._failing = True
            return
        if self._failing:
            log.info("hisparse: the kvstore daemon takes blocks again")
        self._failing = False
        self.metrics.add_write(res.tier or "cpu", hb.nbytes, time.perf_counter() - t0)
        with self._lock:
            self._pending.pop(key, None)

    def _delete(self, keys: list[bytes]) -> None:
        try:
            self._client.delete(keys)
        except KVStoreError as exc:  # the daemon may be gone; its objects then went with it or expire
            log.debug("hisparse: delete of %d blocks failed: %s", len(keys), exc)

    # ------------------------------------------------------------------ reads
    def read_into(self, keys: Sequence[bytes], k_dst: torch.Tensor, v_dst: torch.Tensor, rows: Sequence[int]) -> None:
        local: list[int] = []
        remote: list[int] = []
        hosts: dict[int, HostBlock] = {}
        with self._lock:
            for i, key in enumerate(keys):
                item = self._pending.get(key)
                hb = item[0] if item is not None else self._kept.get(key)
                if hb is None:
                    remote.append(i)
                else:
                    hosts[i] = hb
                    local.append(i)
        views = self._get([keys[i] for i in remote]) if remote else []
        try:
            t0 = time.perf_counter()
            if local:
                for i in local:
                    hosts[i].wait()
                scatter_rows([hosts[i].k for i in local], [hosts[i].v for i in local], k_dst, v_dst,
                             [rows[i] for i in local])
                self.metrics.add_read(self.LOCAL_TIER, sum(hosts[i].nbytes for i in local), time.perf_counter() - t0)
            if views:
                self._copy_views(views, k_dst, v_dst, [rows[i] for i in remote])
        finally:
            for view in views:
                view.release()

    def _get(self, keys: list[bytes]) -> list:
        t0 = time.perf_counter()
        views: list = []
        try:
            for a in range(0, len(keys), GET_BATCH):
                views.extend(self._client.get_many(keys[a:a + GET_BATCH]))
        except KVStoreError as exc:
            for view in views:
                if view is not None:
                    view.release()
            self.metrics.blocks_lost += len(keys)
            raise BlocksLost(keys, f"the kvstore daemon did not answer ({type(exc).__name__}: {exc})") from exc
        missing = [key for key, view in zip(keys, views) if view is None]
        if missing:
            for view in views:
                if view is not None:
                    view.release()
            self.metrics.blocks_lost += len(missing)
            raise BlocksLost(missing, "the kvstore daemon no longer holds them (restarted or evicted)")
        self._rpc_s = time.perf_counter() - t0
        return views

    def _copy_views(self, views: list, k_dst: torch.Tensor, v_dst: torch.Tensor, rows: list[int]) -> None:
        """Decode each leased blob in place and send them all in one batch (the host copy
        into the staging buffer finishes before this returns, so the leases may go)."""
        t0 = time.perf_counter()
        parts = [decode_view(view).tensors for view in views]
        scatter_rows([p["k"] for p in parts], [p["v"] for p in parts], k_dst, v_dst, rows)
        seconds = time.perf_counter() - t0 + self._rpc_s
        total = sum(view.size for view in views)
        for view in views:  # the batch's time is shared by bytes among the tiers it came from
            self.metrics.add_read(view.tier, view.size, seconds * view.size / total)

    # ------------------------------------------------------------------ lifecycle
    def discard(self, keys: Sequence[bytes]) -> None:
        keys = list(keys)
        with self._lock:
            for key in keys:
                self._pending.pop(key, None)
                self._kept.pop(key, None)
        if keys and not self._closed:
            self._jobs.put(("delete", keys))

    def flush(self) -> None:
        if not self._closed:
            self._jobs.join()

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._jobs.put(_STOP)
        self._thread.join(timeout=10)
        self._client.close()
