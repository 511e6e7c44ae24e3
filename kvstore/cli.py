"""`kvstore`: the command line of the kvstore daemon (entry point `main`; also
`python -m kvstore.cli`).

Owns: the user-facing commands and their output. `serve` runs the daemon; its flags are
generated from the option registry in kvstore/config.py, so every option has exactly one
name, type, default and help text. The client commands (put, get, inspect, evict, ls,
show, rm, bench) talk to a running daemon through KVStoreClient, take `--socket`, print
JSON with `--json` where they print data, and on failure print one line
"kvstore: error: REASON" to stderr (no traceback) and exit non-zero: 3 when no daemon
is running (the message says how to start one), 1 otherwise (2: bad usage).
"""

from __future__ import annotations

import functools
import inspect
import json
import mmap
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from kvstore.config import OPTIONS, Config, ConfigError, format_size, load_config, parse_size
from kvstore.errors import DaemonNotRunning, KVStoreError
from kvstore.rpc.codec import key_from_text, key_text

EXIT_ERROR = 1
EXIT_NO_DAEMON = 3

app = typer.Typer(
    name="kvstore",
    help="The kvstore daemon and its tools: a tiered (GPU / CPU shared memory / NVMe) KV-cache store.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

SocketOpt = typer.Option(None, "--socket", help="daemon's unix socket [default: as `kvstore serve`]",
                         show_default=False)
TcpOpt = typer.Option(None, "--tcp", help="reach the daemon over TCP HOST:PORT instead of the socket",
                      show_default=False)
JsonOpt = typer.Option(False, "--json", help="print JSON")


def fail(message: str, code: int = EXIT_ERROR) -> None:
    """Print one line to stderr and exit."""
    sys.stderr.write(f"kvstore: error: {message}\n")
    raise typer.Exit(code)


def reports_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn kvstore errors (and broken pipes) into one line on stderr and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DaemonNotRunning as exc:
            fail(str(exc), EXIT_NO_DAEMON)
        except KVStoreError as exc:
            fail(str(exc))
        except BrokenPipeError:
            os._exit(EXIT_ERROR)  # e.g. `kvstore get k | head`
        except OSError as exc:
            fail(f"{exc.strerror or exc}: {exc.filename}" if getattr(exc, "filename", None) else str(exc))

    return wrapper


def _client(socket: Optional[Path], tcp: Optional[str]) -> Any:
    from kvstore.client import KVStoreClient

    if socket is None and tcp is None:
        socket = load_config().socket
    return KVStoreClient(socket=socket, tcp=tcp)


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def _console() -> Any:
    from rich.console import Console

    return Console()


# ---------------------------------------------------------------------------- serve


def _serve_impl(config_file: Optional[Path], **flags: Any) -> None:
    from kvstore.server import serve as run_daemon

    config = load_config(cli=flags, config_file=config_file)
    run_daemon(config)


def _make_serve() -> Callable[..., None]:
    """Build `serve` with one --flag per registry option (help and default from the registry)."""
    params = [
        inspect.Parameter(
            "config_file", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
            default=typer.Option(None, "--config", help="TOML config file [default: $KVSTORE_CONFIG, else "
                                 "~/.config/kvstore/config.toml if present]", show_default=False),
        )
    ]
    annotations: dict[str, Any] = {"config_file": Optional[Path], "return": None}
    for o in OPTIONS:
        default_text = o.default_value()
        if o.kind == "size":
            default_text = format_size(int(default_text))
        help_text = f"{o.help} [default: {default_text or 'none'}; env {o.env}]"
        if o.kind == "bool":
            flag = f"{o.flag}/--no-{o.flag[2:]}"
            ann: Any = Optional[bool]
            info = typer.Option(None, flag, help=help_text, show_default=False)
        else:
            ann = Optional[str]
            metavar = {"size": "SIZE", "gpusize": "SIZE|auto", "path": "PATH", "int": "N", "float": "SECONDS",
                       "hostport": "HOST:PORT", "choice": "|".join(o.choices), "str": "TEXT"}[o.kind]
            info = typer.Option(None, o.flag, help=help_text, metavar=metavar, show_default=False)
        params.append(inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, annotation=ann, default=info))
        annotations[o.name] = ann

    def serve(**kwargs: Any) -> None:
        """Run the daemon (foreground; stop it with SIGTERM or Ctrl-C)."""
        config_file = kwargs.pop("config_file", None)
        try:
            _serve_impl(config_file, **kwargs)
        except KVStoreError as exc:
            fail(str(exc))

    serve.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
    serve.__annotations__ = annotations
    return serve


app.command("serve")(_make_serve())


# ---------------------------------------------------------------------------- config


@app.command("config")
@reports_errors
def config_cmd(
    config_file: Optional[Path] = typer.Option(None, "--config", help="TOML config file to layer in",
                                               show_default=False),
    as_json: bool = JsonOpt,
) -> None:
    """Print the effective configuration and where each value came from."""
    cfg: Config = load_config(config_file=config_file)
    if as_json:
        _print_json({"config": cfg.as_dict(), "sources": cfg.sources,
                     "config_file": str(cfg.config_file) if cfg.config_file else None})
        return
    from rich.table import Table

    table = Table(title="kvstore configuration", title_justify="left")
    table.add_column("option")
    table.add_column("value")
    table.add_column("source")
    table.add_column("env / flag", style="dim")
    for o in OPTIONS:
        table.add_row(o.name, cfg.display(o.name), cfg.sources[o.name], f"{o.env} / {o.flag}")
    _console().print(table)


# ---------------------------------------------------------------------------- data


@app.command("put")
@reports_errors
def put_cmd(
    key: str = typer.Argument(..., help="object key (text; 'hex:...' for binary keys)"),
    file: Path = typer.Argument(..., help="file whose bytes to store ('-' for stdin)"),
    tier: Optional[str] = typer.Option(None, "--tier", help="cpu | nvme | gpu [default: the daemon's]"),
    fingerprint: str = typer.Option("", "--fingerprint", help="model fingerprint to record"),
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Store a file's bytes as one object."""
    k = key_from_text(key)
    with _client(socket, tcp) as kv, _file_bytes(file) as data:
        if len(data) == 0:
            raise KVStoreError(f"{file} is empty; objects must hold at least 1 byte")
        res = kv.put(k, data, tier=tier, fingerprint=fingerprint)
    if as_json:
        _print_json({"key": key_text(res.key), "tier": res.tier, "size": res.size, "status": res.status})
    else:
        verb = "stored" if res.status == "stored" else "already present:"
        print(f"{verb} {key_text(res.key)} ({format_size(res.size)}) in {res.tier}")


class _file_bytes:
    """The bytes of a file as a memoryview over a read-only mapping (stdin: read fully)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._mm: Optional[mmap.mmap] = None
        self._mv: Optional[memoryview] = None

    def __enter__(self) -> memoryview:
        if str(self.path) == "-":
            self._mv = memoryview(sys.stdin.buffer.read())
            return self._mv
        if not self.path.is_file():
            raise KVStoreError(f"{self.path} is not a file")
        with open(self.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size == 0:
                self._mv = memoryview(b"")
                return self._mv
            self._mm = mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ)
        self._mv = memoryview(self._mm)
        return self._mv

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._mv is not None:
                self._mv.release()
            if self._mm is not None:
                self._mm.close()
        except BufferError:  # a failing put's traceback still refers to the bytes; exit unmaps
            pass


@app.command("get")
@reports_errors
def get_cmd(
    key: str = typer.Argument(..., help="object key (text; 'hex:...' for binary keys)"),
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="write here instead of stdout",
                                          show_default=False),
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
) -> None:
    """Write an object's bytes to a file or stdout."""
    with _client(socket, tcp) as kv:
        with kv.get(key_from_text(key)) as view:
            data = view.memoryview if view.tier != "gpu" else memoryview(view.tobytes())
            if output is None:
                sys.stdout.buffer.write(data)
                sys.stdout.buffer.flush()
            else:
                tmp = output.with_name(output.name + ".part")
                with open(tmp, "wb") as fh:
                    fh.write(data)
                os.replace(tmp, output)
            data.release()


@app.command("rm")
@reports_errors
def rm_cmd(
    keys: list[str] = typer.Argument(..., help="keys to delete"),
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Delete objects (a leased object stays until its leases end)."""
    with _client(socket, tcp) as kv:
        deleted = kv.delete([key_from_text(k) for k in keys])
    if as_json:
        _print_json({"requested": len(keys), "deleted": deleted})
    else:
        print(f"deleted {deleted} of {len(keys)}")


@app.command("evict")
@reports_errors
def evict_cmd(
    tier: str = typer.Option(..., "--tier", help="tier to empty: gpu -> cpu, cpu -> nvme, nvme -> dropped"),
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Demote every unleased object out of a tier to the next tier down."""
    with _client(socket, tcp) as kv:
        moved = kv.evict(tier)
    if as_json:
        _print_json({"tier": tier, "moved": moved})
    else:
        print(f"moved {moved} object(s) out of {tier}")


@app.command("prefetch")
@reports_errors
def prefetch_cmd(
    keys: list[str] = typer.Argument(..., help="keys to promote"),
    tier: Optional[str] = typer.Option(None, "--tier", help="target tier [default: the fastest enabled]"),
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
) -> None:
    """Promote objects to a faster tier ahead of use."""
    with _client(socket, tcp) as kv:
        n = kv.prefetch([key_from_text(k) for k in keys], tier)
    print(f"{n} of {len(keys)} in {tier or 'the fastest tier'} or above")


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


@app.command("inspect")
@reports_errors
def inspect_cmd(
    top: int = typer.Option(10, "--top", help="how many of the most-hit objects to show"),
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Tiers, capacity and use, hit rate, object counts, top objects by hits."""
    with _client(socket, tcp) as kv:
        stats = kv.stats()
        objs = kv.list(limit=top) if top > 0 else []
        info = kv.info
        kinds = _objects_by_kind(kv)
    lookups = stats.get("hits", 0) + stats.get("misses", 0)
    stats["hit_rate"] = (stats.get("hits", 0) / lookups) if lookups else None
    stats["objects_by_kind"] = kinds
    if as_json:
        stats["top_objects"] = [_object_json(o) for o in objs]
        stats["daemon"] = {"pid": info.pid, "version": info.daemon_version, "socket": kv.target} if info else {}
        _print_json(stats)
        return
    from rich.table import Table

    con = _console()
    t = Table(title=f"kvstore daemon pid {info.pid if info else '?'} at {kv.target}", title_justify="left")
    for col in ("tier", "capacity", "used", "use %", "objects"):
        t.add_column(col, justify="right" if col != "tier" else "left")
    for tier in stats["tiers"]:
        cap, used = tier["capacity_bytes"], tier["used_bytes"]
        t.add_row(tier["name"], format_size(cap), format_size(used), f"{100.0 * used / cap:.1f}" if cap else "-",
                  str(tier["objects"]))
    con.print(t)
    rate = f"{100.0 * stats['hit_rate']:.1f}%" if stats["hit_rate"] is not None else "n/a"
    con.print(f"hits {stats.get('hits', 0)}  misses {stats.get('misses', 0)}  hit rate {rate}  "
              f"evictions {stats.get('evictions', 0)}  demotions {stats.get('demotions', 0)}  "
              f"write-backs {stats.get('writebacks', 0)}  leases {stats.get('leases', 0)}")
    if kinds:
        con.print("objects by kind: " + "  ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
    if objs:
        o_t = Table(title=f"top {len(objs)} objects by hits", title_justify="left")
        for col in ("key", "tier", "size", "hits", "tokens", "fingerprint"):
            o_t.add_column(col)
        for o in objs:
            o_t.add_row(key_text(o.key)[:48], o.tier, format_size(o.size), str(o.hits), str(o.meta.token_count),
                        o.meta.fingerprint[:16])
        con.print(o_t)


@app.command("ls")
@reports_errors
def ls_cmd(
    fingerprint: Optional[str] = typer.Option(None, "--fingerprint", help="only this model fingerprint"),
    prefix: Optional[str] = typer.Option(None, "--prefix", help="only keys starting with this"),
    tier: Optional[str] = typer.Option(None, "--tier", help="only objects in this tier"),
    limit: int = typer.Option(1000, "--limit", help="at most this many (most-hit first)"),
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
    as_json: bool = JsonOpt,
) -> None:
    """List objects, most-hit first."""
    with _client(socket, tcp) as kv:
        objs = kv.list(fingerprint=fingerprint, prefix=key_from_text(prefix) if prefix else None, tier=tier,
                       limit=limit)
    if as_json:
        _print_json([_object_json(o) for o in objs])
        return
    from rich.table import Table

    t = Table(title=f"{len(objs)} object(s)", title_justify="left")
    for col in ("key", "tier", "size", "hits", "leases", "tokens", "fingerprint"):
        t.add_column(col)
    for o in objs:
        t.add_row(key_text(o.key), o.tier, format_size(o.size), str(o.hits), str(o.leases), str(o.meta.token_count),
                  o.meta.fingerprint)
    _console().print(t)


@app.command("show")
@reports_errors
def show_cmd(
    key: str = typer.Argument(..., help="object key"),
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
    as_json: bool = JsonOpt,
) -> None:
    """One object's record and, for an object-format blob, its header and parts."""
    with _client(socket, tcp) as kv:
        res = kv.show(key_from_text(key))
    out = {"object": _object_json(res.info), "is_blob": res.is_blob, "header": res.header, "parts": res.parts}
    if as_json:
        _print_json(out)
        return
    from rich.table import Table

    con = _console()
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


@app.command("bench")
@reports_errors
def bench_cmd(
    tiers: str = typer.Option("", "--tiers", help="comma-separated tiers [default: every enabled tier]"),
    size: str = typer.Option("16MiB", "--size", help="object size"),
    count: int = typer.Option(16, "--count", help="objects per tier"),
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
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
    with _client(socket, tcp) as kv:
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
        _print_json(results)
        return
    from rich.table import Table

    t = Table(title=f"kvstore bench: {count} x {format_size(nbytes)} per tier (get reads every byte)",
              title_justify="left")
    for col in ("tier", "put GB/s", "get GB/s"):
        t.add_column(col, justify="right" if col != "tier" else "left")
    for r in results:
        t.add_row(r["tier"], f"{r['put_GBps']:.2f}", f"{r['get_GBps']:.2f}")
    _console().print(t)


def _touch(arr: Any) -> int:
    """Read every byte of a host array (so a get is timed with its bytes actually read)."""
    import numpy as np

    return int(np.bitwise_xor.reduce(arr.view(np.uint64) if arr.size % 8 == 0 else arr, axis=None))


def _torch_int64() -> Any:
    import torch

    return torch.int64


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
