"""Checkpoints of every supported architecture (Qwen3-Next, Qwen3.5 dense and MoE,
Gemma 3): our engine loads a tiny random transformers checkpoint and matches
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


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "qwen3_5_moe", "gemma3"])
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
