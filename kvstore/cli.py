"""`kvstore`: the command line of the kvstore daemon (entry point `main`; also
`python -m kvstore.cli`).

Owns: the user-facing commands and their output. `serve` runs the daemon; its flags are
generated from the option registry in kvstore/config.py, so every option has exactly one
name, type, default and help text. The client commands (put, get, inspect, evict, ls,
show, rm, bench) talk to a running daemon through KVStoreClient, take `--socket` (or
`--tcp HOST:PORT --tcp-token-file FILE`, plus `--tcp-tls-ca CA` for TLS), print
JSON with `--json` where they print data, and on failure print one line
"kvstore: error: REASON" to stderr (no traceback) and exit non-zero: 3 when no daemon
is running (the message says how to start one), 1 otherwise (2: bad usage); `rm` exits 1
when a key was not there, `put` when the key holds other bytes (unless --replace).
`serve` failing on a path it cannot use says so in one line naming the option. `config
--socket` shows a running daemon's settings (reported in its Stats). Help is click's
plain layout (kvstore.cli_help); tables printed to a pipe are not cut at 80 columns. `repair`
rebuilds a stopped daemon's index from its object files (kvstore.recovery).
"""

from __future__ import annotations

import dataclasses
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

from kvstore.cli_help import PlainHelpCommand
from kvstore.config import OPTIONS, OPTIONS_BY_NAME, Config, ConfigError, format_size, load_config, parse_size
from kvstore.errors import DaemonNotRunning, KVStoreError
from kvstore.rpc.codec import key_from_text, key_text

EXIT_ERROR = 1
EXIT_NO_DAEMON = 3
MIN_FINGERPRINT_PREFIX = 8  # `ls --fingerprint` matches at least this many leading characters

app = typer.Typer(
    name="kvstore",
    help="The kvstore daemon and its tools: a tiered (GPU / CPU shared memory / NVMe) KV-cache store.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain click help: nothing cut at 80 columns, no <bool>/<str> metavars
    context_settings={"max_content_width": 120},
)

SocketOpt = typer.Option(None, "--socket", help="daemon's unix socket [default: as `kvstore serve`]",
                         show_default=False, metavar="PATH")
TcpOpt = typer.Option(None, "--tcp", help="reach the daemon over TCP HOST:PORT instead of the socket",
                      show_default=False, metavar="HOST:PORT")
TcpTokenOpt = typer.Option(None, "--tcp-token-file", help="with --tcp: file holding the daemon's token "
                           "[default: $KVSTORE_TCP_TOKEN_FILE]", show_default=False)
TcpCaOpt = typer.Option(None, "--tcp-tls-ca", help="with --tcp: PEM CA bundle; talk TLS to a daemon serving it",
                        show_default=False)
JsonOpt = typer.Option(False, "--json", help="print JSON")
KeyArg = typer.Argument(..., help="object key (text; 'hex:...' for binary keys)", metavar="KEY")
TierOpt = typer.Option(None, "--tier", help="cpu, nvme or gpu [default: the daemon's]", metavar="TIER",
                       show_default=False)

# metavars of float options that are not durations (the rest are seconds)
_FLOAT_METAVAR = {"writeback_watermark": "FRACTION"}


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


def _client(socket: Optional[Path], tcp: Optional[str], tcp_token_file: Optional[Path] = None,
            tcp_tls_ca: Optional[Path] = None) -> Any:
    from kvstore.client import KVStoreClient

    if socket is None and tcp is None:
        socket = load_config().socket
    return KVStoreClient(socket=socket, tcp=tcp, tcp_token_file=tcp_token_file, tcp_tls_ca=tcp_tls_ca)


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def _console() -> Any:
    """Rich console; when stdout is not a terminal, wide enough that tables and titles
    are never cut or wrapped at 80 columns (output piped to a file or a pager)."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=240)


# ---------------------------------------------------------------------------- serve


def _serve_impl(config_file: Optional[Path], **flags: Any) -> None:
    from kvstore.server import serve as run_daemon

    config = load_config(cli=flags, config_file=config_file)
    try:
        run_daemon(config)
    except OSError as exc:  # an unusable --dir, --socket or shm directory: one line, naming it
        raise KVStoreError(_start_error(exc, config)) from None
    except KVStoreError as exc:  # the store's own error for a directory it cannot use
        if isinstance(exc.__cause__, OSError):
            raise KVStoreError(_start_error(exc.__cause__, config)) from None
        raise


def _start_error(exc: OSError, config: Config) -> str:
    """One line for an OSError that stopped the daemon from starting, naming the option
    whose path it was."""
    where = str(exc.filename or "")
    what = exc.strerror or str(exc)
    if isinstance(exc, FileExistsError) and where and not Path(where).is_dir():
        what = "not a directory"
    for name, flag in (("dir", "--dir"), ("socket", "--socket")):
        path = str(getattr(config, name))
        roots = (path, str(Path(path).parent)) if name == "socket" else (path,)
        if where and any(where == r or where.startswith(r.rstrip("/") + "/") for r in roots):
            source = config.sources.get(name, "default")
            origin = flag if source.startswith("flag:") else f"{flag} {path}, from {source}"
            return f"cannot start the daemon: {what}: {where} ({origin})"
    return f"cannot start the daemon: {what}" + (f": {where}" if where else "")


def _make_serve() -> Callable[..., None]:
    """Build `serve` with one --flag per registry option (help and default from the registry)."""
    params = [
        inspect.Parameter(
            "config_file", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
            default=typer.Option(None, "--config", help="TOML config file [default: $KVSTORE_CONFIG, else "
                                 "~/.config/kvstore/config.toml if present]", show_default=False,
                                 metavar="FILE"),
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
            metavar = {"size": "SIZE", "gpusize": "SIZE|auto", "path": "PATH", "int": "N",
                       "float": _FLOAT_METAVAR.get(o.name, "SECONDS"), "hostport": "HOST:PORT",
                       "choice": "|".join(o.choices)}.get(o.kind, "TEXT")
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


app.command("serve", cls=PlainHelpCommand)(_make_serve())


# ---------------------------------------------------------------------------- config


@app.command("config", cls=PlainHelpCommand)
@reports_errors
def config_cmd(
    config_file: Optional[Path] = typer.Option(None, "--config", help="TOML config file to layer in",
                                               show_default=False, metavar="FILE"),
    socket: Optional[Path] = typer.Option(
        None, "--socket", metavar="PATH", show_default=False,
        help="show the settings of the daemon running at this socket instead of what `kvstore serve` would use"),
    tcp: Optional[str] = TcpOpt,
    tcp_token_file: Optional[Path] = TcpTokenOpt,
    tcp_tls_ca: Optional[Path] = TcpCaOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Print the effective configuration and where each value came from (with --socket or
    --tcp: the running daemon's)."""
    if socket is not None or tcp is not None:
        if config_file is not None:
            raise ConfigError("--config: give either --config (a file to layer in) or --socket/--tcp (a running "
                              "daemon), not both")
        with _client(socket, tcp, tcp_token_file, tcp_tls_ca) as kv:
            report = kv.stats().get("daemon_config")
            target = kv.target
        if not report:
            raise KVStoreError(f"the daemon at {target} does not report its settings (an older version)")
        values, sources = report["config"], report["sources"]
        title = f"kvstore daemon configuration at {target}"
        config_path = report.get("config_file")
        order = [o.name for o in OPTIONS if o.name in values] + sorted(set(values) - set(OPTIONS_BY_NAME))
        rows = [(name, _display(name, values[name]), sources.get(name, "?")) for name in order]
    else:
        cfg: Config = load_config(config_file=config_file)
        values, sources = cfg.as_dict(), cfg.sources
        title = "kvstore configuration"
        config_path = str(cfg.config_file) if cfg.config_file else None
        rows = [(o.name, cfg.display(o.name), cfg.sources[o.name]) for o in OPTIONS]
    if as_json:
        _print_json({"config": values, "sources": sources, "config_file": config_path})
        return
    from rich.table import Table

    con = _console()
    con.print(title, soft_wrap=True)
    table = Table()
    table.add_column("option")
    table.add_column("value")
    table.add_column("source")
    table.add_column("env / flag", style="dim")
    flags = {o.name: f"{o.env} / {o.flag}" for o in OPTIONS}
    for name, value, source in rows:
        table.add_row(name, value, source, flags.get(name, ""))
    con.print(table)


def _display(name: str, value: Any) -> str:
    """A reported option value as a user would write it (sizes in binary units)."""
    o = OPTIONS_BY_NAME.get(name)
    if o is not None and o.kind in ("size", "gpusize") and isinstance(value, int):
        return format_size(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@app.command("repair")
@reports_errors
def repair_cmd(
    directory: Optional[Path] = typer.Option(None, "--dir", help="cache directory [default: as `kvstore serve`]",
                                             show_default=False),
    as_json: bool = JsonOpt,
) -> None:
    """Rebuild a cache directory's index from its object files' headers (stop the daemon
    first). The old index is moved aside and files without a usable header are set
    aside in objects/quarantine/: nothing is deleted but files of dropped objects."""
    from kvstore.recovery import repair

    d = Path(directory) if directory is not None else load_config().dir
    report = repair(d)
    if as_json:
        _print_json({"dir": str(d), "records": report.records, "set_aside": report.set_aside,
                     "dead_removed": report.dead_removed, "old_index": report.old_index})
    else:
        sys.stdout.write(report.line(d) + "\n")


# ---------------------------------------------------------------------------- data


@app.command("put", cls=PlainHelpCommand)
@reports_errors
def put_cmd(
    key: str = KeyArg,
    file: Path = typer.Argument(..., help="file whose bytes to store ('-' for stdin)", metavar="FILE"),
    tier: Optional[str] = TierOpt,
    fingerprint: str = typer.Option("", "--fingerprint", help="model fingerprint to record", metavar="FP",
                                    show_default=False),
    replace: bool = typer.Option(False, "--replace",
                                 help="when the key holds other bytes, delete that object and store this file"),
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
    tcp_token_file: Optional[Path] = TcpTokenOpt,
    tcp_tls_ca: Optional[Path] = TcpCaOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Store a file's bytes as one object. A key that already holds the same bytes is left
    as it is; one that holds other bytes is an error unless --replace is given."""
    from kvstore import checksums

    k = key_from_text(key)
    replaced = False
    with _client(socket, tcp, tcp_token_file, tcp_tls_ca) as kv, _file_bytes(file) as data:
        if len(data) == 0:
            raise KVStoreError(f"{file} is empty; objects must hold at least 1 byte")
        res = kv.put(k, data, tier=tier, fingerprint=fingerprint)
        if res.status != "stored":
            held = kv.show(k).info
            same = held.size == len(data) and held.checksum == checksums.host_checksum(data)
            if not same and replace:
                if kv.delete([k]) != 1:
                    raise KVStoreError(f"{key} is in use (leased by a reader); cannot replace it now, try again")
                res = kv.put(k, data, tier=tier, fingerprint=fingerprint)
                replaced = True
            elif not same:
                out = {"key": key_text(res.key), "tier": held.tier, "size": held.size, "status": "exists",
                       "same_bytes": False, "file_size": len(data)}
                if as_json:
                    _print_json(out)
                raise KVStoreError(
                    f"{key} already holds other bytes ({format_size(held.size)} in {held.tier}; this file: "
                    f"{format_size(len(data))}); kept them. Pass --replace to store this file instead")
            else:
                res = dataclasses.replace(res, tier=held.tier, size=held.size, checksum=held.checksum)
    if as_json:
        _print_json({"key": key_text(res.key), "tier": res.tier, "size": res.size, "status": res.status,
                     **({"same_bytes": True} if res.status != "stored" else {}),
                     **({"replaced": True} if replaced else {})})
    elif res.status != "stored":
        print(f"already present: {key_text(res.key)} ({format_size(res.size)}) in {res.tier}, same bytes")
    else:
        print(f"{'replaced' if replaced else 'stored'} {key_text(res.key)} ({format_size(res.size)}) in {res.tier}")


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


@app.command("get", cls=PlainHelpCommand)
@reports_errors
def get_cmd(
    key: str = KeyArg,
    output: Optional[Path] = typer.Option(None, "-o", "--output", help="write here instead of stdout",
                                          show_default=False, metavar="FILE"),
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
    tcp_token_file: Optional[Path] = TcpTokenOpt,
    tcp_tls_ca: Optional[Path] = TcpCaOpt,
) -> None:
    """Write an object's bytes to a file or stdout."""
    with _client(socket, tcp, tcp_token_file, tcp_tls_ca) as kv:
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


@app.command("rm", cls=PlainHelpCommand)
@reports_errors
def rm_cmd(
    keys: list[str] = typer.Argument(..., help="keys to delete", metavar="KEY"),
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
    tcp_token_file: Optional[Path] = TcpTokenOpt,
    tcp_tls_ca: Optional[Path] = TcpCaOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Delete objects (a leased object stays until its leases end). Exits 1 when a key was
    not in the store or could not be deleted (named on stderr)."""
    ks = [key_from_text(k) for k in keys]
    with _client(socket, tcp, tcp_token_file, tcp_tls_ca) as kv:
        present = [e.key for e in kv.lookup(ks) if e.hit]
        deleted = kv.delete(present) if present else 0
        left = {e.key for e in kv.lookup(present) if e.hit} if deleted < len(present) else set()
    missing = [key_text(k) for k in dict.fromkeys(ks) if k not in set(present)]
    leased = [key_text(k) for k in present if k in left]
    if as_json:
        _print_json({"requested": len(keys), "deleted": deleted, "missing": missing, "leased": leased})
    else:
        print(f"deleted {deleted} of {len(keys)}")
    problems = ([f"not in the store: {', '.join(missing)}"] if missing else []) + (
        [f"in use (leased), left in place: {', '.join(leased)}"] if leased else [])
    if problems:
        fail("; ".join(problems))


@app.command("evict", cls=PlainHelpCommand)
@reports_errors
def evict_cmd(
    tier: str = typer.Option(..., "--tier", help="tier to empty: gpu -> cpu, cpu -> nvme, nvme -> dropped",
                             metavar="TIER"),
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
    tcp_token_file: Optional[Path] = TcpTokenOpt,
    tcp_tls_ca: Optional[Path] = TcpCaOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Demote every unleased object out of a tier to the next tier down (dropped when no
    enabled tier lies below it)."""
    with _client(socket, tcp, tcp_token_file, tcp_tls_ca) as kv:
        enabled = list(kv.info.tiers) if kv.info else []
        moved = kv.evict(tier)
    below = enabled[enabled.index(tier) + 1:] if tier in enabled else []
    if as_json:
        _print_json({"tier": tier, "moved": moved, "to": below[0] if below else None})
    elif below:
        print(f"moved {moved} object(s) from {tier} to {below[0]}")
    else:
        print(f"dropped {moved} object(s) from {tier} (no slower tier)")


@app.command("prefetch", cls=PlainHelpCommand)
@reports_errors
def prefetch_cmd(
    keys: list[str] = typer.Argument(..., help="keys to promote", metavar="KEY"),
    tier: Optional[str] = typer.Option(None, "--tier", help="target tier [default: the fastest enabled]",
                                       metavar="TIER", show_default=False),
    socket: Optional[Path] = SocketOpt,
    tcp: Optional[str] = TcpOpt,
    tcp_token_file: Optional[Path] = TcpTokenOpt,
    tcp_tls_ca: Optional[Path] = TcpCaOpt,
) -> None:
    """Promote objects to a faster tier ahead of use."""
    with _client(socket, tcp, tcp_token_file, tcp_tls_ca) as kv:
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
    with _client(socket, tcp, tcp_token_file, tcp_tls_ca) as kv:
        stats = kv.stats()
        objs = kv.list(limit=top) if top > 0 else []
        info = kv.info
        kinds = _objects_by_kind(kv)
    _add_rates(stats)
    stats["objects_by_kind"] = kinds
    if as_json:
        stats["top_objects"] = [_object_json(o) for o in objs]
        stats["daemon"] = {"pid": info.pid, "version": info.daemon_version, "socket": kv.target} if info else {}
        _print_json(stats)
        return
    from rich.table import Table

    con = _console()
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
    with _client(socket, tcp, tcp_token_file, tcp_tls_ca) as kv:
        objs = kv.list(fingerprint=fingerprint, prefix=key_prefix, tier=tier, limit=limit)
        if not objs and fingerprint and len(fingerprint) >= MIN_FINGERPRINT_PREFIX:
            # a short fingerprint: match it as a prefix (over the daemon's whole listing)
            objs = [o for o in kv.list(prefix=key_prefix, tier=tier, limit=0)
                    if o.meta.fingerprint.startswith(fingerprint)][:limit]
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
    with _client(socket, tcp, tcp_token_file, tcp_tls_ca) as kv:
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
    with _client(socket, tcp, tcp_token_file, tcp_tls_ca) as kv:
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

    con = _console()
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


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
