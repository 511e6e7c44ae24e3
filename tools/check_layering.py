"""Import layering check: no import cycles and no upward imports between the packages.

The packages form a stack, lowest first: ``kernels < kvstore < engine < tools``. A module
may import from its own package and from packages below it; an import of a package above
it is an *upward import*. Inside and across the packages no set of modules may import
each other in a circle (an *import cycle*, found as a strongly connected component of the
module graph).

Every ``import`` and ``from ... import`` statement in a module's source counts, wherever it
stands: at module level, inside functions and methods, and under ``if TYPE_CHECKING:``. A
function-level import hides a cycle from the interpreter, not from the design, so it is
an offence here as well. Relative imports are resolved against the importing module.
``from pkg import name`` is an edge to the module ``pkg.name`` when that module exists,
otherwise to ``pkg`` itself; an import of ``a.b.c`` is an edge to ``a.b.c`` only (not to
the ``a`` and ``a.b`` packages Python also initialises). Imports of anything outside the
four packages (the standard library, third-party code, ``tests``) are ignored, and so are
modules loaded by name at run time (``importlib.import_module("...")``): only import
statements are read.

Run ``python -m tools.check_layering`` from the repository root (or pass ``--root``): it
prints one line per offence and exits 1, or prints a one-line summary and exits 0.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

LAYERS: tuple[str, ...] = ("kernels", "kvstore", "engine", "tools")


class LayeringError(Exception):
    """The tree cannot be checked (a package directory is missing, a file does not parse)."""


@dataclass(frozen=True)
class ImportEdge:
    """One import statement of module ``src`` that reaches module ``dst`` (both dotted)."""

    src: str
    dst: str
    path: str
    line: int


@dataclass(frozen=True)
class Offence:
    """One layering offence, printable as one line."""

    kind: str  # "upward" or "cycle"
    text: str

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class LayeringReport:
    """What one check saw: the modules, the internal import edges and the offences."""

    modules: int
    edges: int
    offences: tuple[Offence, ...]


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def discover_modules(root: Path, packages: Sequence[str] = LAYERS) -> dict[str, Path]:
    """Map each dotted module name of ``packages`` under ``root`` to its file."""
    modules: dict[str, Path] = {}
    for pkg in packages:
        base = root / pkg
        if not (base / "__init__.py").is_file():
            raise LayeringError(f"package {pkg!r} not found under {root} (no {pkg}/__init__.py)")
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(root)
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            modules[_module_name(rel)] = path
    return modules


def _resolve_relative(module: str, is_package: bool, level: int, target: Optional[str]) -> str:
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _internal(name: str, modules: dict[str, Path]) -> Optional[str]:
    """The longest prefix of dotted ``name`` that is one of ``modules``, or None."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in modules:
            return cand
    return None


def module_imports(module: str, path: Path, modules: dict[str, Path], root: Path) -> list[ImportEdge]:
    """Every edge from ``module`` to another module of ``modules``, in source order."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as exc:
        raise LayeringError(f"{path}: does not parse: {exc.msg} (line {exc.lineno})") from exc
    is_package = path.name == "__init__.py"
    rel = str(path.relative_to(root))
    edges: list[ImportEdge] = []

    def add(target: Optional[str], line: int) -> None:
        if target is not None and target != module:
            edges.append(ImportEdge(module, target, rel, line))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_internal(alias.name, modules), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _resolve_relative(module, is_package, node.level, node.module)
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                add(sub if sub in modules else _internal(base, modules), node.lineno)
    edges.sort(key=lambda e: e.line)
    return edges


def _sccs(nodes: Iterable[str], succ: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(succ.get(start, ())))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            advanced = False
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(succ.get(w, ()))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


def _shortest_cycle(start: str, members: set[str], succ: dict[str, list[str]]) -> list[str]:
    """A shortest path start -> ... -> start inside ``members`` (a strongly connected set)."""
    prev: dict[str, str] = {}
    queue = deque([start])
    seen = {start}
    while queue:
        v = queue.popleft()
        for w in succ.get(v, ()):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w in members and w not in seen:
                seen.add(w)
                prev[w] = v
                queue.append(w)
    return [start, start]


def check(root: Path, packages: Sequence[str] = LAYERS) -> LayeringReport:
    """Check the tree under ``root``; ``packages`` are the layers, lowest first."""
    root = Path(root)
    modules = discover_modules(root, packages)
    rank = {pkg: i for i, pkg in enumerate(packages)}
    edges: list[ImportEdge] = []
    for name, path in modules.items():
        edges.extend(module_imports(name, path, modules, root))

    offences: list[Offence] = []
    reported: set[tuple[str, str, int]] = set()
    for e in edges:
        src_pkg, dst_pkg = e.src.split(".")[0], e.dst.split(".")[0]
        if rank[dst_pkg] > rank[src_pkg] and (e.src, e.dst, e.line) not in reported:
            reported.add((e.src, e.dst, e.line))
            offences.append(Offence(
                "upward",
                f"{e.path}:{e.line}: upward import: {e.src} imports {e.dst} "
                f"({src_pkg} is below {dst_pkg})"))

    succ: dict[str, list[str]] = {}
    where: dict[tuple[str, str], ImportEdge] = {}
    for e in edges:
        if (e.src, e.dst) not in where:
            where[(e.src, e.dst)] = e
            succ.setdefault(e.src, []).append(e.dst)
    for comp in _sccs(sorted(modules), succ):
        if len(comp) == 1:
            continue
        head = comp[0]
        cycle = _shortest_cycle(head, set(comp), succ)
        steps = ", ".join(
            f"{where[(a, b)].path}:{where[(a, b)].line}" for a, b in zip(cycle, cycle[1:]))
        others = f" ({len(comp)} modules in the cycle set: {', '.join(comp)})" if len(comp) > len(cycle) - 1 else ""
        offences.append(Offence("cycle", f"import cycle: {' -> '.join(cycle)} [{steps}]{others}"))
    return LayeringReport(modules=len(modules), edges=len(where), offences=tuple(offences))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.check_layering",
        description="Fail on import cycles and upward imports among " + " < ".join(LAYERS) + ".")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="repository root (default: the one this tool lives in)")
    args = parser.parse_args(argv)
    try:
        report = check(args.root)
    except LayeringError as exc:
        print(f"check_layering: {exc}", file=sys.stderr)
        return 2
    for offence in report.offences:
        print(offence)
    if report.offences:
        print(f"check_layering: {len(report.offences)} offence(s) in {report.modules} modules", file=sys.stderr)
        return 1
    print(f"layering ok: {report.modules} modules, {report.edges} internal imports, "
          f"{' < '.join(LAYERS)}, no cycles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
