"""Real-shape bench presets: the published dimensions (Qwen3.5-35B-A3B through the HF
converter itself, Ring-mini-linear-2.0 through the Ring converter), their size against one H200, kept out of the bench loops; and the
fast random-init path they load through (meta device, storage made in the target dtype on
the target device, seeded in place) with a fingerprint that reads no weights. The code
path is exercised on the CPU with scaled-down variants, not at 35B."""
from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.models import loaded as loaded_mod
from engine.models.loaded import generator_identity
from engine.models import published
from engine.models.config import FULL, GDN, LIGHTNING, MOE
from engine.models.decoder import HybridDecoder
from engine.models.hf import bailing, qwen3
from engine.models.hf.fields import ConfigFields
from engine.models.presets import REAL_SHAPE_PRESETS, count_parameters, get_preset, list_presets, preset_info
from engine.models.weights import INIT_RECIPE, build_model, fingerprint, fingerprint_init, load_model
from engine.runtime.sequence import Sequence
from tools import bench_models

ROOT = Path(__file__).resolve().parents[3]
H200_BYTES = 139 * 2**30


def test_qwen3_5_35b_a3b_real_is_what_the_hf_converter_makes_of_the_published_config():
    converted = qwen3.model_config(ConfigFields(published.QWEN3_5_35B_A3B_TEXT, "config.json"), "qwen3_5_moe_text",
                                   "qwen3.5-35b-a3b-real")
    preset = get_preset("qwen3.5-35b-a3b-real")
    assert converted.replace(family=preset.family, scale=preset.scale, dtype=preset.dtype) == preset
    assert preset.num_layers == 40 and preset.layers.count(FULL) == 10 and preset.layers[:4] == (GDN,) * 3 + (FULL,)
    assert preset.vocab_size == 248320 and preset.hidden_size == 2048
    assert (preset.moe.num_experts, preset.moe.top_k, preset.moe.intermediate_size,
            preset.moe.shared_intermediate_size) == (256, 8, 512, 512)
    assert set(preset.mlp_layers) == {MOE}
    a, lin = preset.attention, preset.linear
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.rotary_dim, a.rope_theta) == (16, 2, 256, 64, 1e7)
    assert (lin.num_heads, lin.num_v_heads, lin.key_dim, lin.value_dim, lin.conv_size) == (16, 32, 128, 128, 4)


def test_ring_mini_linear_real_is_what_the_ring_converter_makes_of_the_published_config():
    c = published.RING_MINI_LINEAR_2_0
    converted = bailing.model_config(ConfigFields(c, "config.json"), "ring-mini-linear-2.0-real")
    p = get_preset("ring-mini-linear-2.0-real")
    assert converted.replace(family=p.family, scale=p.scale, dtype=p.dtype) == p
    assert p.family == "ring" and p.num_layers == 20
    assert p.layer_indices(FULL) == [4, 9, 14, 19] and p.layers.count(LIGHTNING) == 16
    assert p.mlp_layers[0] == "dense" and set(p.mlp_layers[1:]) == {MOE} and p.intermediate_size == 5120
    assert (p.vocab_size, p.hidden_size, p.max_position_embeddings) == (c["vocab_size"], 2048, 131072)
    assert (p.moe.num_experts, p.moe.top_k, p.moe.intermediate_size, p.moe.shared_intermediate_size,
            p.moe.shared_expert_gate) == (256, 8, 512, 512, False)
    assert (p.moe.scoring, p.moe.expert_bias, p.moe.num_groups, p.moe.topk_groups, p.moe.routed_scaling_factor) == \
        ("sigmoid", True, 8, 4, 2.5)
    a, lin = p.attention, p.linear
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.rotary_dim, a.rope_theta, a.qk_norm, a.output_gate) == \
        (16, 4, 128, 64, 1e6, True, False)
    assert lin.num_heads * lin.key_dim * 3 == 6144  # Ring's fused linear qkv width
    assert (lin.qkv_silu, lin.qk_norm, lin.rotary_dim, lin.rope_theta, lin.norm_groups, lin.decay_layer_offset) == \
        (False, True, 64, 1e6, 4, -1)


def test_the_whole_ring_real_shape_preset_builds_on_the_meta_device_with_ring_modules():
    cfg = get_preset("ring-mini-linear-2.0-real")
    with torch.device("meta"):
        model = HybridDecoder(cfg).to(torch.bfloat16)  # build_model's first step, before storage
    params = dict(model.named_parameters())
    assert sum(t.numel() for t in params.values()) == count_parameters(cfg)
    assert {t.device.type for t in params.values()} == {"meta"}
    assert params["blocks.0.mixer.qkv_proj.weight"].shape == (6144, 2048)
    assert params["blocks.0.mixer.q_norm.weight"].shape == params["blocks.0.mixer.k_norm.weight"].shape == (128,)
    assert model.blocks[0].mixer.norm.groups == 4 and model.blocks[0].mixer.rotary_dim == 64
    assert params["blocks.0.mlp.gate_up.weight"].shape == (2 * 5120, 2048)
    assert params["blocks.1.mlp.router_bias"].shape == (256,)
    assert params["blocks.1.mlp.experts_gate_up"].shape == (256, 2 * 512, 2048)
    assert "blocks.1.mlp.shared.gate_up.weight" in params and "blocks.1.mlp.shared_gate.weight" not in params
    assert params["blocks.4.mixer.k_proj.weight"].shape == (4 * 128, 2048)
    assert params["blocks.4.mixer.q_norm.weight"].shape == (128,)


@pytest.mark.parametrize("name", REAL_SHAPE_PRESETS)
def test_a_scaled_down_real_shape_preset_prefills_then_decodes_as_its_parallel_forward(name, make_runner):
    """bench_models' --quick variant (one layer group, widths / 8, the real routing, float32)
    through the engine's runner: prefill, then greedy decode steps, each step's logits equal
    to the whole sequence's parallel forward."""
    cfg = bench_models.scaled_down(name)
    if cfg.moe.num_groups > 1:  # group-limited routing really limits: 4 of 8 groups, 8 of 16 eligible
        assert cfg.moe.top_k < cfg.moe.topk_groups * cfg.moe.num_experts // cfg.moe.num_groups
    model = build_model(cfg, "cpu", torch.float32)
    runner = make_runner(model, block_size=16, num_blocks=8, num_slots=1)
    seq = runner.cache.allocate(Sequence("s"))
    ids = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = runner.prefill(seq, ids, 0)
    for _ in range(6):
        nxt = logits.argmax(-1).reshape(1)
        ids = torch.cat([ids, nxt])
        with torch.no_grad():
            logits = runner.decode([seq], nxt)[0]
            ref = model(ids[None])[0, -1]
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name, billions", [("qwen3.5-35b-a3b-real", 34.7), ("ring-mini-linear-2.0-real", 16.4)])
def test_real_shape_presets_have_the_published_size_and_fit_one_h200_in_bf16(name, billions):
    cfg = get_preset(name)
    params = count_parameters(cfg)
    assert abs(params / 1e9 - billions) < 0.1, params
    assert cfg.dtype == "bfloat16" and cfg.scale == "bench"
    assert params * 2 < H200_BYTES - 60 * 2**30  # weights leave > 60 GiB for KV and activations


def test_real_shape_presets_are_listed_only_when_asked():
    assert not set(REAL_SHAPE_PRESETS) & {c.name for c in list_presets("bench")}
    assert set(REAL_SHAPE_PRESETS) <= {c.name for c in list_presets("bench", real_shape=True)}
    info = preset_info(get_preset("ring-mini-linear-2.0-real"))
    assert info["real_shape"] is True and info["scale"] == "bench"
    assert preset_info(get_preset("ring-bench"))["real_shape"] is False


def _scaled_down(name: str, layers: int, experts: int):
    """A real-shape preset cut to `layers` layers, `experts` experts of half width and a
    4096 vocabulary: the same code path at CPU size."""
    cfg = get_preset(name)
    mlp = cfg.mlp_layers[:layers]
    return cfg.replace(layers=cfg.layers[:layers], mlp_layers=mlp, vocab_size=4096,
                       moe=replace(cfg.moe, num_experts=experts, intermediate_size=cfg.moe.intermediate_size // 2))


@pytest.mark.parametrize("name, layers, experts", [("qwen3.5-35b-a3b-real", 4, 8),
                                                  ("ring-mini-linear-2.0-real", 2, 16)])  # 8 groups of 2
def test_random_init_is_made_in_bf16_on_the_device_and_is_seeded(name, layers, experts):
    cfg = _scaled_down(name, layers=layers, experts=experts)
    t0 = time.perf_counter()
    model = build_model(cfg, "cpu", torch.bfloat16)
    built_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    assert params > 30e6
    assert built_s < 60, built_s  # seconds, not minutes (a few seconds here on a shared core)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    again = build_model(cfg, "cpu", torch.bfloat16)
    other = build_model(cfg, "cpu", torch.bfloat16, seed=1)
    state, state2, state3 = model.state_dict(), again.state_dict(), other.state_dict()
    assert all(torch.equal(state[k], state2[k]) for k in state)
    moe = next(m for m in model.modules() if m.__class__.__name__ == "SparseMoE")
    experts = moe.experts_gate_up.float()
    assert experts.std().item() == pytest.approx(0.02, rel=0.05)  # drawn, not left empty
    key = next(k for k in state if k.endswith("experts_gate_up"))
    assert not torch.equal(state[key], state3[key])


def test_the_meta_path_draws_the_same_weights_as_building_in_float32_then_casting():
    cfg = get_preset("qwen3next-tiny")
    from engine.models.decoder import HybridDecoder
    from engine.models.weights import initialize

    reference = initialize(HybridDecoder(cfg).to(torch.bfloat16))
    fast = build_model(cfg, "cpu", torch.bfloat16)
    assert fingerprint(fast) == fingerprint(reference)


def test_a_seeded_preset_is_fingerprinted_from_its_recipe_without_reading_the_weights(tmp_path, monkeypatch):
    def no_hashing(*_a, **_k):
        raise AssertionError("the weights were hashed")

    monkeypatch.setattr(loaded_mod, "fingerprint", no_hashing)
    monkeypatch.setattr(loaded_mod, "fingerprint_state", no_hashing)
    got = load_model("ring-tiny", models_root=tmp_path)
    assert got.source == "init:seed=0"
    cfg = get_preset("ring-tiny")
    assert got.fingerprint == fingerprint_init(cfg, 0, INIT_RECIPE, torch.float32, "cpu")
    assert load_model("ring-tiny", models_root=tmp_path, seed=3).fingerprint != got.fingerprint
    assert load_model("ring-tiny", models_root=tmp_path, dtype="bfloat16").fingerprint != got.fingerprint
    assert fingerprint_init(cfg, 0, INIT_RECIPE, torch.float32, "meta") != got.fingerprint  # another generator
    assert generator_identity("cpu") == f"cpu:{torch.backends.cpu.get_cpu_capability()}"
    assert fingerprint_init(cfg.replace(rms_norm_eps=1e-5), 0, INIT_RECIPE, torch.float32, "cpu") != got.fingerprint
    code = ("import torch; from engine.models.presets import get_preset; from engine.models.weights import "
            "INIT_RECIPE, fingerprint_init; print(fingerprint_init(get_preset('ring-tiny'), 0, INIT_RECIPE, "
            "torch.float32, 'cpu'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == got.fingerprint
