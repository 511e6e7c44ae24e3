"""Presets: the registry, the layer patterns they mirror, and their sizes per scale."""
from __future__ import annotations

import pytest

from engine.errors import PresetNotFoundError
from engine.models.presets import count_parameters, get_preset, list_presets, preset_info

FAMILIES = {"qwen3next", "ring", "gemma3", "nemotronh", "gla"}


def test_every_family_exists_at_tiny_and_bench_scale():
    names = {c.name for c in list_presets()}
    for fam in FAMILIES:
        assert {f"{fam}-tiny", f"{fam}-bench"} <= names
    assert all(c.scale == "tiny" for c in list_presets("tiny"))
    assert all(c.scale == "bench" for c in list_presets("bench"))


@pytest.mark.parametrize("name", [c.name for c in list_presets()])
def test_preset_info_has_the_cli_fields(name):
    info = preset_info(get_preset(name))
    assert info["name"] == name and info["family"] in FAMILIES and info["scale"] in ("tiny", "bench")
    assert info["layers"] == list(get_preset(name).layers) and info["parameters"] > 0


def test_layer_patterns_mirror_the_production_hybrids():
    q = get_preset("qwen3next-bench")
    assert q.layers[:4] == ("gdn", "gdn", "gdn", "full") and q.layers.count("gdn") == 3 * q.layers.count("full")
    assert q.attention.rotary_dim * 4 == q.attention.head_dim and q.attention.output_gate
    g = get_preset("gemma3-bench")
    assert g.layers[:6] == ("swa",) * 5 + ("full",) and g.attention.sliding_window
    r = get_preset("ring-bench")
    assert r.layers.count("lightning") == 7 * r.layers.count("full")
    n = get_preset("nemotronh-bench")
    assert set(n.layers) == {"mamba2", "full"} and n.layers.count("full") * 8 == n.num_layers
    assert set(get_preset("gla-tiny").layers) == {"gla", "full"}


def test_tiny_presets_fit_a_small_fp32_checkpoint_and_byte_vocab():
    for cfg in list_presets("tiny"):
        params = count_parameters(cfg)
        assert 1_000_000 <= params <= 4_000_000, (cfg.name, params)
        assert params * 4 < 16 * 2**20
        assert cfg.vocab_size == 260 and cfg.max_position_embeddings >= 4096


def test_bench_presets_are_one_to_three_billion_parameters():
    for cfg in list_presets("bench"):
        assert 1e9 <= count_parameters(cfg) <= 3e9, cfg.name
        assert cfg.dtype == "bfloat16" and cfg.max_position_embeddings >= 65536


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(PresetNotFoundError, match="qwen3next-tiny"):
        get_preset("llama-7b")
