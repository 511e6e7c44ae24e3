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

import click
from typer.core import TyperCommand

_USAGE_ARG = re.compile(r"\{(.+?)\}(\.\.\.)?")
_ARG_TYPE = re.compile(r"^(  [A-Z][A-Z0-9_.]*) <[\w\[\], ]+>", flags=re.M)


def metavar_of(param: click.Parameter) -> str:
    """The conventional metavar of an option's value type."""
    t = param.type
    if isinstance(t, click.Choice):
        return "|".join(str(c) for c in t.choices)
    if isinstance(t, click.types.IntParamType):
        return "N"
    if isinstance(t, click.types.FloatParamType):
        return "NUMBER"
    if isinstance(t, click.Path):
        return "PATH"
    return "TEXT"


class PlainHelpCommand(TyperCommand):
    """A typer command with plain, conventional help (module docstring)."""

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        out = []
        for piece in super().collect_usage_pieces(ctx):
            m = _USAGE_ARG.fullmatch(piece)
            out.append(m.group(1) + (m.group(2) or "") if m else piece)
        return out

    def get_help(self, ctx: click.Context) -> str:
        for p in self.params:
            if isinstance(p, click.Option) and not p.is_flag and p.metavar is None:
                p.metavar = metavar_of(p)
        return _ARG_TYPE.sub(r"\1", super().get_help(ctx))
