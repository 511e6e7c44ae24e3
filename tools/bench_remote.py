"""Benchmark of the remote tier's data path against Mooncake's own Python client, in one run.

Starts a real `mooncake_master` on loopback (embedded HTTP metadata server, TCP
transport) and a *holder* process that mounts a 1 GiB segment into the cluster (the
memory of "another host"); the bench client mounts nothing, so every byte crosses the
loopback TCP transport. For each object size (1, 4, 16, 64 MiB) it times, interleaved
per repeat:

  mooncake   the raw client: `put_from(name, ptr, n)` / `get_into(name, ptr, n)`, the
             zero-copy calls of Mooncake's Python API
  mooncake_verified  the same, plus hashing the bytes read (what integrity costs any caller)
  mooncake_ranged  (objects the adapter reads in pieces: over its `read_split`, 3 MiB,
             or its `read_chunk`, 8 MiB, unless `--read-split` / `--read-chunk`)
             the raw client reading the object as our get does, unverified: one
             `batch_get_session_start`, `batch_get_into_multi_buffer_ranges` per piece,
             `batch_get_session_end`: how much of our get's time is the chunked transfer
             itself and how much the verification beside it
  ours       the daemon's remote path: the adapter's one-object calls as the remote tier
             makes them for one object (`MooncakeAdapter.put_one` / `get_one`, inline on
             the caller's thread, the client's RPC timeout bounding them), plus what the
             tier does around them: on a put, `Tier.host_extent` of the object's slot in a
             real CPU arena with the remote tier's tail room, then
             `kvstore.remote.tier.object_ranges` through that view (`TRAILER_ROOM` past
             the object: the trailer is written there and the object goes as one range;
             `--no-tail-room`: a slot without that room, the trailer as a second range,
             through `call`); the trailer itself is made before the timed put, as
             `RemoteTier.offer` makes it from the commit's checksum;
             on a get, `host_extent` of a fill's slot (the object with its trailer), a
             `PayloadVerifier` over it as the get's `landed` (as `RemoteTier.fill` does:
             objects over `read_chunk` are read in pieces, each hashed as it lands), then
             its `finish` (the trailer checked, the rest of the payload hashed: the
             checksum verified on every remote read)
  ours_alt   (`--alt-read-chunk` / `--alt-read-split BYTES`) ours again with another
             `read_chunk` / `read_split` on the same
             Mooncake client, so two piece sizes (or thresholds) are compared op by op
             under the same load: `*_alt` overheads against the raw client, `*_alt_vs_ours`
             against ours (row `piece_bytes` / `alt_piece_bytes`: each side's pieces)

All sides drive one Mooncake client, the adapter's own (`--client shared`, default), so
only our layer differs: two clients in one process were seen to differ by up to 2x in
put latency on a loaded host, whichever of them was made first (`--client separate`
gives the raw sides a client of their own, as before).

Each op is one object (put, get, remove); the sides alternate op by op, so all
see the same load on a shared machine, and all move the same source and destination
bytes (two slots of one CPU arena, `Buffers`; the raw sides take their addresses once,
so no side makes a tensor call per op; each side's first gets of a repeat land into
zeroed memory and are compared with what was put). A get is timed without the stat that tells the tier an object's
size (on either side). Per row, `ours_steps_ms`: the medians of our steps (put:
encode, call; get: call, including the hashing of pieces as they land, and verify,
what `finish` has left), where our time goes. Per repeat: p50 / p99
latency and throughput (bytes / total time); the JSON holds the median of the repeats
with their min..max spread and our overhead vs the raw client (p50 latency and
throughput), against the 10% target; and the *paired* overhead: the median, over every
op, of ours / the baseline's op run next to it (robust to load that drifts on a shared
machine).

    python tools/bench_remote.py --json              # docs/results/remote-<date>.json
    python tools/bench_remote.py --sizes 1,4 --repeats 3 --iters 8
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import xxhash  # noqa: E402

from kvstore.checksums import host_checksum  # noqa: E402
from kvstore.records import ObjectMeta  # noqa: E402
from kvstore.remote.base import PutItem  # noqa: E402
from kvstore.remote.envelope import (FOOTER_BYTES, MAX_TRAILER_BYTES, PayloadVerifier, encode_trailer,  # noqa: E402
                                     trailer_body)
from kvstore.remote.mooncake import MooncakeAdapter, MooncakeTarget, load_client_class, piece_bytes  # noqa: E402
from kvstore.remote.testing import MooncakeMaster, mooncake_unavailable  # noqa: E402
from kvstore.remote.tier import TRAILER_ROOM, object_ranges, reserve_trailer_room  # noqa: E402
from kvstore.tiers.cpu_arena import CpuArena  # noqa: E402

MIB = 1 << 20
_xxh3 = xxhash.xxh3_64_intdigest
TIMEOUT_S = 2.0  # the remote tier's default timeout (RemoteSettings.timeout_s)
HOLDER = """
import sys, time
from mooncake.store import MooncakeDistributedStore
c = MooncakeDistributedStore()
rc = c.setup("127.0.0.1", sys.argv[1], int(sys.argv[3]), 16 << 20, "tcp", "", sys.argv[2])
print("ready" if rc == 0 else f"failed {rc}", flush=True)
while True:
    time.sleep(3600)
"""


def pct(v: list[float], q: float) -> float:
    s = sorted(v)
    return s[min(len(s) - 1, int(q * len(s)))]


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


class Buffers:
    """The source and destination memory of one object size, shared by every side: two
    slots of a real CPU arena (`kvstore.tiers.cpu_arena.CpuArena`, with the tail room a
    remote tier makes it keep): the source as a committed object's slot, the destination
    as a fill's (the object with its trailer). The raw sides take their addresses once;
    ours asks the arena for them per op, as the remote tier does (`Tier.host_extent`).
    `close()` gives both slots back."""

    def __init__(self, arena: CpuArena, n: int, remote_size: int) -> None:
        """`remote_size`: our object's size with its trailer (what a fill allocates)."""
        self.arena, self.n = arena, n
        self.src_slot = arena.allocate(n, "src")
        self.dst_slot = arena.allocate(remote_size, "dst")
        if self.src_slot is None or self.dst_slot is None:
            raise RuntimeError(f"the bench arena has no room for two {n}-byte slots")
        self.src_addr, src_mv = arena.host_extent(self.src_slot)
        self.dst_addr, dst_mv = arena.host_extent(self.dst_slot)
        src_mv[:n] = torch.randint(0, 256, (n,), dtype=torch.uint8).numpy().tobytes()
        self.src_mv, self.dst_mv = src_mv[:n], dst_mv[:n]  # the object's bytes, for the raw sides and checks
        self.csum = host_checksum(self.src_mv)  # raw bytes: xxh3_64

    def close(self) -> None:
        self.src_mv.release()
        self.dst_mv.release()
        self.arena.free(self.src_slot)
        self.arena.free(self.dst_slot)


class Raw:
    """Mooncake's own client, the baseline."""

    def __init__(self, master: MooncakeMaster, client: Any = None) -> None:
        """`client`: an already joined Mooncake client to drive (default: a new one)."""
        self.own = client is None
        self.c = load_client_class()() if client is None else client
        if self.own:
            rc = self.c.setup("127.0.0.1", master.metadata, 0, 16 << 20, "tcp", "", f"127.0.0.1:{master.rpc_port}")
            if rc != 0:
                raise RuntimeError(f"raw client setup returned {rc}")

    def put(self, name: str, b: Buffers) -> None:
        rc = self.c.put_from(name, b.src_addr, b.n)
        if rc != 0:
            raise RuntimeError(f"raw put_from {name} returned {rc}")

    def get(self, name: str, b: Buffers) -> memoryview:
        n = self.c.get_into(name, b.dst_addr, b.n)
        if n != b.n:
            raise RuntimeError(f"raw get_into {name} returned {n}")
        return b.dst_mv[:n]

    def remove(self, name: str) -> None:
        self.c.remove(name, True)


class RawVerified(Raw):
    """Mooncake's client plus the one thing a careful caller must add: hashing what it read."""

    def get(self, name: str, b: Buffers) -> memoryview:
        got = super().get(name, b)
        if _xxh3(got) != b.csum:
            raise RuntimeError(f"raw get_into {name}: checksum mismatch")
        return got


class RawRanged(Raw):
    """Mooncake's client reading an object in pieces from one replica lookup, as our get does, unverified."""

    def __init__(self, client: Any, piece: int) -> None:
        """`piece`: the piece size our get uses for the object with its trailer (`piece_bytes`)."""
        self.own, self.c, self.chunk = False, client, piece

    def get(self, name: str, b: Buffers) -> memoryview:
        c, n, ptr = self.c, b.n, b.dst_addr
        if c.batch_get_session_start([name])[0] != 0:
            raise RuntimeError(f"raw session start {name} failed")
        try:
            for off in range(0, n, self.chunk):
                ln = min(self.chunk, n - off)
                if c.batch_get_into_multi_buffer_ranges([name], [[ptr + off]], [[ln]], [[off]])[0] != ln:
                    raise RuntimeError(f"raw ranged get {name} at {off} failed")
        finally:
            c.batch_get_session_end([name])
        return b.dst_mv[:n]


class Ours:
    """The daemon's remote path: the adapter plus the envelope work of the remote tier."""

    def __init__(self, master: MooncakeMaster, room: bool = True, read_chunk: int = -1,
                 share: "Ours | None" = None, read_split: int = -1) -> None:
        """`read_chunk`, `read_split`: the adapter's URL parameters (-1: its default).
        `share`: another `Ours` whose adapter (its Mooncake client, its state) this one
        drives with its own `read_chunk` (a shallow copy of that adapter with another
        target; only the first closes it), so two piece sizes compare on one client."""
        extra = ("&segment=0" + (f"&read_chunk={read_chunk}" if read_chunk >= 0 else "")
                 + (f"&read_split={read_split}" if read_split >= 0 else ""))
        if share is None:
            self.a = MooncakeAdapter(MooncakeTarget.from_url(master.url + extra))
        else:
            self.a = copy.copy(share.a)
            self.a.target = MooncakeTarget.from_url(master.url + extra)
        self.meta = ObjectMeta("bench", 0, 0.0, {})
        self.room = room
        self.sizes: dict[str, int] = {}
        self.made: dict[str, tuple[bytes, bytes]] = {}
        #: seconds of each step of our ops (`steps_ms`): where our time goes
        self.steps: dict[str, list[float]] = {k: [] for k in ("put_encode", "put_call", "get_call", "get_verify")}
        self._marks = (0.0, 0.0, 0.0)

    def offer(self, name: str, b: Buffers) -> None:
        """What `RemoteTier.offer` does at the object's commit, before any put: the trailer
        body and, from the store checksum the commit has, the whole trailer."""
        key = name.encode()
        body = trailer_body(key, self.meta)
        self.made[name] = (body, encode_trailer(key, self.meta, b.n, b.csum, b.csum, body))

    def put(self, name: str, b: Buffers) -> None:
        """As `RemoteTier._put_ranges` from a CPU-arena slot (`Tier.host_extent`: its
        address and a view of its extent, tail room included, unless --no-tail-room),
        then the adapter's call (`RemoteTier.write`: `put_one` for one range)."""
        t0 = time.perf_counter()
        n = b.n
        addr, extent = b.arena.host_extent(b.src_slot)
        if not self.room:
            extent = extent[:n]
        body, trailer = self.made.pop(name)
        ranges, keep = object_ranges(name.encode(), self.meta, b.csum, addr, n, len(extent), body, trailer, extent)
        t1 = time.perf_counter()
        if len(ranges) == 1:  # as RemoteTier.write puts one object in one range
            code = self.a.put_one(name, ranges[0][0], ranges[0][1], TIMEOUT_S)
        else:
            code = self.a.call("put", [PutItem(name, ranges)], TIMEOUT_S).codes[0]
        self._marks = (t0, t1, time.perf_counter())
        if code < 0:
            raise RuntimeError(f"adapter put {name}: code {code}")
        self.sizes[name] = code  # bytes written: the object with its trailer
        del keep

    def get(self, name: str, b: Buffers) -> memoryview:
        """As `RemoteTier.fill` into a CPU-arena slot with room for the trailer."""
        size = self.sizes.pop(name)  # the tier learns it from its stat
        t0 = time.perf_counter()
        addr, extent = b.arena.host_extent(b.dst_slot)
        check = PayloadVerifier(extent[:size], name.encode())
        code = self.a.get_one(name, addr, size, TIMEOUT_S, check.landed)  # as RemoteTier.fill, one object
        t1 = time.perf_counter()
        if code != size:
            raise RuntimeError(f"adapter get {name}: code {code}")
        h = check.finish()
        self._marks = (t0, t1, time.perf_counter())
        if h.checksum != b.csum or h.payload_bytes != b.n:
            raise RuntimeError(f"adapter get {name}: checksum mismatch")
        return b.dst_mv[:h.payload_bytes]

    def note(self, op: str) -> None:
        """Record the steps of the op just timed (outside its timing)."""
        t0, t1, t2 = self._marks
        a, c = ("put_encode", "put_call") if op == "put" else ("get_call", "get_verify")
        self.steps[a].append(t1 - t0)
        self.steps[c].append(t2 - t1)

    def remove(self, name: str) -> None:
        self.a.call("remove", [name], TIMEOUT_S)


def one_op(side: Any, tag: str, b: Buffers, check: bool) -> tuple[float, float]:
    """One put, get and remove of one object; (put seconds, get seconds)."""
    name = f"bench/{tag}/{b.n}/{time.monotonic_ns()}"
    ours = isinstance(side, Ours)
    if ours:
        side.offer(name, b)
    t0 = time.perf_counter()
    side.put(name, b)
    t1 = time.perf_counter()
    if ours:
        side.note("put")
    t2 = time.perf_counter()
    got = side.get(name, b)
    t3 = time.perf_counter()
    if ours:
        side.note("get")
    side.remove(name)
    if check and got != b.src_mv[:b.n]:
        raise RuntimeError(f"{tag}: bytes read back differ")
    if check:
        b.dst_mv[:b.n] = bytes(b.n)  # the next side's first get must land its own bytes
    return t1 - t0, t3 - t2


def run_repeat(sides: dict[str, Any], b: Buffers, iters: int) -> dict[str, dict[str, float]]:
    """`iters` ops per side, the sides alternating op by op (so both see the same load)."""
    lat: dict[str, list[tuple[float, float]]] = {tag: [] for tag in sides}
    for i in range(iters):
        order = list(sides.items()) if i % 2 == 0 else list(reversed(sides.items()))
        for tag, side in order:
            lat[tag].append(one_op(side, tag, b, check=i < 2))
    n = b.n
    out: dict[str, Any] = {"_ops": lat}
    for tag, v in lat.items():
        puts, gets = [a for a, _ in v], [b for _, b in v]
        out[tag] = {"put_p50_ms": 1e3 * pct(puts, 0.5), "put_p99_ms": 1e3 * pct(puts, 0.99),
                    "get_p50_ms": 1e3 * pct(gets, 0.5), "get_p99_ms": 1e3 * pct(gets, 0.99),
                    "put_gbps": n * iters / sum(puts) / 1e9, "get_gbps": n * iters / sum(gets) / 1e9}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,4,16,64", help="object sizes in MiB, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iters", type=int, default=0, help="ops per size and repeat (0: 24, 16, 10 at 1, 4, 16 MiB; 6 above)")
    ap.add_argument("--client", default="shared", choices=("shared", "separate"),
                    help="the raw sides drive the adapter's own Mooncake client (shared, default: only our layer "
                         "differs) or a second client of their own (separate: two clients of one process differ "
                         "by up to 2x in put latency on a loaded host, whichever is made first)")
    ap.add_argument("--no-tail-room", action="store_true",
                    help="our puts send objects from slots without room for the trailer (as the CPU arena's slots "
                         "made before the remote tier opened): the trailer goes as a second range")
    ap.add_argument("--read-chunk", type=int, default=-1,
                    help="bytes per piece of our chunked gets (the adapter's read_chunk; 0: one get_into per "
                         "object; default: the adapter's default)")
    ap.add_argument("--read-split", type=int, default=-1,
                    help="bytes above which our gets are read in pieces (at least two; the adapter's read_split; "
                         "default: the adapter's default)")
    ap.add_argument("--alt-read-split", type=int, default=-1,
                    help="the `ours_alt` side's read_split (bytes; default: the adapter's default)")
    ap.add_argument("--alt-read-chunk", type=int, default=-1,
                    help="adds a side `ours_alt`: our path with this read_chunk (bytes; 0: one get_into per object) "
                         "on the same client, alternating op by op with the others (paired against `ours` too)")
    ap.add_argument("--json", action="store_true", help="write docs/results/remote-<date>.json")
    ap.add_argument("--out", type=Path, default=None, help="JSON path instead of the default")
    args = ap.parse_args(argv)
    why = mooncake_unavailable()
    if why:
        print(f"bench_remote: {why}", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",")]
    load_start = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    master = MooncakeMaster(root).start()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, master.metadata, f"127.0.0.1:{master.rpc_port}",
                               str(1 << 30)], stdout=subprocess.PIPE, stderr=open(root / "holder.log", "wb"),
                              text=True)
    # the CPU arena our sides' slots come from, keeping the remote tier's tail room past each object
    arena = CpuArena(2 * (max(sizes) * MIB + MAX_TRAILER_BYTES + TRAILER_ROOM + 2 * 4096),
                     f"bench-remote-{os.getpid()}", pin=False)
    arena.open()
    reserve_trailer_room(arena)
    try:
        line = holder.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"holder process: {line or 'no answer'} ({root / 'holder.log'})")
        ours = Ours(master, room=not args.no_tail_room, read_chunk=args.read_chunk, read_split=args.read_split)
        chunk, split = ours.a.target.read_chunk_bytes, ours.a.target.read_split_bytes
        alt = Ours(master, room=not args.no_tail_room, read_chunk=args.alt_read_chunk, share=ours,
                   read_split=args.alt_read_split) if args.alt_read_chunk >= 0 or args.alt_read_split >= 0 else None
        raw = Raw(master, ours.a.client if args.client == "shared" else None)
        if raw.c is None:
            raise RuntimeError("the adapter did not join the Mooncake cluster")
        rawv = RawVerified.__new__(RawVerified)
        rawv.c = raw.c  # the same client; only the get differs
        rows = []
        for mib in sizes:
            n = mib * MIB
            iters = args.iters or {1: 24, 4: 16, 16: 10}.get(mib, 6)
            sides = {"mooncake": raw, "mooncake_verified": rawv, "ours": ours}
            name = f"bench/ours/{n}/{time.monotonic_ns()}".encode()  # as `one_op` names our objects
            ours_size = n + len(trailer_body(name, ours.meta)) + FOOTER_BYTES
            b = Buffers(arena, n, ours_size)  # every side puts from and gets into the same memory
            piece = piece_bytes(ours_size, chunk, split)
            if piece < ours_size:  # our get reads in pieces: the raw client doing the same, unverified
                sides = {"mooncake": raw, "mooncake_ranged": RawRanged(raw.c, piece), "mooncake_verified": rawv,
                         "ours": ours}
            if alt is not None:
                sides["ours_alt"] = alt
            run_repeat(sides, b, 2)  # warm-up
            for o in (ours, alt):
                for v in (o.steps.values() if o is not None else ()):
                    v.clear()
            per: dict[str, list[dict]] = {tag: [] for tag in sides}
            ops: dict[str, list[tuple[float, float]]] = {}
            for _ in range(args.repeats):
                rep = run_repeat(sides, b, iters)
                for tag in per:
                    per[tag].append(rep[tag])
                for tag, v in rep["_ops"].items():
                    ops.setdefault(tag, []).extend(v)
            row: dict[str, Any] = {"size_mib": mib, "iters_per_repeat": iters}
            for tag in per:
                row[tag] = {k: spread([p[k] for p in per[tag]]) for k in per[tag][0]}
            ov: dict[str, Any] = {}
            bases = [b for b in ("mooncake", "mooncake_verified", "mooncake_ranged") if b in per]
            for base in bases:
                for op in ("put", "get"):
                    sfx = "" if base == "mooncake" else "_vs_" + base.split("_")[1]
                    ov[f"{op}_p50_latency_pct{sfx}"] = 100.0 * (row["ours"][f"{op}_p50_ms"]["median"]
                                                               / row[base][f"{op}_p50_ms"]["median"] - 1)
                    ov[f"{op}_throughput_pct{sfx}"] = 100.0 * (1 - row["ours"][f"{op}_gbps"]["median"]
                                                              / row[base][f"{op}_gbps"]["median"])
            # Paired: each op of ours against the baseline's op next to it in time (the same
            # load), median over every op of every repeat: robust to load that drifts.
            for base in bases:
                sfx = "" if base == "mooncake" else "_vs_" + base.split("_")[1]
                for j, op in enumerate(("put", "get")):
                    ratios = [a[j] / b[j] for a, b in zip(ops["ours"], ops[base])]
                    ov[f"{op}_paired_median_pct{sfx}"] = 100.0 * (statistics.median(ratios) - 1)
            if alt is not None:  # the other piece size, paired against the raw client and against ours
                for base, sfx in (("mooncake", "_alt"), ("mooncake_verified", "_alt_vs_verified"),
                                  ("ours", "_alt_vs_ours")):
                    for j, op in enumerate(("put", "get")):
                        ratios = [a[j] / b[j] for a, b in zip(ops["ours_alt"], ops[base])]
                        ov[f"{op}_paired_median_pct{sfx}"] = 100.0 * (statistics.median(ratios) - 1)
                row["alt_read_chunk_bytes"] = alt.a.target.read_chunk_bytes
                row["alt_read_split_bytes"] = alt.a.target.read_split_bytes
                row["alt_piece_bytes"] = piece_bytes(ours_size, alt.a.target.read_chunk_bytes,
                                                     alt.a.target.read_split_bytes)
                row["ours_alt_steps_ms"] = {k: 1e3 * statistics.median(v) for k, v in alt.steps.items() if v}
            row["piece_bytes"] = piece
            row["overhead"] = ov
            # where our time goes, per step (medians over every op); the raw client's op is
            # one call, so put_call / get_call vs its p50 is the call's own overhead
            row["ours_steps_ms"] = {k: 1e3 * statistics.median(v) for k, v in ours.steps.items() if v}
            rows.append(row)
            b.close()
            print(f"{mib:>3} MiB  put p50 {row['mooncake']['put_p50_ms']['median']:.2f} -> "
                  f"{row['ours']['put_p50_ms']['median']:.2f} ms ({ov['put_p50_latency_pct']:+.1f}%)  "
                  f"get p50 {row['mooncake']['get_p50_ms']['median']:.2f} -> {row['ours']['get_p50_ms']['median']:.2f} ms "
                  f"({ov['get_p50_latency_pct']:+.1f}%; vs verified {ov['get_p50_latency_pct_vs_verified']:+.1f}%"
                  + (f", vs ranged {ov['get_paired_median_pct_vs_ranged']:+.1f}% paired" if "mooncake_ranged" in per
                     else "") + ")  "
                  f"paired put {ov['put_paired_median_pct']:+.1f}% get {ov['get_paired_median_pct']:+.1f}%  "
                  f"get {row['ours']['get_gbps']['median']:.2f} GB/s; ours per step (ms) "
                  + " ".join(f"{k} {v:.3f}" for k, v in row["ours_steps_ms"].items()), flush=True)
            if alt is not None:
                print(f"{mib:>3} MiB  alt read_chunk {row['alt_read_chunk_bytes']} read_split "
                      f"{row['alt_read_split_bytes']} (pieces of {row['alt_piece_bytes']}): "
                      f"paired put {ov['put_paired_median_pct_alt']:+.1f}% get {ov['get_paired_median_pct_alt']:+.1f}% "
                      f"(vs verified {ov['get_paired_median_pct_alt_vs_verified']:+.1f}%, vs ours "
                      f"{ov['get_paired_median_pct_alt_vs_ours']:+.1f}%); get p50 "
                      f"{row['ours_alt']['get_p50_ms']['median']:.2f} ms", flush=True)
        worst = max(max(r["overhead"]["put_p50_latency_pct"], r["overhead"]["get_p50_latency_pct"]) for r in rows)
        worst_paired = max(max(r["overhead"]["put_paired_median_pct"], r["overhead"]["get_paired_median_pct"])
                           for r in rows)
        worst_v = max(max(r["overhead"]["put_p50_latency_pct_vs_verified"],
                          r["overhead"]["get_p50_latency_pct_vs_verified"]) for r in rows)
        out = {
            "benchmark": "remote tier data path vs Mooncake's Python client (loopback, TCP transport)",
            "date": _dt.date.today().isoformat(),
            "command": "python tools/bench_remote.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                        "note": "a 2-core CPU machine shared with other engineers' test runs at the same "
                                "time: absolute figures are noisy; the sides run interleaved in one process "
                                "so they see the same load",
                        "load_avg_1m_start": load_start[0], "load_avg_1m_end": os.getloadavg()[0]},
            "setup": "mooncake_master (embedded HTTP metadata) + a holder process mounting a 1 GiB segment; the "
                     "bench client mounts none, so every byte crosses loopback TCP; objects removed after each get; "
                     f"client: {args.client} (shared: the raw sides drive the adapter's own Mooncake client)",
            "client": args.client,
            "read_chunk_bytes": chunk,
            "read_split_bytes": split,
            "alt_read_chunk_bytes": alt.a.target.read_chunk_bytes if alt is not None else None,
            "alt_read_split_bytes": alt.a.target.read_split_bytes if alt is not None else None,
            "mooncake_version": _mooncake_version(),
            "repeats": args.repeats,
            "rows": rows,
            "summary": {"worst_p50_latency_overhead_pct": worst, "target_pct": 10.0, "target_met": worst <= 10.0,
                        "worst_p50_latency_overhead_vs_verified_pct": worst_v,
                        "worst_paired_median_overhead_pct": worst_paired,
                        "per_size_paired_overhead_pct": {str(r["size_mib"]): {
                            "put": r["overhead"]["put_paired_median_pct"], "get": r["overhead"]["get_paired_median_pct"],
                            "get_vs_verified": r["overhead"]["get_paired_median_pct_vs_verified"],
                            "get_vs_ranged": r["overhead"].get("get_paired_median_pct_vs_ranged"),
                            **({"put_alt": r["overhead"]["put_paired_median_pct_alt"],
                                "get_alt": r["overhead"]["get_paired_median_pct_alt"],
                                "get_alt_vs_verified": r["overhead"]["get_paired_median_pct_alt_vs_verified"],
                                "get_alt_vs_ours": r["overhead"]["get_paired_median_pct_alt_vs_ours"]}
                               if alt is not None else {})} for r in rows},
                        "per_size_p50_overhead_pct": {str(r["size_mib"]): {"put": r["overhead"]["put_p50_latency_pct"],
                                                                          "get": r["overhead"]["get_p50_latency_pct"]}
                                                      for r in rows}},
        }
        if args.json or args.out:
            path = args.out or REPO / "docs" / "results" / f"remote-{out['date']}.json"
            path.write_text(json.dumps(out, indent=2) + "\n")
            print(f"wrote {path}")
        print(f"worst p50 overhead {worst:+.1f}% (target <= 10%)")
        ours.a.close()
        if raw.own:
            raw.c.close()
        return 0
    finally:
        holder.kill()
        holder.wait(10)
        master.stop()
        arena.close()


def _mooncake_version() -> str:
    try:
        from importlib.metadata import version

        return version("mooncake-transfer-engine-non-cuda")
    except Exception:  # noqa: BLE001 - informational
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
