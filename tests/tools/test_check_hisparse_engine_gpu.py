"""tools/check_hisparse_engine_gpu.py --quick on the CPU: an engine built with HiSparse holds
decode graphs over its HiSparse layers; the graphs' static-buffer step (what a CUDA graph
replays) decodes the same tokens and logits as eager HiSparse decode with top-k selection
moving blocks; the timing phase measures both and dense with graphs; the JSON holds every phase."""
import json

from tools.check_hisparse_engine_gpu import main


def test_quick_engine_check_passes_and_writes_every_phase(tmp_path):
    out = tmp_path / "check.json"
    assert main(["--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["pass"] and doc["build"]["graphs_on"] and doc["build"]["hisparse_layers"] > 0
    eq = doc["equal"]
    assert eq["tokens_equal"] and eq["max_abs_logit_diff"] <= eq["logit_tolerance"]
    assert len(eq["tokens"]) == doc["params"]["steps"]
    g = eq["graphs"]
    assert g["capture"] is False and g["static_steps"] == doc["params"]["steps"] and not g["fallbacks"]
    hs = eq["hisparse"]
    assert hs["blocks_fetched"] > 0 and hs["decode_steps"] == 2 * doc["params"]["steps"]
    t = doc["timing"]
    for key in ("hisparse_graph_tokens_per_s", "hisparse_eager_tokens_per_s", "dense_graph_tokens_per_s"):
        assert t[key] > 0
    assert t["dense_graphs"]["static_steps"] > 0 and t["hisparse_graphs"]["static_steps"] > 0
