"""tools/signature_sizes.py and tools/pic_drift.py on small models: the size bound equals
a real signature's bytes when no head has decayed away, and the drift tool finds PIC
exact at the first linear layer and naive addition far off."""
from __future__ import annotations

import torch

from engine.models.config import FULL, GDN, SWA, AttentionConfig, LinearConfig, ModelConfig
from engine.models.presets import get_preset
from engine.models.weights import build_model, save_model
from engine.pic.compute import compute_signature
from tools.pic_drift import measure_preset
from tools.signature_sizes import bound_bytes, main as sizes_main


def test_size_bound_equals_the_bytes_of_a_real_signature():
    cfg = get_preset("gla-tiny")
    model = build_model(cfg, "cpu", torch.float32)
    for n in (5, 40):
        sig = compute_signature(model, list(range(65, 65 + n)), [256], split=min(n, 16))
        assert bound_bytes(cfg, n, anchor=1, seam=16) == sig.bytes_by_part()


def test_size_bound_equals_the_bytes_of_a_kda_and_mla_signature():
    """Kimi Delta Attention (a dense transition per head) and MLA (expanded, padded K/V)."""
    from tools.check_kda_gpu import tiny_kimi_config

    cfg = tiny_kimi_config(64)
    model = build_model(cfg, "cpu", torch.float32)
    for n in (5, 40):
        sig = compute_signature(model, list(range(65, 65 + n)), [256], split=min(n, 16))
        assert bound_bytes(cfg, n, anchor=1, seam=16) == sig.bytes_by_part()


def test_size_table_lists_every_requested_preset_and_length(capsys):
    assert sizes_main(["--presets", "qwen3next-bench,gemma3-tiny", "--lengths", "64,1024"]) == 0
    out = capsys.readouterr().out
    assert out.count("| qwen3next-bench |") == 2 and out.count("| gemma3-tiny |") == 2


def test_drift_is_nil_at_the_first_linear_layer_and_large_for_naive_addition(tmp_path):
    cfg = ModelConfig(name="drift-test", scale="custom", vocab_size=260, hidden_size=32, intermediate_size=64,
                      layers=(GDN, SWA, GDN, FULL),
                      attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8, rotary_dim=4,
                                                sliding_window=6),
                      linear=LinearConfig(num_heads=2, num_v_heads=4, key_dim=8, value_dim=8, conv_size=3))
    save_model(build_model(cfg, "cpu", torch.float32, seed=4), tmp_path)
    res = measure_preset(str(tmp_path), "fact", 1, [4], "cpu", 0)
    naive, pic = res["rows"]
    assert (naive["method"], pic["method"], pic["seam"]) == ("naive", "pic", 6)  # SWA window 6
    assert pic["layers"][0]["rel"] < 1e-5 and naive["layers"][0]["rel"] > 1e-2
    assert pic["layers"][2]["rel"] < naive["layers"][2]["rel"]
    assert 0.0 <= pic["top1"] <= 1.0 and pic["kl"] >= 0.0
