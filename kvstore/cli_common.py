"""What every `kvstore` command shares: the typer app the commands register on, the
common options (--socket, --tcp, --json, KEY, --tier), the exit codes, and the one-line
error reporting (`fail`, `reports_errors`); a client, JSON and table output helpers.
The commands live in kvstore.cli_daemon, kvstore.cli_data and kvstore.cli_report;
kvstore.cli puts them together.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from kvstore.config import load_config
from kvstore.errors import DaemonNotRunning, KVStoreError

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


def open_client(socket: Optional[Path], tcp: Optional[str], tcp_token_file: Optional[Path] = None,
            tcp_tls_ca: Optional[Path] = None) -> Any:
    from kvstore.client import KVStoreClient

    if socket is None and tcp is None:
        socket = load_config().socket
    return KVStoreClient(socket=socket, tcp=tcp, tcp_token_file=tcp_token_file, tcp_tls_ca=tcp_tls_ca)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def make_console() -> Any:
    """Rich console; when stdout is not a terminal, wide enough that tables and titles
    are never cut or wrapped at 80 columns (output piped to a file or a pager)."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=240)
