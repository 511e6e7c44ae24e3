"""The `kvstore` commands that report: `inspect` (daemon statistics), `ls`, `show` (one
object, decoded when it is a tensor blob) and `bench` (read throughput of stored objects).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional

import typer

from kvstore.cli_common import (
    app, JsonOpt, KeyArg, make_console, MIN_FINGERPRINT_PREFIX, open_client, print_json, reports_errors,
    SocketOpt, TcpCaOpt, TcpOpt, TcpTokenOpt,
)
from kvstore.cli_help import PlainHelpCommand
from kvstore.config import ConfigError, format_size, parse_size
from kvstore.rpc.codec import key_from_text, key_text

# ---------------------------------------------------------------------------- inspection


def _object_json(o: Any) -> dict[str, Any]:
    return {
        "key": key_text(o.key), "tier": o.tier, "size": o.size, "checksum": f"{o.checksum:016x}",
        "fingerprint": o.meta.fingerprint, "token_count": o.meta.token_count, "cost": o.meta.cost,
        "extra": o.meta.extra, "hits": o.hits, "leases": o.leases, "last_access": o.last_access,
        "created": o.created,
    }


def _objects_by_kind(kv: Any) -> dict[str, int]:
    """Object counts by record `extra["kind"]` (e.g. "pic-signature", "hisparse-block";
    "other" without one), so engines' object families show apart."""
    counts: dict[str, int] = {}
    for o in kv.list():
        kind = o.meta.extra.get("kind") if isinstance(o.meta.extra, dict) else None
        name = kind if isinstance(kind, str) else "other"
        counts[name] = counts.get(name, 0) + 1
    return counts


@app.command("inspect", cls=PlainHelpCommand)
@reports_errors
def inspect_cmd(
    top: int = typer.Option(10, "--top", help="how many of the most-hit objects to show", metavar="N"),
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
    tcp_token_file: Optional[Path] = TcpTokenOpt,
    tcp_tls_ca: Optional[Path] = TcpCaOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Tiers, capacity and use, hit rate, object counts, top objects by hits."""
    with open_client(socket, tcp, tcp_token_file, tcp_tls_ca) as kv:
        stats = kv.stats()
        objs = kv.list(limit=top) if top > 0 else []
        info = kv.info
        kinds = _objects_by_kind(kv)
    _add_rates(stats)
    stats["objects_by_kind"] = kinds
    if as_json:
        stats["top_objects"] = [_object_json(o) for o in objs]
        stats["daemon"] = {"pid": info.pid, "version": info.daemon_version, "socket": kv.target} if info else {}
        print_json(stats)
        return
    from rich.table import Table

    con = make_console()
    con.print(f"kvstore daemon pid {info.pid if info else '?'} at {kv.target}", soft_wrap=True)
    t = Table()
    for col in ("tier", "capacity", "used", "use %", "objects"):
        t.add_column(col, justify="right" if col != "tier" else "left")
    for tier in stats["tiers"]:
        cap, used = tier["capacity_bytes"], tier["used_bytes"]
        t.add_row(tier["name"], format_size(cap), format_size(used), f"{100.0 * used / cap:.1f}" if cap else "-",
                  str(tier["objects"]))
    con.print(t)
    con.print(f"lookups: hits {stats.get('lookup_hits', 0)}  misses {stats.get('lookup_misses', 0)}  "
              f"hit rate {_pct(stats['lookup_hit_rate'])}   (keys looked up; engines look up every segment)")
    con.print(f"gets:    hits {stats.get('hits', 0)}  misses {stats.get('misses', 0)}  "
              f"hit rate {_pct(stats['get_hit_rate'])}   (keys read; engines read only what a lookup found)")
    con.print(f"evictions {stats.get('evictions', 0)}  demotions {stats.get('demotions', 0)}  "
              f"write-backs {stats.get('writebacks', 0)}  leases {stats.get('leases', 0)}")
    remote = stats.get("remote") or {}
    if remote.get("enabled"):
        con.print(f"remote {remote['url']}  {'reachable' if remote['reachable'] else 'UNREACHABLE'}  "
                  f"hits {remote['hits']}  misses {remote['misses']}  errors {remote['errors']}  "
                  f"corrupt {remote['corrupt_dropped']}  written {remote['objects_written']} objects "
                  f"({format_size(remote['bytes_written'])})  get p50 {1e3 * remote['get_latency']['p50_s']:.1f} ms",
                  markup=False)
    if kinds:
        con.print("objects by kind: " + "  ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
    if objs:
        con.print(f"top {len(objs)} objects by hits")
        o_t = Table()
        for col in ("key", "tier", "size", "hits", "tokens", "fingerprint"):
            o_t.add_column(col)
        for o in objs:
            o_t.add_row(key_text(o.key)[:48], o.tier, format_size(o.size), str(o.hits), str(o.meta.token_count),
                        o.meta.fingerprint[:16])
        con.print(o_t)


def _rate(hits: int, misses: int) -> Optional[float]:
    return hits / (hits + misses) if hits + misses else None


def _pct(rate: Optional[float]) -> str:
    return "n/a" if rate is None else f"{100.0 * rate:.1f}%"


def _add_rates(stats: dict[str, Any]) -> None:
    """`lookup_hit_rate` (keys Lookup found), `get_hit_rate` (keys Get found) and
    `hit_rate`: the lookup rate once anything was looked up, else the get rate (an engine
    looks a segment up before it gets it, and gets only hits: docs/kvstore.md)."""
    stats["lookup_hit_rate"] = _rate(stats.get("lookup_hits", 0), stats.get("lookup_misses", 0))
    stats["get_hit_rate"] = _rate(stats.get("hits", 0), stats.get("misses", 0))
    stats["hit_rate"] = stats["lookup_hit_rate"] if stats["lookup_hit_rate"] is not None else stats["get_hit_rate"]


@app.command("ls", cls=PlainHelpCommand)
@reports_errors
def ls_cmd(
    fingerprint: Optional[str] = typer.Option(
        None, "--fingerprint", metavar="FP", show_default=False,
        help="only this model fingerprint: the whole one, or its first 8 or more characters (the 16-character "
             "short form `inspect` prints)"),
    prefix: Optional[str] = typer.Option(None, "--prefix", help="only keys starting with this", metavar="PREFIX",
                                         show_default=False),
    tier: Optional[str] = typer.Option(None, "--tier", help="only objects in this tier", metavar="TIER",
                                       show_default=False),
    limit: int = typer.Option(1000, "--limit", help="at most this many (most-hit first)", metavar="N"),
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
    tcp_token_file: Optional[Path] = TcpTokenOpt,
    tcp_tls_ca: Optional[Path] = TcpCaOpt,
    as_json: bool = JsonOpt,
) -> None:
    """List objects, most-hit first."""
    key_prefix = key_from_text(prefix) if prefix else None
    with open_client(socket, tcp, tcp_token_file, tcp_tls_ca) as kv:
        objs = kv.list(fingerprint=fingerprint, prefix=key_prefix, tier=tier, limit=limit)
        if not objs and fingerprint and len(fingerprint) >= MIN_FINGERPRINT_PREFIX:
            # a short fingerprint: match it as a prefix (over the daemon's whole listing)
            objs = [o for o in kv.list(prefix=key_prefix, tier=tier, limit=0)
                    if o.meta.fingerprint.startswith(fingerprint)][:limit]
    if as_json:
        print_json([_object_json(o) for o in objs])
        return
    from rich.table import Table

    t = Table(title=f"{len(objs)} object(s)", title_justify="left")
    for col in ("key", "tier", "size", "hits", "leases", "tokens", "fingerprint"):
        t.add_column(col)
    for o in objs:
        t.add_row(key_text(o.key), o.tier, format_size(o.size), str(o.hits), str(o.leases), str(o.meta.token_count),
                  o.meta.fingerprint)
    make_console().print(t)


@app.command("show", cls=PlainHelpCommand)
@reports_errors
def show_cmd(
    key: str = KeyArg,
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
    tcp_token_file: Optional[Path] = TcpTokenOpt,
    tcp_tls_ca: Optional[Path] = TcpCaOpt,
    as_json: bool = JsonOpt,
) -> None:
    """One object's record and, for an object-format blob, its header and parts."""
    with open_client(socket, tcp, tcp_token_file, tcp_tls_ca) as kv:
        res = kv.show(key_from_text(key))
    out = {"object": _object_json(res.info), "is_blob": res.is_blob, "header": res.header, "parts": res.parts}
    if as_json:
        print_json(out)
        return
    from rich.table import Table

    con = make_console()
    o = out["object"]
    con.print(f"[bold]{o['key']}[/bold]  tier {o['tier']}  size {format_size(o['size'])}  hits {o['hits']}  "
              f"leases {o['leases']}  checksum {o['checksum']}")
    con.print(f"fingerprint {o['fingerprint'] or '-'}  tokens {o['token_count']}  cost {o['cost']}")
    if not res.is_blob:
        con.print("not an object-format blob (raw bytes)")
        return
    h = res.header or {}
    con.print(f"blob format v{h.get('version')}  meta {json.dumps(h.get('meta') or {})}")
    t = Table(title=f"{len(res.parts)} part(s)", title_justify="left")
    for col in ("name", "layer", "dtype", "shape", "offset", "length"):
        t.add_column(col)
    for p in res.parts:
        t.add_row(p["name"], str(p["layer"]), p["dtype"], "x".join(map(str, p["shape"])) or "scalar",
                  str(p["offset"]), format_size(p["length"]))
    con.print(t)


# ---------------------------------------------------------------------------- bench


@app.command("bench", cls=PlainHelpCommand)
@reports_errors
def bench_cmd(
    tiers: str = typer.Option("", "--tiers", help="comma-separated tiers [default: every enabled tier]",
                              metavar="TIER,...", show_default=False),
    size: str = typer.Option("16MiB", "--size", help="object size", metavar="SIZE"),
    count: int = typer.Option(16, "--count", help="objects per tier", metavar="N"),
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
    tcp_token_file: Optional[Path] = TcpTokenOpt,
    tcp_tls_ca: Optional[Path] = TcpCaOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Put/get throughput per tier against the running daemon (objects are deleted after)."""
    from rich.progress import Progress

    nbytes = parse_size(size, "--size")
    if nbytes <= 0 or count <= 0:
        raise ConfigError("--size and --count must be > 0")
    data = os.urandom(min(nbytes, 1 << 20)) * (nbytes // min(nbytes, 1 << 20))
    data += os.urandom(nbytes - len(data))
    results = []
    with open_client(socket, tcp, tcp_token_file, tcp_tls_ca) as kv:
        enabled = list(kv.info.tiers) if kv.info else ["cpu"]
        chosen = [t.strip() for t in tiers.split(",") if t.strip()] or enabled
        run_id = f"bench-{os.getpid()}-{int(time.time())}"
        with Progress(transient=True, disable=as_json) as progress:
            for tier in chosen:
                task = progress.add_task(f"{tier}: put", total=2 * count)
                keys = [f"{run_id}/{tier}/{i}".encode() for i in range(count)]
                t0 = time.perf_counter()
                for k in keys:
                    kv.put(k, data, tier=tier)
                    progress.advance(task)
                put_s = time.perf_counter() - t0
                progress.update(task, description=f"{tier}: get")
                t0 = time.perf_counter()
                sink = 0
                for k in keys:
                    with kv.get(k, promote=False) as view:
                        sink += int(view.tensor().sum(dtype=_torch_int64()) if tier == "gpu"
                                    else _touch(view.array))
                    progress.advance(task)
                get_s = time.perf_counter() - t0
                kv.delete(keys)
                total = nbytes * count
                results.append({"tier": tier, "object_bytes": nbytes, "objects": count,
                                "put_GBps": total / put_s / 1e9, "get_GBps": total / get_s / 1e9})
    if as_json:
        print_json(results)
        return
    from rich.table import Table

    con = make_console()
    con.print(f"kvstore bench: {count} x {format_size(nbytes)} per tier (get reads every byte)", soft_wrap=True)
    t = Table()
    for col in ("tier", "put GB/s", "get GB/s"):
        t.add_column(col, justify="right" if col != "tier" else "left")
    for r in results:
        t.add_row(r["tier"], f"{r['put_GBps']:.2f}", f"{r['get_GBps']:.2f}")
    con.print(t)


def _touch(arr: Any) -> int:
    """Read every byte of a host array (so a get is timed with its bytes actually read)."""
    import numpy as np

    return int(np.bitwise_xor.reduce(arr.view(np.uint64) if arr.size % 8 == 0 else arr, axis=None))


def _torch_int64() -> Any:
    import torch

    return torch.int64
