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


def _assert_parity(r: dict) -> None:
    assert r["logit_scale"] > 0.1  # the reference logits are not all ~0 (a vacuous match)
    assert r["prefill_err"] <= H.TOL, r["prefill_err"]
    assert len(r["step_errs"]) == H.DECODE_STEPS
    assert max(r["step_errs"]) <= H.TOL, r["step_errs"]
    assert r["gen"] == r["ref_gen"]


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen3_5_moe", "gemma3", "nemotron_h"])
def test_checkpoint_matches_transformers_prefill_and_greedy_decode(checkpoints, arch):
    model, d, _ = checkpoints(arch)
    _assert_parity(H.check_parity(model, d, chunk=7))


def test_sharded_qwen3_next_checkpoint_matches_transformers(checkpoints):
    model, d, _ = checkpoints("qwen3_next", shard=True)
    assert (d / "model.safetensors.index.json").is_file()
    assert len(list(d.glob("model-*.safetensors"))) > 1
    _assert_parity(H.check_parity(model, d))


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
