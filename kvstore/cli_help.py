"""Help text of the command lines (`kvstore`, `kvengine`): `PlainHelpCommand`, a typer
command class whose --help is click's plain layout with conventional metavars.

Typer (0.29) writes arguments as `{KEY}` in the usage line and `KEY <str>` in the list,
options as `--max-batch <int>` and flags as `--json <bool>`; with rich installed it also
draws boxes cut to 80 columns when piped. Commands built with `cls=PlainHelpCommand` on
an app with `rich_markup_mode=None` print `put [OPTIONS] KEY FILE`, `--max-batch N`,
`--json` instead.
"""
from __future__ import annotations

import re
from typing import Any

from typer.core import TyperCommand

_USAGE_ARG = re.compile(r"\{(.+?)\}(\.\.\.)?")
_ARG_TYPE = re.compile(r"^(  [A-Z][A-Z0-9_.]*) <[\w\[\], ]+>", flags=re.M)


def metavar_of(param: Any, ctx: Any) -> str:
    """The conventional metavar for typer's type label of an option (`<int range>` -> N,
    `<float>` -> NUMBER, `<path>` -> PATH, choices as they are, the rest TEXT)."""
    label = str(param.display_type(ctx) or "").strip("<>")
    if "|" in label:
        return label
    for prefix, metavar in (("int", "N"), ("float", "NUMBER"), ("path", "PATH")):
        if label.startswith(prefix):
            return metavar
    return "TEXT"


class PlainHelpCommand(TyperCommand):
    """A typer command with plain, conventional help (module docstring)."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        out = []
        for piece in super().collect_usage_pieces(ctx):
            m = _USAGE_ARG.fullmatch(piece)
            out.append(m.group(1) + (m.group(2) or "") if m else piece)
        return out

    def get_help(self, ctx: Any) -> str:
        for p in self.params:
            if p.param_type_name == "option" and not p.is_flag and not p.count and p.metavar is None:
                p.metavar = metavar_of(p, ctx)
        return _ARG_TYPE.sub(r"\1", super().get_help(ctx))
