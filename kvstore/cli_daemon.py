"""The `kvstore` commands about the daemon itself: `serve` (its flags generated from the
option registry in kvstore/config.py), `config` (the effective settings and where each
came from, or a running daemon's) and `repair` (rebuild a stopped daemon's index from
its object files).
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from kvstore.cli_common import (
    app, fail, JsonOpt, make_console, open_client, print_json, reports_errors, TcpCaOpt, TcpOpt, TcpTokenOpt,
)
from kvstore.cli_help import PlainHelpCommand
from kvstore.config import OPTIONS, OPTIONS_BY_NAME, Config, ConfigError, format_size, load_config
from kvstore.errors import KVStoreError

# metavars of float options that are not durations (the rest are seconds)
_FLOAT_METAVAR = {"writeback_watermark": "FRACTION"}


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
        with open_client(socket, tcp, tcp_token_file, tcp_tls_ca) as kv:
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
        print_json({"config": values, "sources": sources, "config_file": config_path})
        return
    from rich.table import Table

    con = make_console()
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
        print_json({"dir": str(d), "records": report.records, "set_aside": report.set_aside,
                     "dead_removed": report.dead_removed, "old_index": report.old_index})
    else:
        sys.stdout.write(report.line(d) + "\n")
