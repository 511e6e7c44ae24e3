"""`python -m kvstore.server [flags]`: the daemon without the CLI's dependencies (typer,
rich), for service managers and minimal hosts. Takes exactly the flags of
`kvstore serve` (generated from the same option registry) and `--config FILE`."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from kvstore.config import OPTIONS, format_size, load_config
from kvstore.errors import KVStoreError


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvstore.server", description="Run the kvstore daemon.")
    ap.add_argument("--config", dest="config_file", default=None, help="TOML config file")
    for o in OPTIONS:
        default = o.default_value()
        shown = format_size(int(default)) if o.kind == "size" else default
        help_text = f"{o.help} [default: {shown or 'none'}; env {o.env}]"
        if o.kind == "bool":
            ap.add_argument(o.flag, dest=o.name, default=None, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            ap.add_argument(o.flag, dest=o.name, default=None, help=help_text)
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    args = vars(build_parser().parse_args(argv))
    config_file = args.pop("config_file")
    try:
        from kvstore.server import serve

        serve(load_config(cli=args, config_file=config_file))
    except KVStoreError as exc:
        sys.stderr.write(f"kvstore: error: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
