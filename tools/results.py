"""Writing a benchmark's JSON under docs/results/ (or anywhere): atomically, so a reader,
or a run killed mid-write (a timeout on a lent machine), never sees half a file."""
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
