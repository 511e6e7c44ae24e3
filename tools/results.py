"""Benchmark JSON under docs/results/: written atomically (a reader, or a run killed
mid-write on a lent machine, never sees half a file), and runs of one tool split by phase
or preset read back and joined (`--merge`)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_json(path: Path | str, doc: Any, indent: int = 1) -> Path:
    """Write `doc` as JSON to `path` (parents made) through a temporary file renamed over it;
    values JSON cannot hold are written as their str(). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=indent, default=str) + "\n")
    os.replace(tmp, path)
    return path


def read_runs(paths: list[str], tool: str) -> list[dict]:
    """The run JSONs at `paths`, each with a `presets` object; SystemExit naming the file
    that cannot be read or is not a `tool` run."""
    runs = []
    for p in paths:
        try:
            runs.append(json.loads(Path(p).read_text()))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--merge: cannot read run {p}: {exc}")
        if not isinstance(runs[-1].get("presets"), dict):
            raise SystemExit(f"--merge: {p} is not a {tool} run (no 'presets')")
    return runs


def merge_presets(runs: list[dict]) -> dict:
    """The runs' `presets` joined: per preset, workloads from every run (the first run that
    has one wins), and every other key from the first run where it is not empty."""
    presets: dict = {}
    for run in runs:
        for name, pre in run["presets"].items():
            have = presets.setdefault(name, {})
            for key, val in pre.items():
                if key == "workloads":
                    for w, v in val.items():
                        have.setdefault("workloads", {}).setdefault(w, v)
                elif have.get(key) in (None, {}, []):
                    have[key] = val
    return presets
