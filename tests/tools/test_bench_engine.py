"""tools/bench_engine.py --quick: runs the real benchmark code on a tiny preset on the
CPU and writes a JSON report with a measured number in every cell it did not skip."""
import json
import math

import torch

from tools.bench_engine import main


def test_quick_run_writes_prefill_and_decode_measurements(tmp_path, capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path / "engine.json"
        assert main(["--quick", "--presets", "qwen3next-tiny", "--lengths", "32,64", "--batches", "1,2",
                     "--decode-steps", "2", "--json-path", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and not (tmp_path / "engine.json.tmp").exists()
    assert doc["settings"]["lengths"] == [32, 64] and doc["device"] == "cpu"
    (res,) = doc["results"]
    assert res["preset"] == "qwen3next-tiny" and res["num_params"] > 0
    assert set(res["paths"]) == {"engine", "torch"}
    for path in res["paths"].values():
        assert set(path["prefill_s"]) == {"32", "64"} and set(path["decode_tokens_per_s"]) == {"1", "2"}
        for v in [*path["prefill_s"].values(), *path["decode_tokens_per_s"].values()]:
            assert v is not None and math.isfinite(v) and v > 0
    table = capsys.readouterr().out
    assert "qwen3next-tiny" in table and "speedup" in table and "decode b2 tok/s" in table
