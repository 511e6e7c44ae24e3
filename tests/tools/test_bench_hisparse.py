"""tools/bench_hisparse.py --quick: the real benchmark code on a tiny preset on the CPU
writes a complete JSON report: measured memory, decode rates, attention mass and quality
figures, and the summary fields (null where --quick measures no 128k point)."""
import json
import math

import torch

from tools.bench_hisparse import main


def test_quick_run_writes_every_phase_and_the_summary_fields(tmp_path, capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path / "hisparse.json"
        assert main(["--quick", "--json-path", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["device"] == "cpu" and not (tmp_path / "hisparse.json.tmp").exists()
    res = doc["results"]
    mem = res["memory"]["qwen3next-tiny"]["lengths"]
    assert set(mem) == {"256", "512"}
    for row in mem.values():
        assert row["hisparse_bytes_per_seq"] > 0 and row["dense_bytes_per_seq"] > 0
        assert row["reduction"] == row["dense_bytes_per_seq"] / row["hisparse_bytes_per_seq"]
    assert mem["512"]["reduction"] > mem["256"]["reduction"] > 1  # dense grows with the context, HiSparse not
    for row in res["decode"]["qwen3next-tiny"].values():
        for kind in ("dense", "hisparse"):
            assert row[kind] and all(math.isfinite(p["tokens_per_s"]) and p["tokens_per_s"] > 0
                                     for p in row[kind].values())
        assert all(0 <= p["hot_hit_rate"] <= 1 for p in row["hisparse"].values())
        assert all(p["graphs"]["used"] is False for k in ("dense", "hisparse") for p in row[k].values())  # CPU
    mass = res["attention_mass"]["qwen3next-tiny"]
    assert 0 < mass["min_share"] <= mass["mean_share"] <= 1 + 1e-6 and mass["samples"] > 0
    task = res["quality"]["qwen3next-tiny"]["tasks"]["fact"]
    assert task["mean_kl"] is not None and task["mean_kl"] >= 0
    assert task["delta_points"] == task["hisparse_score"] - task["dense_score"]
    assert set(doc["summary"]) == {"kv_memory_reduction_128k", "decode_throughput_ratio_equal_batch_128k",
                                   "total_throughput_gain_128k", "quality_delta_points"}
    assert doc["summary"]["kv_memory_reduction_128k"] is None  # no 128k point in --quick
    assert doc["summary"]["quality_delta_points"] == task["delta_points"]
    assert "summary" in capsys.readouterr().out


def test_merge_keeps_the_phases_and_lengths_of_an_earlier_command(tmp_path):
    out = tmp_path / "split.json"
    assert main(["--quick", "--phases", "memory", "--lengths", "256", "--json-path", str(out)]) == 0
    assert main(["--quick", "--phases", "memory", "--lengths", "512", "--merge", "--json-path", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["results"]["memory"]["qwen3next-tiny"]["lengths"]) == {"256", "512"}
    assert len(doc["runs"]) == 1 and "--lengths 256" in doc["runs"][0]["command"]


def test_decode_finds_the_largest_batches_from_the_budgets_not_a_fixed_cap(tmp_path):
    out = tmp_path / "batches.json"
    assert main(["--quick", "--phases", "decode", "--lengths", "256", "--max-batch", "0", "--decode-steps", "1",
                 "--memory-budget-gib", "0.0025", "--host-budget-gib", "0.004", "--json-path", str(out)]) == 0
    doc = json.loads(out.read_text())
    row = doc["results"]["decode"]["qwen3next-tiny"]["256"]
    budget = row["device_budget_bytes"]
    assert row["batch_cap"] is None
    assert row["dense_max_batch"] == budget // row["dense_bytes_per_seq"] > 2
    host_cap = row["host_budget_bytes"] // row["offloaded_bytes_per_seq"]
    assert row["hisparse_host_cap"] == host_cap
    assert row["hisparse_max_batch"] == min(budget // row["hisparse_bytes_per_seq"], host_cap) > 2
    assert row["equal_batch"] == min(row["dense_max_batch"], row["hisparse_max_batch"])
    for kind, big in (("dense", row["dense_max_batch"]), ("hisparse", row["hisparse_max_batch"])):
        assert row[kind][str(big)]["tokens_per_s"] > 0 and row[kind][str(row["equal_batch"])]["tokens_per_s"] > 0


def test_summary_gains_compare_each_kind_at_its_own_largest_batch():
    from tools.bench_hisparse import summarize

    dec = {"dense": {"4": {"tokens_per_s": 100.0}, "10": {"tokens_per_s": 200.0}},
           "hisparse": {"4": {"tokens_per_s": 90.0}, "25": {"tokens_per_s": 500.0}},
           "dense_max_batch": 10, "hisparse_max_batch": 25, "equal_batch": 4}
    out = {"memory": {"p": {"lengths": {"131072": {"reduction": 14.0}}}}, "decode": {"p": {"131072": dec}}}
    summary = summarize(out)
    assert summary["decode_throughput_ratio_equal_batch_128k"] == 0.9
    assert summary["total_throughput_gain_128k"] == 2.5
