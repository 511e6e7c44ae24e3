"""tools/check_kda_gpu.py's --quick CPU mode: every phase runs (torch only), writes its
JSON, and the torch figures it reports are small (the GPU mode compares fla against them)."""
from __future__ import annotations

import json

from tools import check_kda_gpu


def test_quick_mode_writes_every_cpu_phase_with_small_errors(tmp_path):
    out = tmp_path / "kda.json"
    result = check_kda_gpu.main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["device"] == "cpu" and result["fla_kda"] is False
    rec, model = result["recurrence"], result["model"]
    assert rec["torch_chunked"]["o"] < 1e-5 and rec["torch_chunked"]["state"] < 1e-5
    assert rec["fla"].startswith("skipped")
    assert model["logit_abs_max"] > 0.1
    assert model["pic_whole_seam_vs_full_torch"] < 1e-4
    assert "throughput" not in result
