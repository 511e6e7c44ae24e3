"""tools.results.write_json: atomic JSON writes of benchmark results."""
import json
from pathlib import Path

from tools.results import write_json


def test_write_json_makes_parents_replaces_atomically_and_strs_what_json_cannot_hold(tmp_path):
    path = tmp_path / "a" / "b" / "run.json"
    assert write_json(path, {"x": 1}) == path
    assert json.loads(path.read_text()) == {"x": 1}
    write_json(str(path), {"p": Path("/q"), "n": [1, 2]}, indent=2)
    assert json.loads(path.read_text()) == {"p": "/q", "n": [1, 2]}
    assert [p.name for p in path.parent.iterdir()] == ["run.json"]  # no temporary left behind
