"""tools.check_layering: cycles and upward imports in a synthetic tree; the repository passes."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tools.check_layering import LayeringError, check, main

REPO = Path(__file__).resolve().parents[2]


def write_tree(root: Path, files: dict[str, str]) -> None:
    for pkg in ("kernels", "kvstore", "engine", "tools"):
        (root / pkg).mkdir(parents=True, exist_ok=True)
        (root / pkg / "__init__.py").touch()
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.name != "__init__.py":
            (path.parent / "__init__.py").touch()
        path.write_text(textwrap.dedent(text))


def test_clean_tree_passes(tmp_path: Path) -> None:
    write_tree(tmp_path, {
        "kernels/k.py": "import torch\n",
        "kvstore/store.py": "from kernels import k\n",
        "engine/pic/a.py": "from kvstore.store import x\nfrom . import b\n",
        "engine/pic/b.py": "import engine.cache.c\n",
        "engine/cache/c.py": "from ..errors import E\n",
        "engine/errors.py": "class E(Exception): pass\n",
        "tools/t.py": "import engine.pic.a, kernels.k\n",
    })
    report = check(tmp_path)
    assert report.offences == ()
    assert report.modules == 13
    assert report.edges == 7


def test_upward_import_inside_a_function_is_reported(tmp_path: Path) -> None:
    write_tree(tmp_path, {
        "kernels/k.py": """\
            def f():
                from engine.models import layers  # hidden in a function
                return layers
            """,
        "engine/models/layers.py": "X = 1\n",
    })
    offences = check(tmp_path).offences
    assert [o.kind for o in offences] == ["upward"]
    assert str(offences[0]) == (
        "kernels/k.py:2: upward import: kernels.k imports engine.models.layers (kernels is below engine)")


def test_module_cycle_within_a_package_is_reported_once(tmp_path: Path) -> None:
    write_tree(tmp_path, {
        "engine/runtime/runner.py": "from engine.runtime.graphs import G\n",
        "engine/runtime/graphs.py": """\
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from .runner import R
            """,
        "engine/runtime/other.py": "from engine.runtime import runner\n",
    })
    offences = check(tmp_path).offences
    assert [o.kind for o in offences] == ["cycle"]
    text = str(offences[0])
    assert "engine.runtime.graphs -> engine.runtime.runner -> engine.runtime.graphs" in text
    assert "engine/runtime/graphs.py:3" in text and "engine/runtime/runner.py:1" in text
    assert "other" not in text


def test_cross_package_cycle_reports_the_upward_edge_and_the_cycle(tmp_path: Path) -> None:
    write_tree(tmp_path, {
        "kernels/chain.py": "from engine.ops import RecurrenceInputs\n",
        "kvstore/store.py": "import kernels.chain\n",
        "engine/ops.py": "from kvstore import store\n",
    })
    offences = check(tmp_path).offences
    kinds = sorted(o.kind for o in offences)
    assert kinds == ["cycle", "upward"]
    cycle = next(str(o) for o in offences if o.kind == "cycle")
    assert "engine.ops -> kvstore.store -> kernels.chain -> engine.ops" in cycle


def test_main_exits_1_with_one_line_per_offence(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_tree(tmp_path, {
        "kvstore/a.py": "import tools.t\n",
        "kvstore/b.py": "from kvstore import c\n",
        "kvstore/c.py": "import kvstore.b\n",
        "tools/t.py": "",
    })
    assert main(["--root", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("kvstore/a.py:1: upward import: kvstore.a imports tools.t")
    assert lines[1].startswith("import cycle: kvstore.b -> kvstore.c -> kvstore.b")


def test_missing_package_or_bad_syntax_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(LayeringError, match="package 'kernels' not found"):
        check(tmp_path)
    write_tree(tmp_path, {"engine/x.py": "def (:\n"})
    assert main(["--root", str(tmp_path)]) == 2
    assert "engine/x.py: does not parse" in capsys.readouterr().err


def test_repository_itself_passes() -> None:
    proc = subprocess.run([sys.executable, "-m", "tools.check_layering"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("layering ok:")
