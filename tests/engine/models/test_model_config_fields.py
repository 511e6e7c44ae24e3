"""ModelConfig fields added for checkpoints (MoE, MLP variants, Gemma norms and scales,
Mamba2 norm variants): they stay out of the canonical JSON while at their defaults (so
every preset and trained model keeps its fingerprint), round-trip through JSON when set,
and bad values are refused naming the field."""
from __future__ import annotations

import json

import pytest

from engine.errors import ConfigError
from engine.models.config import (EXTENDED_ATTENTION_FIELDS, EXTENDED_FIELDS, EXTENDED_LINEAR_FIELDS,
                                  EXTENDED_MOE_FIELDS, LinearConfig, ModelConfig, MoEConfig)
from engine.models.presets import list_presets


@pytest.mark.parametrize("cfg", list_presets(), ids=lambda c: c.name)
def test_presets_canonical_json_has_no_new_fields(cfg):
    d = json.loads(cfg.to_json())
    assert not set(EXTENDED_FIELDS) & set(d)
    assert not set(EXTENDED_ATTENTION_FIELDS) & set(d["attention"])
    assert not set(EXTENDED_LINEAR_FIELDS) & set(d["linear"])


def test_set_fields_round_trip_through_json():
    cfg = ModelConfig(layers=("mamba2", "full", "gdn"), mlp_layers=("moe", "none", "dense"),
                      moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=16, shared_intermediate_size=8,
                                    shared_expert_gate=True, norm_topk_prob=False),
                      hidden_act="relu2", gated_mlp=False, post_norms=True, embed_scale=8.0, final_logit_softcap=30.0,
                      linear=LinearConfig(mamba_norm="group", mamba_dt_min=1e-3))
    back = ModelConfig.from_json(cfg.to_json())
    assert back == cfg and back.to_json() == cfg.to_json()


def test_moe_configs_written_before_the_ring_router_fields_keep_their_canonical_json():
    moe = MoEConfig(num_experts=4, top_k=2, intermediate_size=16, shared_intermediate_size=8, shared_expert_gate=True)
    cfg = ModelConfig(mlp_layers=("moe",) * 4, moe=moe)
    d = json.loads(cfg.to_json())
    assert set(d["moe"]) == {"num_experts", "top_k", "intermediate_size", "shared_intermediate_size",
                             "shared_expert_gate", "norm_topk_prob"}
    assert not set(EXTENDED_MOE_FIELDS) & set(d["moe"])


def test_ring_linear_fields_round_trip_through_json():
    cfg = ModelConfig(layers=("lightning", "full"), mlp_layers=("dense", "moe"),
                      moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=16, scoring="sigmoid", expert_bias=True,
                                    num_groups=4, topk_groups=2, routed_scaling_factor=2.5),
                      linear=LinearConfig(num_heads=4, num_v_heads=4, qkv_silu=False, qk_norm=True, rotary_dim=16,
                                          rope_theta=6e5, norm_groups=2, decay_layer_offset=-1))
    back = ModelConfig.from_json(cfg.to_json())
    assert back == cfg and back.to_json() == cfg.to_json()
    assert cfg.config_hash() != cfg.replace(linear=LinearConfig(num_heads=4, num_v_heads=4)).config_hash()


@pytest.mark.parametrize("kw, named", [
    (dict(layers=("lightning",), linear=LinearConfig(rotary_dim=7)), "rotary_dim"),
    (dict(layers=("lightning",), linear=LinearConfig(norm_groups=5)), "norm_groups"),
    (dict(mlp_layers=("moe",) * 4, moe=MoEConfig(num_experts=4, intermediate_size=8, scoring="tanh")), "scoring"),
    (dict(mlp_layers=("moe",) * 4, moe=MoEConfig(num_experts=6, intermediate_size=8, num_groups=4)), "num_groups"),
    (dict(mlp_layers=("moe",) * 4, moe=MoEConfig(num_experts=8, intermediate_size=8, num_groups=4, topk_groups=5)),
     "topk_groups"),
    (dict(mlp_layers=("dense",)), "mlp_layers"),
    (dict(mlp_layers=("dense", "sparse", "dense", "dense")), "mlp_layers"),
    (dict(mlp_layers=("moe",) * 4), "num_experts"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(embed_scale=0.0), "embed_scale"),
    (dict(linear=LinearConfig(mamba_norm="layer")), "mamba_norm"),
])
def test_bad_new_fields_are_refused_naming_them(kw, named):
    with pytest.raises(ConfigError, match=named):
        ModelConfig(**kw)
