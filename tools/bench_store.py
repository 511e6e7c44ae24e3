"""Benchmark of the kvstore data plane against the bare hardware paths, in one run.

Starts a real daemon (subprocess, unix socket) on a directory of your choice and
measures, for the same bytes:

  CPU tier   put / get (batched lease + copy out)  vs  memcpy in this process
  NVMe tier  put (fsync'ed) / get (cold)      vs  dd-style O_DIRECT write+fsync / read, same directory
             (gets without promotion: copy_to a host buffer, client-verified; the same with
             the daemon's read-back; a copy through the zero-copy view (.array); into a GPU
             tensor (CUDA only). Reads: best of 3 cold runs interleaved with the baseline's,
             which also gets the client reader's threads and piece size)
  GPU tier   put / get into a GPU tensor      vs  device-to-device copy            (CUDA only)
  CPU tier   get into a GPU tensor            vs  pinned host-to-device copy       (CUDA only)
  gRPC       the same bytes inside gRPC messages to a sink process (put / get)
  NVMe read  backends side by side (kvstore.tiers.nvme_read): posix (O_DIRECT into pinned
             memory + H2D) and kvikio (where it imports and CUDA is present), cold reads into a
             GPU tensor, and the backend `auto` picks here (--no-nvme-backends skips it)
  lookup     p50 / p99 latency of a 64-key batch Lookup, on the client's default path (the
             daemon's fast socket) and over gRPC alone

Prints one table (last). With --json, also writes docs/results/store-<machine>-<date>.json
whose `summary` holds cpu_to_gpu_fraction_of_pcie (null without CUDA),
nvme_read_fraction_of_direct_io (the host-buffer row), nvme_to_gpu_fraction_of_direct_io
(null without CUDA), lookup_p99_us (the client's default path, named by
lookup_path), lookup_grpc_p99_us, nvme_read_gb_per_s_by_backend, nvme_read_backend_auto
and gds_available. `--lookup-only` measures just the lookups.

    python tools/bench_store.py                       # defaults: 8 x 64MiB objects per path
    python tools/bench_store.py --dir /mnt/nvme/kvbench --json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import mmap
import os
import platform
import shutil
import socket as _socket
import statistics
import sys
import tempfile
import time
from concurrent import futures
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from kvstore.client.fileio import DEFAULT_SETTINGS as FILE_READ, aligned_empty  # noqa: E402
from kvstore.config import format_size, parse_size  # noqa: E402
from kvstore.testing import DaemonProcess, drop_page_cache  # noqa: E402
from tools.storebench.grpc_baseline import grpc_gbps, run_sink  # noqa: E402

DIRECT_BLOCK = 16 << 20  # bytes per O_DIRECT request in the dd-style baseline


@dataclass
class Row:
    path: str
    op: str
    gbps: Optional[float]
    baseline: str
    baseline_gbps: Optional[float]
    note: str = ""

    @property
    def ratio(self) -> Optional[float]:
        if self.gbps is None or not self.baseline_gbps:
            return None
        return self.gbps / self.baseline_gbps


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _timed(fn: Callable[[], Any], repeat: int = 1) -> float:
    """Best-of-`repeat` wall time of fn()."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# ---------------------------------------------------------------------------- baselines


def memcpy_gbps(src: np.ndarray, dst: np.ndarray, repeat: int) -> float:
    np.copyto(dst, src)  # warm both buffers
    return _gbps(src.nbytes, _timed(lambda: np.copyto(dst, src), repeat))


class DirectIO:
    """The dd-style baseline on `count` files of data.nbytes in `directory`: O_DIRECT
    writes (+ fsync) and cold O_DIRECT reads straight into a page-aligned buffer. A read
    runs two ways, the faster counting: one stream of DIRECT_BLOCK requests (dd), and the
    store client's own parallelism (kvstore.client.fileio defaults: `threads` preads of
    `piece_bytes` in flight), so the client's reader has no option the baseline lacks.
    Falls back to buffered I/O + fadvise(DONTNEED) where the file system refuses O_DIRECT
    (tmpfs, some overlays); `note` says which ran."""

    def __init__(self, directory: Path, data: np.ndarray, count: int) -> None:
        self.data = data
        self.size = data.nbytes
        self.buf = mmap.mmap(-1, max(DIRECT_BLOCK, 4096))  # page-aligned: O_DIRECT needs aligned memory
        self.view = np.frombuffer(self.buf, dtype=np.uint8)
        self.out = aligned_empty(self.size)
        self.files = [directory / f"direct-{i}.bin" for i in range(count)]
        self.flag = getattr(os, "O_DIRECT", 0)
        self.note = "O_DIRECT"
        self.pool = futures.ThreadPoolExecutor(FILE_READ.threads)
        try:
            os.close(os.open(self.files[0], os.O_WRONLY | os.O_CREAT | self.flag, 0o600))
        except OSError:
            self.flag, self.note = 0, "buffered + fadvise(DONTNEED): O_DIRECT unsupported here"

    def write_gbps(self) -> float:
        def write_all() -> None:
            for f in self.files:
                fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | self.flag, 0o600)
                try:
                    off = 0
                    while off < self.size:
                        n = min(DIRECT_BLOCK, self.size - off)
                        nal = (n + 4095) // 4096 * 4096
                        self.view[:n] = self.data[off: off + n]
                        os.pwrite(fd, memoryview(self.buf)[:nal], off)
                        off += n
                    os.ftruncate(fd, self.size)
                    os.fsync(fd)
                finally:
                    os.close(fd)

        return _gbps(self.size * len(self.files), _timed(write_all))

    def _read_all(self, piece: int, parallel: bool) -> None:
        size, out = self.size, self.out
        aligned = size - size % 4096
        spans = [(o, min(piece, aligned - o)) for o in range(0, aligned, piece)]
        for f in self.files:
            fd = os.open(f, os.O_RDONLY | self.flag)
            try:
                def read(span: tuple[int, int]) -> None:
                    o, n = span
                    while n:
                        got = os.preadv(fd, [out[o: o + n]], o)
                        if got <= 0:
                            raise RuntimeError(f"short read of {f} at {o}")
                        o, n = o + got, n - got

                if parallel:
                    list(self.pool.map(read, spans))
                else:
                    for span in spans:
                        read(span)
                if aligned < size:  # a ragged tail: through the aligned scratch buffer
                    os.preadv(fd, [self.view[:4096]], aligned)
                    out[aligned:] = self.view[: size - aligned]
            finally:
                os.close(fd)

    def read_seconds(self) -> tuple[float, str]:
        """One cold read of every file each way (page cache dropped before each): the
        faster one's seconds, and which way that was."""
        ways = {f"1 stream x {DIRECT_BLOCK >> 20} MiB": (DIRECT_BLOCK, False),
                f"{FILE_READ.threads} threads x {FILE_READ.piece_bytes >> 20} MiB": (FILE_READ.piece_bytes, True)}
        best, won = float("inf"), ""
        for name, (piece, parallel) in ways.items():
            for f in self.files:
                drop_page_cache(str(f))
            t = _timed(lambda: self._read_all(piece, parallel))  # noqa: B023 (called at once)
            if t < best:
                best, won = t, name
        return best, won

    def close(self) -> None:
        self.pool.shutdown()
        for f in self.files:
            f.unlink(missing_ok=True)


# ---------------------------------------------------------------------------- the store


def store_rows(daemon: DaemonProcess, data: np.ndarray, count: int, cuda: bool,
               memcpy: float, direct: DirectIO, direct_write: float,
               cold_repeat: int) -> tuple[list[Row], dict[str, Any]]:
    import torch

    size = data.nbytes
    total = size * count
    rows: list[Row] = []
    extra: dict[str, Any] = {}
    out = np.empty(size, dtype=np.uint8)
    with daemon.client() as kv:
        # CPU tier
        keys = [f"bench/cpu/{i}".encode() for i in range(count)]
        # Steady state: a first pass faults the arena's pages into this client's mapping
        # (a long-lived engine pays that once); the timed pass reuses the same extents.
        for k in keys:
            kv.put(k, data, tier="cpu")
            kv.get(k).release()
        kv.delete(keys)
        put_s = _timed(lambda: [kv.put(k, data, tier="cpu") for k in keys])

        def get_cpu() -> None:  # one batched Get, copy every object out, one batched Release
            views = kv.get_many(keys)
            for v in views:
                np.copyto(out, v.array)
            kv.release_many(views)

        first_s = _timed(get_cpu)  # the first get after the put pays any deferred verification
        get_s = _timed(get_cpu, repeat=2)
        rows.append(Row("cpu tier", "put", _gbps(total, put_s), "memcpy", memcpy))
        rows.append(Row("cpu tier", "get (copy out)", _gbps(total, get_s), "memcpy", memcpy))
        rows.append(Row("cpu tier", "first get after put", _gbps(total, first_s), "memcpy", memcpy,
                        "includes deferred commit verification"))

        if cuda:
            dst = torch.empty(size, dtype=torch.uint8, device="cuda")
            pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            pinned.copy_(torch.from_numpy(data))
            dst.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()

            def h2d() -> None:
                for _ in range(count):
                    dst.copy_(pinned, non_blocking=True)
                torch.cuda.synchronize()

            def get_to_gpu(verify: bool = False) -> None:
                # ObjectView.copy_to: the arena is pinned (cudaHostRegister, once per client),
                # pieces go out as non_blocking DMAs on a side stream; verify=True hashes each
                # piece on the host while the DMA of the next runs.
                views = kv.get_many(keys)
                for v in views:
                    v.copy_to(dst, verify=verify)
                torch.cuda.synchronize()
                kv.release_many(views)

            h2d_s = _timed(h2d, repeat=3)
            g2g_s = _timed(get_to_gpu, repeat=3)
            rows.append(Row("cpu tier", "get into GPU tensor", _gbps(total, g2g_s), "pinned H2D", _gbps(total, h2d_s)))
            extra["cpu_to_gpu_fraction_of_pcie"] = rows[-1].ratio
            g2g_v = _timed(lambda: get_to_gpu(verify=True), repeat=2)
            rows.append(Row("cpu tier", "get into GPU tensor, client-verified", _gbps(total, g2g_v), "pinned H2D",
                            _gbps(total, h2d_s), "xxh3 of each piece overlaps its DMA"))
        kv.delete(keys)

        # NVMe tier
        keys = [f"bench/nvme/{i}".encode() for i in range(count)]
        put_s = _timed(lambda: [kv.put(k, data, tier="nvme") for k in keys])
        paths = []
        for k in keys:
            with kv.get(k, promote=False) as v:
                paths.append(v.lease.region.path if v.lease.region.kind == "file" else None)

        def cold(fn: Callable[[], Any]) -> float:  # one run, the page cache dropped first
            for p in paths:
                if p:
                    drop_page_cache(p)
            return _timed(fn)

        host = torch.from_numpy(aligned_empty(size))  # page-aligned: O_DIRECT reads land in place

        def get_nvme(dst: Any, client_verifies: bool = True) -> None:
            # ObjectView.copy_to of a file region: parallel preads (O_DIRECT where aligned),
            # into a GPU tensor through pinned staging buffers; verify=True hashes each piece
            # as it lands, and client_verifies=True lets the daemon skip its read-back.
            views = kv.get_many(keys, promote=False, client_verifies=client_verifies)
            for v in views:
                v.copy_to(dst, verify=client_verifies)
            if dst.is_cuda:
                torch.cuda.synchronize()
            kv.release_many(views)

        def get_nvme_mapped() -> None:  # the zero-copy view: the daemon reads it back, then copy via the mapping
            views = kv.get_many(keys, promote=False)
            for v in views:
                np.copyto(host.numpy(), v.array)
            kv.release_many(views)

        ways: dict[str, Callable[[], Any]] = {"host": lambda: get_nvme(host),
                                              "daemon": lambda: get_nvme(host, client_verifies=False),
                                              "mapped": get_nvme_mapped}
        if cuda:
            gpu_dst = torch.empty(size, dtype=torch.uint8, device="cuda")
            get_nvme(gpu_dst)  # warm: the pinned staging ring, the side stream
            ways["gpu"] = lambda: get_nvme(gpu_dst)
        best = {k: float("inf") for k in ways}
        base_s, won = float("inf"), ""
        for _ in range(cold_repeat):  # interleaved with the baseline: each sees the same disk
            t, how = direct.read_seconds()
            if t < base_s:
                base_s, won = t, how
            for k, fn in ways.items():
                best[k] = min(best[k], cold(fn))
        base = _gbps(total, base_s)
        odd = "" if all(paths) else "; some objects were not file regions"
        rows.append(Row("nvme tier", "put (fsync)", _gbps(total, put_s), "direct-I/O write", direct_write,
                        direct.note + odd))
        rows.append(Row("nvme tier", "get (cold, no promote)", _gbps(total, best["host"]), "direct-I/O read", base,
                        f"copy_to host buffer, client-verified; baseline {direct.note}, {won}{odd}"))
        extra["nvme_read_fraction_of_direct_io"] = rows[-1].ratio
        rows.append(Row("nvme tier", "get (cold, no promote), daemon-verified", _gbps(total, best["daemon"]),
                        "direct-I/O read", base, "the daemon reads it back, then copy_to from the page cache"))
        rows.append(Row("nvme tier", "get (cold, no promote), via .array", _gbps(total, best["mapped"]),
                        "direct-I/O read", base, "the daemon reads it back, then a copy through the mapping"))
        if cuda:
            rows.append(Row("nvme tier", "get (cold, no promote) into GPU tensor", _gbps(total, best["gpu"]),
                            "direct-I/O read", base, "pinned staging, DMA overlaps reads, client-verified"))
            extra["nvme_to_gpu_fraction_of_direct_io"] = rows[-1].ratio
        for p in paths:
            if p:
                drop_page_cache(p)
        get_s = _timed(lambda: kv.release_many(kv.get_many(keys)))  # promote: the daemon reads into its arena
        rows.append(Row("nvme tier", "get (cold, promote to cpu)", _gbps(total, get_s), "direct-I/O read", base,
                        "one run: the first promotes"))
        kv.delete(keys)

        # GPU tier
        if cuda and "gpu" in (kv.info.tiers if kv.info else ()):
            keys = [f"bench/gpu/{i}".encode() for i in range(count)]
            src = torch.from_numpy(data).cuda()
            dst = torch.empty_like(src)

            def d2d() -> None:
                for _ in range(count):
                    dst.copy_(src)
                torch.cuda.synchronize()

            d2d_s = _timed(d2d, repeat=3)
            for k in keys:  # warm: open the IPC handle, settle the allocator
                kv.put_tensors(k, {"x": src}, tier="gpu")
            kv.delete(keys)
            put_s = _timed(lambda: [kv.put_tensors(k, {"x": src}, tier="gpu") for k in keys])

            def get_gpu() -> None:
                views = kv.get_many(keys)
                for v in views:
                    dst.copy_(v.tensor()[: dst.numel()])
                torch.cuda.synchronize()
                kv.release_many(views)

            get_s = _timed(get_gpu, repeat=2)
            rows.append(Row("gpu tier", "put_tensors (from GPU)", _gbps(total, put_s), "D2D copy", _gbps(total, d2d_s),
                            "includes the blob checksum"))
            rows.append(Row("gpu tier", "get into GPU tensor", _gbps(total, get_s), "D2D copy", _gbps(total, d2d_s)))
            kv.delete(keys)
    return rows, extra


@dataclass
class LookupLatency:
    """p50 / p99 of a 64-key Lookup on the client's default path (`path`: "fast" when it
    used the daemon's fast socket, else "grpc") and over gRPC alone."""

    path: str
    p50_us: float
    p99_us: float
    grpc_p50_us: float
    grpc_p99_us: float


def nvme_backends(work: Path, data: np.ndarray, count: int, cuda: bool, repeat: int) -> dict:
    """The NVMe read backends side by side (kvstore.tiers.nvme_read.calibrate): one file of
    `count` x the object, read cold into a GPU tensor (host memory without CUDA) by each
    usable backend, best of `repeat`; and what `auto` picks on this machine."""
    from kvstore.tiers.nvme_read import calibrate, resolve_backend

    path = work / "nvme-backends.bin"
    with open(path, "wb") as f:
        for _ in range(count):
            f.write(memoryview(data))
        f.flush()
        os.fsync(f.fileno())
    n = data.size * count
    got = calibrate(str(path), 0, n, "cuda" if cuda else "cpu", repeats=repeat)
    path.unlink()
    where = "gpu" if cuda else "host"
    posix = got["gb_per_s"].get("posix")
    rows = [Row(f"nvme -> {where}", "read (posix: O_DIRECT + pinned + H2D)" if cuda else "read (posix: O_DIRECT)",
                posix, "-", None, f"cold, best of {repeat}, {format_size(n)}")]
    if "kvikio" in got["gb_per_s"]:
        rows.append(Row(f"nvme -> {where}", "read (kvikio" + (", GDS)" if got["gds"] else ", compat mode)"),
                        got["gb_per_s"]["kvikio"], "posix read", posix, f"cold, best of {repeat}"))
    return {"rows": rows, "gb_per_s": got["gb_per_s"], "skipped": got["skipped"], "gds": got["gds"],
            "auto": resolve_backend("auto")}


def _latencies_us(call: Callable[[], Any], iterations: int) -> list[float]:
    for _ in range(50):
        call()
    lat = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        call()
        lat.append((time.perf_counter() - t0) * 1e6)
    return lat


def _p50_p99(lat: list[float]) -> tuple[float, float]:
    lat = sorted(lat)
    return statistics.median(lat), lat[min(len(lat) - 1, int(0.99 * len(lat)))]


def lookup_latency_us(daemon: DaemonProcess, batch: int, iterations: int) -> LookupLatency:
    """Half the keys present (CPU tier), half absent. The two paths run interleaved in
    rounds (samples pooled per path), so load from other processes falls on both alike."""
    with daemon.client() as kv:
        keys = [f"bench/lookup/{i}".encode() for i in range(batch)]
        for k in keys[: batch // 2]:
            kv.put(k, b"x" * 64, tier="cpu")
        if kv.lookup(keys) != kv.lookup_grpc(keys):
            raise RuntimeError("the fast and the gRPC Lookup disagree")
        path = "fast" if kv._fast.connected else "grpc"
        rounds = 4
        fast: list[float] = []
        grpc_: list[float] = []
        for _ in range(rounds):
            fast += _latencies_us(lambda: kv.lookup(keys), max(1, iterations // rounds))
            grpc_ += _latencies_us(lambda: kv.lookup_grpc(keys), max(1, iterations // rounds))
        kv.delete(keys)
    return LookupLatency(path, *_p50_p99(fast), *_p50_p99(grpc_))


# ---------------------------------------------------------------------------- main


def print_table(rows: list[Row], lk: LookupLatency, header: str) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # plain text where rich is absent
        print(header)
        for r in rows:
            print(f"{r.path:10} {r.op:28} {r.gbps or 0:8.2f} GB/s  vs {r.baseline:18} {r.baseline_gbps or 0:8.2f} "
                  f"GB/s  ratio {r.ratio or 0:.2f}  {r.note}")
        print(f"lookup (64 keys, {lk.path}) p50 {lk.p50_us:.0f} us  p99 {lk.p99_us:.0f} us")
        print(f"lookup (64 keys, grpc) p50 {lk.grpc_p50_us:.0f} us  p99 {lk.grpc_p99_us:.0f} us")
        return
    t = Table(title=header, title_justify="left")
    for col in ("path", "op", "GB/s", "baseline", "baseline GB/s", "ratio", "note"):
        t.add_column(col, justify="right" if "GB/s" in col or col == "ratio" else "left")
    for r in rows:
        t.add_row(r.path, r.op, f"{r.gbps:.2f}" if r.gbps is not None else "-", r.baseline,
                  f"{r.baseline_gbps:.2f}" if r.baseline_gbps else "-", f"{r.ratio:.2f}" if r.ratio else "-", r.note)
    t.add_row("lookup", f"64-key batch, {lk.path} socket (default)", "", "", "", "",
              f"p50 {lk.p50_us:.0f} us, p99 {lk.p99_us:.0f} us")
    t.add_row("lookup", "64-key batch, gRPC unix socket", "", "", "", "",
              f"p50 {lk.grpc_p50_us:.0f} us, p99 {lk.grpc_p99_us:.0f} us")
    Console(width=160).print(t)


def lookup_only(directory: Optional[Path], iterations: int) -> int:
    base = (directory or Path.home() / ".cache" / "kvstore-bench").expanduser()
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=base))
    try:
        with DaemonProcess(work / "daemon", cpu_capacity="64MiB", nvme_capacity="64MiB", entry="kvstore.server") \
                as daemon:
            lk = lookup_latency_us(daemon, 64, iterations)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(asdict(lk)))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="64MiB", help="object size (default 64MiB)")
    ap.add_argument("--count", type=int, default=8, help="objects per path (default 8)")
    ap.add_argument("--dir", type=Path, default=None,
                    help="directory for the NVMe tier and the direct-I/O baseline (default: ~/.cache/kvstore-bench)")
    ap.add_argument("--grpc-chunk", default="4MiB", help="bytes per gRPC message in the gRPC baseline")
    ap.add_argument("--cold-repeat", type=int, default=3,
                    help="cold NVMe reads (and their direct-I/O baseline) count the best of this many runs, "
                         "the page cache dropped before each (default 3)")
    ap.add_argument("--lookup-iterations", type=int, default=2000)
    ap.add_argument("--json", action="store_true", help="also write docs/results/store-<machine>-<date>.json")
    ap.add_argument("--machine", default=None, help="machine name for the JSON file (default: hostname)")
    ap.add_argument("--lookup-only", action="store_true",
                    help="measure only the Lookup latency (both paths); prints it, writes no JSON")
    ap.add_argument("--no-nvme-backends", dest="nvme_backends", action="store_false",
                    help="skip the NVMe read backends side by side (posix: O_DIRECT + pinned + H2D; kvikio where it "
                         "imports and CUDA is present)")
    ap.add_argument("--grpc-sink", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    chunk = parse_size(args.grpc_chunk, "--grpc-chunk")
    if args.grpc_sink:
        run_sink(args.grpc_sink, chunk)
        return 0
    if args.cold_repeat < 1:
        ap.error(f"--cold-repeat must be >= 1, got {args.cold_repeat}")
    if args.lookup_only:
        if args.json:
            ap.error("--lookup-only writes no JSON (the JSON file needs the data-plane rows); drop --json")
        return lookup_only(args.dir, args.lookup_iterations)

    import torch

    size, count = parse_size(args.size, "--size"), args.count
    cuda = torch.cuda.is_available()
    base = (args.dir or Path.home() / ".cache" / "kvstore-bench").expanduser()
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=base))
    data = np.frombuffer(os.urandom(size), dtype=np.uint8)
    room = size * count + (64 << 20)
    direct: Optional[DirectIO] = None
    try:
        memcpy = memcpy_gbps(data, np.empty_like(data), repeat=5)
        direct = DirectIO(work, data, count)
        direct_write = direct.write_gbps()
        grpc_put, grpc_get = grpc_gbps(data, count, chunk, work)
        daemon = DaemonProcess(work / "daemon", cpu_capacity=str(room), nvme_capacity=str(room),
                               gpu_capacity=str(room) if cuda else "0", entry="kvstore.server")
        with daemon:
            rows, extra = store_rows(daemon, data, count, cuda, memcpy, direct, direct_write, args.cold_repeat)
            lk = lookup_latency_us(daemon, 64, args.lookup_iterations)
        backends = nvme_backends(work, data, count, cuda, args.cold_repeat) if args.nvme_backends else None
        if backends:
            rows += backends.pop("rows")
        cpu_put = next(r.gbps for r in rows if r.path == "cpu tier" and r.op == "put")
        cpu_get = next(r.gbps for r in rows if r.path == "cpu tier" and r.op.startswith("get (copy"))
        rows.append(Row("gRPC bytes", "put (in messages)", grpc_put, "cpu tier put", cpu_put,
                        f"{format_size(chunk)} messages"))
        rows.append(Row("gRPC bytes", "get (in messages)", grpc_get, "cpu tier get", cpu_get,
                        f"{format_size(chunk)} messages"))
    finally:
        if direct is not None:
            direct.close()
        shutil.rmtree(work, ignore_errors=True)

    machine = args.machine or _socket.gethostname().split(".")[0]
    date = _dt.date.today().isoformat()
    header = (f"kvstore data plane on {machine} ({date}): {count} x {format_size(size)} per path, steady state; "
              f"CUDA {'yes: ' + torch.cuda.get_device_name() if cuda else 'no'}; dir {base}")
    summary = {
        "cpu_to_gpu_fraction_of_pcie": extra.get("cpu_to_gpu_fraction_of_pcie"),
        "nvme_read_fraction_of_direct_io": extra.get("nvme_read_fraction_of_direct_io"),
        "nvme_to_gpu_fraction_of_direct_io": extra.get("nvme_to_gpu_fraction_of_direct_io"),
        "lookup_p50_us": lk.p50_us,
        "lookup_p99_us": lk.p99_us,
        "lookup_path": lk.path,
        "lookup_grpc_p50_us": lk.grpc_p50_us,
        "lookup_grpc_p99_us": lk.grpc_p99_us,
        "nvme_read_gb_per_s_by_backend": (backends or {}).get("gb_per_s"),
        "nvme_read_backend_auto": (backends or {}).get("auto"),
        "gds_available": (backends or {}).get("gds"),
    }
    if args.json:
        out = ROOT / "docs" / "results" / f"store-{machine}-{date}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "machine": machine, "date": date, "python": platform.python_version(), "torch": torch.__version__,
            "cuda_device": torch.cuda.get_device_name() if cuda else None, "object_bytes": size, "objects": count,
            "dir": str(base), "rows": [{**asdict(r), "ratio": r.ratio} for r in rows],
            "lookup": {"batch": 64, "iterations": args.lookup_iterations, "p50_us": lk.p50_us, "p99_us": lk.p99_us,
                       "path": lk.path, "grpc_p50_us": lk.grpc_p50_us, "grpc_p99_us": lk.grpc_p99_us},
            "summary": summary,
        }
        out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {out.relative_to(ROOT)}")
    print_table(rows, lk, header)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
