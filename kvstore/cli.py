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

The commands live by job in kvstore.cli_daemon (serve, config, repair), kvstore.cli_data
(put, get, rm, evict, prefetch) and kvstore.cli_report (inspect, ls, show, bench), on the
app and helpers of kvstore.cli_common; this module puts them together.
"""

from __future__ import annotations

from kvstore import cli_daemon, cli_data, cli_report  # noqa: F401  (register their commands, in help order)
from kvstore.cli_common import EXIT_ERROR, EXIT_NO_DAEMON, app, fail  # noqa: F401  (re-exported)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
