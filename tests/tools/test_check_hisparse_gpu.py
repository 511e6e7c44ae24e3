"""tools/check_hisparse_gpu.py --quick on the CPU: the HiSparse decode step with a tiny hot
buffer equals exact attention over its selected blocks, selects what the torch reference
scoring selects, fetches and stages blocks, and the timing phase writes its figures."""
import json

from tools.check_hisparse_gpu import main


def test_quick_check_passes_and_writes_every_phase(tmp_path, capsys):
    out = tmp_path / "check.json"
    assert main(["--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    ex = doc["exact"]
    assert ex["pass"] and ex["max_abs_diff"] <= 1e-4 and ex["selection_agreement"] == 1.0
    assert ex["blocks_fetched"] > 0 and ex["blocks_staged"] > 0
    assert doc["graph"] == {"skipped": "CUDA graphs need CUDA"}
    row = doc["timing"]["128"]
    assert row["host_sync_guard"] == [] and row["aten_ops_per_step"] > 0
    assert row["hisparse_eager_ms"] > 0 and row["dense_ms"] > 0 and row["blocks_fetched_per_seq_step"] > 0


def test_hot_rate_tool_auto_hot_buffer_holds_the_union_and_stages_nothing():
    from tools.hisparse_hot_rate import main as hot_rate

    small, auto = hot_rate(["--length", "256", "--batch", "2", "--steps", "8", "--warmup", "2", "--drifts", "0.05",
                            "--d", "16", "--heads", "4"])
    assert small["hot_blocks"] == 10 and auto["hot_blocks"] == auto["rows_per_slot"] == 18
    assert auto["staged_per_seq_step"] == 0 and small["staged_per_seq_step"] > 0
    assert auto["hit_rate"] > small["hit_rate"]
