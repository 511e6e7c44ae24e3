"""Checkpoints of every supported architecture (Qwen3-Next, Qwen3.5 dense and MoE,
Gemma 3, Nemotron-H): our engine loads a tiny random transformers checkpoint and matches
transformers' own model (prefill logits and 16 greedy decode steps within 1e-4, fp32), also
from a sharded checkpoint and with chunked prefill."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import hf_testlib as H  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(arch: str, shard: bool = False):
        key = (arch, shard)
        if key not in made:
            d = tmp_path_factory.mktemp(f"{arch}{'-sharded' if shard else ''}")
            model, ids = H.build(arch, d, shard=shard)
            made[key] = (model, d, ids)
        return made[key]
    return get


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen3_5_moe", "gemma3", "nemotron_h",
                                  "bailing_moe_linear"])
def test_checkpoint_matches_transformers_prefill_and_greedy_decode(checkpoints, arch):
    model, d, _ = checkpoints(arch)
    H.assert_parity(H.check_parity(model, d, chunk=7))


def test_sharded_qwen3_next_checkpoint_matches_transformers(checkpoints):
    model, d, _ = checkpoints("qwen3_next", shard=True)
    assert (d / "model.safetensors.index.json").is_file()
    assert len(list(d.glob("model-*.safetensors"))) > 1
    H.assert_parity(H.check_parity(model, d))


def test_sharded_ring_linear_checkpoint_matches_the_reference(checkpoints):
    model, d, _ = checkpoints("bailing_moe_linear", shard=True)
    assert (d / "model.safetensors.index.json").is_file()
    assert len(list(d.glob("model-*.safetensors"))) > 1
    H.assert_parity(H.check_parity(model, d))


def test_ring_linear_maps_layers_rope_norms_and_router(checkpoints):
    from engine.models.hf import convert_checkpoint

    _, d, _ = checkpoints("bailing_moe_linear")
    cfg = convert_checkpoint(d).config
    assert cfg.layers == ("lightning", "lightning", "full") * 2  # layer_group_size 3
    assert cfg.mlp_layers == ("dense",) + ("moe",) * 5  # first_k_dense_replace 1
    lin, m = cfg.linear, cfg.moe
    assert (lin.rotary_dim, lin.qk_norm, lin.qkv_silu, lin.norm_groups, lin.decay_layer_offset) == (8, True, False,
                                                                                                    2, -1)
    assert (cfg.attention.rotary_dim, cfg.attention.qk_norm, cfg.attention.output_gate) == (8, True, False)
    assert (m.scoring, m.expert_bias, m.num_groups, m.topk_groups, m.routed_scaling_factor) == ("sigmoid", True, 4,
                                                                                               2, 2.5)
    assert (m.shared_intermediate_size, m.shared_expert_gate) == (16, False)


def test_ring_linear_decay_slopes_follow_the_published_depth_term(checkpoints):
    """-alibi_slope_h * (1 - (i - 1) / (L - 1) + 1e-5) with i the layer's index among all
    layers: layer 0 decays faster than layer 1 (the published code's `layer_idx - 1`)."""
    import torch

    from engine.models.hf import load_hf_model

    _, d, _ = checkpoints("bailing_moe_linear")
    model = load_hf_model(d).model
    ref = H.bailing_reference().BailingMoeV2LinearAttention
    base = ref.build_slope_tensor(4)
    for i in (0, 1, 3, 4):
        want = -base * (1 - (i - 1) / 5 + 1e-5)
        got = torch.tensor(model.mixer(i).head_log_decay)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_qwen3_next_maps_moe_layers_and_mlp_only_layers(checkpoints):
    from engine.models.hf import convert_checkpoint

    _, d, _ = checkpoints("qwen3_next")
    cfg = convert_checkpoint(d).config
    assert cfg.layers == ("gdn", "gdn", "gdn", "full")
    assert cfg.mlp_layers == ("moe", "dense", "moe", "moe")  # mlp_only_layers=[1]
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.shared_expert_gate) == (4, 2, True)
    assert cfg.attention.rotary_dim == 4  # partial_rotary_factor 0.25 of head_dim 16


def test_gemma3_maps_windows_norms_and_scales(checkpoints):
    from engine.models.hf import convert_checkpoint

    _, d, _ = checkpoints("gemma3")
    cfg = convert_checkpoint(d).config
    assert cfg.layers == ("swa",) * 5 + ("full",)
    a = cfg.attention
    assert (a.sliding_window, a.query_scale, a.swa_rope_theta, a.rope_theta) == (8, 24.0, 10000.0, 1e6)
    assert cfg.post_norms and cfg.tie_embeddings and cfg.hidden_act == "gelu_tanh"
    assert cfg.embed_scale == 64 ** 0.5


def test_nemotron_h_pairs_each_mixer_with_the_mlp_layer_after_it(checkpoints):
    from engine.models.hf import convert_checkpoint

    _, d, _ = checkpoints("nemotron_h")
    cfg = convert_checkpoint(d).config  # M - M * - M M -
    assert cfg.layers == ("mamba2", "mamba2", "full", "mamba2", "mamba2")
    assert cfg.mlp_layers == ("dense", "none", "dense", "none", "dense")
    assert (cfg.linear.mamba_norm, cfg.gated_mlp, cfg.hidden_act, cfg.attention.rotary_dim) == (
        "group", False, "relu2", 0)


@pytest.mark.parametrize("types, named", [
    (["mlp", "linear_attention"], "layers_block_type[0]='mlp'"),
    (["linear_attention", "mlp", "mlp"], "layers_block_type[2]='mlp'"),
    (["linear_attention", "moe"], "layers_block_type[1]='moe'"),
])
def test_nemotron_h_layouts_without_a_block_form_are_refused(types, named):
    from engine.errors import UnsupportedConfigError
    from engine.models.hf.nemotron_h import block_plan

    with pytest.raises(UnsupportedConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        block_plan(types, "config.json")


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3"])
def test_multimodal_checkpoint_runs_its_text_model_and_skips_the_vision_tower_with_a_log_line(arch, tmp_path,
                                                                                           caplog):
    import logging

    import torch

    from engine.models.hf import load_hf_model

    model = H.build_multimodal(arch, tmp_path / "mm")
    with caplog.at_level(logging.INFO, logger="engine.models.hf.loader"):
        loaded = load_hf_model(tmp_path / "mm")
    assert any("vision" in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records)
    ids = torch.randint(0, H.VOCAB - 4, (1, 30), generator=torch.Generator().manual_seed(5))  # no image tokens
    with torch.no_grad():
        ref = model(input_ids=ids).logits[0]
        ours = loaded.model.forward(ids)[0]
    assert float(ref.abs().max()) > 0.1
    torch.testing.assert_close(ours, ref, rtol=H.TOL, atol=H.TOL)


def test_bf16_model_keeps_zero_centred_norm_weights_in_float32(checkpoints):
    import torch

    from engine.models.hf import load_hf_model
    from engine.models.hf.checkpoint import CheckpointTensors

    _, d, _ = checkpoints("qwen3_5")
    loaded = load_hf_model(d, dtype="bfloat16")
    m = loaded.model
    assert m.dtype == torch.bfloat16 and m.blocks[0].mlp.gate_up.weight.dtype == torch.bfloat16
    w = CheckpointTensors(d).take("model.norm.weight")
    assert m.norm.weight.dtype == torch.float32
    assert torch.equal(m.norm.weight, 1.0 + w.float())  # not rounded to bf16's spacing near 1
    with torch.no_grad():
        logits = m.forward(torch.tensor([[1, 2, 3]]))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


@pytest.mark.parametrize("edit, named", [
    (lambda c: c.update(norm_head=True), "norm_head"),
    (lambda c: c.update(use_qkv_bias=True), "use_qkv_bias"),
    (lambda c: c.update(layer_group_size=4), "layer_group_size"),
    (lambda c: c.update(rope_scaling={"type": "yarn", "factor": 2.0}), "rope_scaling"),
    (lambda c: c.update(linear_rope=False), "linear_rope"),
    (lambda c: c.update(score_function="softmax"), "score_function"),
    (lambda c: c.update(head_dim=32), "head_dim"),
    (lambda c: c.update(some_new_feature=3), "some_new_feature"),
])
def test_ring_linear_config_fields_we_do_not_implement_are_refused_by_name(checkpoints, tmp_path, edit, named):
    import json
    import shutil

    from engine.errors import ConfigError
    from engine.models.hf import convert_checkpoint

    _, d, _ = checkpoints("bailing_moe_linear")
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    cfg = json.loads((bad / "config.json").read_text())
    edit(cfg)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=named):
        convert_checkpoint(bad)


def test_bf16_ring_linear_keeps_its_sigmoid_router_in_float32(checkpoints):
    import torch

    from engine.models.hf import load_hf_model

    _, d, _ = checkpoints("bailing_moe_linear")
    m = load_hf_model(d, dtype="bfloat16").model
    moe = m.blocks[1].mlp
    assert m.dtype == torch.bfloat16 and moe.experts_gate_up.dtype == torch.bfloat16
    assert moe.router.weight.dtype == torch.float32 and moe.router_bias.dtype == torch.float32
    assert m.mixer(0).norm.weight.dtype == torch.bfloat16  # the group norm computes in float32 anyway
    with torch.no_grad():
        logits = m.forward(torch.tensor([[1, 2, 3, 4, 5]]))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
