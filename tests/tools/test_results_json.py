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


def test_runs_read_back_and_joined_by_preset(tmp_path):
    import pytest

    from tools.results import merge_presets, read_runs

    a = write_json(tmp_path / "a.json", {"presets": {"p": {"workloads": {"rag": 1}, "engine": {}}}})
    b = write_json(tmp_path / "b.json", {"presets": {"p": {"workloads": {"rag": 2, "fact": 3}, "engine": {"x": 1}}}})
    runs = read_runs([str(a), str(b)], "bench_x")
    assert merge_presets(runs) == {"p": {"workloads": {"rag": 1, "fact": 3}, "engine": {"x": 1}}}
    bad = write_json(tmp_path / "c.json", {"rows": []})
    with pytest.raises(SystemExit, match="c.json is not a bench_x run"):
        read_runs([str(bad)], "bench_x")
