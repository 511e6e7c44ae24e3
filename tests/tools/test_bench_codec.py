"""tools/bench_codec.py on the CPU: both blob layouts decode to the same signature (the
script asserts it) and the table reports parts and a measured time per decode for each."""
import json

from tools.bench_codec import main


def test_both_layouts_are_timed_and_the_stacked_one_has_fewer_parts(tmp_path, capsys):
    out = tmp_path / "codec.json"
    assert main(["--presets", "ring-bench", "--repeats", "5", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["preset"] == "ring-bench" and row["parts_stacked"] < row["parts_per_layer_layout"]
    assert row["us_per_layer_layout"] > 0 and row["us_stacked"] > 0 and row["speedup"] > 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("ring-bench")
