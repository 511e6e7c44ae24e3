"""Ling 3.0 (`bailing_hybrid`, transformers' modeling_bailing_hybrid.py) onto the engine:
Kimi Delta Attention and multi-head latent attention, as Kimi-Linear, with these
differences (the helpers are kimi_linear's):

- layer i is MLA when `(i + 1) % layer_group_size == 0` (or `layer_types`), else `kda`;
- kda: full-rank forget and output gates (`f_proj`, `g_proj`), the bounded forget gate
  `kda_lower_bound * sigmoid(exp(A_log) (f + dt_bias))` when `kda_safe_gate` (else Kimi's
  softplus form), output projection `dense`;
- MLA: RoPE (`rope_parameters`, default type only) on the `qk_rope_head_dim` shared key part
  and the queries' rope part, in DeepSeek's interleaved layout (rows permuted at load, see
  kimi_linear.mla_weights), a per-head sigmoid output gate `g_proj`, output projection
  `dense`;
- MLP: dense for the first `first_k_dense_replace` layers, then DeepSeek-V3's MoE (sigmoid
  router with `expert_bias` for the choice, groups, renormalised, scaled; shared experts);
- the multi-token-prediction layers stored after the decoder (`num_nextn_predict_layers`)
  are skipped with a log line.

The linear head size is `linear_head_dim` (written by transformers) or the hub config's
`head_dim`; heads `linear_num_heads` or `num_attention_heads`. The hub config's
descriptive fields are accepted at the values the reference implements (`HUB_FIELDS`:
full-rank KDA gates, interleaved RoPE, head-wise attention gates, sigmoid scores, no q/k
norm or qkv bias; a shared-expert width equal to DeepSeek's), anything else refused by name.
"""
from __future__ import annotations

import torch

from engine.errors import UnsupportedConfigError
from engine.models.config import FULL, KDA, MOE, LinearConfig, ModelConfig
from engine.models.hf.checkpoint import CheckpointTensors
from engine.models.hf.common import Conversion, dense_mlp, layer_kinds, legacy_rope_parameters, moe_experts, \
    rope_settings, take_ends
from engine.models.hf.fields import ConfigFields
from engine.models.hf.kimi_linear import (LAYER_KIND, aliased, grouped_sigmoid_moe, kda_weights, mla_attention,
                                          mla_weights, mlp_kinds)

MODEL_TYPES = ("bailing_hybrid",)
TRAINING_FIELDS = ("mtp_loss_scaling_factor", "num_nextn_predict_layers", "num_mtp_layers")
#: descriptive fields of the published config.json, each with the one value the reference
#: implements (transformers' BailingHybridConfig does not read them)
HUB_FIELDS = {"no_kda_lora": True, "rope_interleave": True, "gated_attention_proj_granularity_type": "head_wise",
              "score_function": "sigmoid", "use_qk_norm": False, "use_qkv_bias": False}


def model_config(f: ConfigFields, name: str) -> ModelConfig:
    f.expect("hidden_act", "silu")
    f.expect("attention_bias", False)
    f.expect("pretraining_tp", 1)
    f.ignore(TRAINING_FIELDS)
    for key, value in HUB_FIELDS.items():
        f.expect(key, value)
    n_layers = int(f.get("num_hidden_layers"))
    if f.has("layer_types"):
        f.ignore(("layer_group_size",))
        types = f.get("layer_types")
    else:
        group = int(f.get("layer_group_size", 6))
        types = ["full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(n_layers)]
    layers = layer_kinds(f, types, n_layers, LAYER_KIND)
    rope_dim = int(f.get("qk_rope_head_dim"))
    rope = rope_settings(legacy_rope_parameters(f), rope_dim, f"{f.where}: rope_parameters")
    if rope.rotary_dim != rope_dim:
        raise UnsupportedConfigError(f"{f.where}: partial_rotary_factor must leave all qk_rope_head_dim={rope_dim} "
                                     f"dims rotated, got {rope.rotary_dim}")
    attention = mla_attention(f, rotary=True, head_gate=True, rope_theta=rope.theta)
    head_dim = int(f.get("linear_head_dim", f.get("head_dim", 128)))
    lin_heads = int(f.get("linear_num_heads", f.get("num_attention_heads")))
    conv = int(f.get("linear_conv_kernel_dim", f.get("short_conv_kernel_size", 4)))
    safe = bool(f.expect("kda_safe_gate", True, False))
    bound = float(f.get("kda_lower_bound", -5.0))
    if safe and bound >= 0:
        raise UnsupportedConfigError(f"{f.where}: kda_lower_bound={bound} must be negative")
    linear = LinearConfig(num_heads=lin_heads, num_v_heads=lin_heads, key_dim=head_dim, value_dim=head_dim,
                          conv_size=conv, conv_kinds=(KDA,), kda_full_rank_gates=True, conv_float32=True,
                          kda_gate_lower_bound=bound if safe else 0.0)
    mlp_layers = mlp_kinds(f, n_layers, first_dense_default=2)
    moe = grouped_sigmoid_moe(f, mlp_layers)
    f.expect("moe_shared_expert_intermediate_size", None, moe.shared_intermediate_size)
    cfg = ModelConfig(
        name=name, family="bailing_hybrid", scale="custom", vocab_size=int(f.get("vocab_size")),
        hidden_size=int(f.get("hidden_size")), intermediate_size=int(f.get("intermediate_size")),
        layers=tuple(layers), tie_embeddings=bool(f.get("tie_word_embeddings", False)),
        rms_norm_eps=float(f.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(aliased(f, "max_position_embeddings")), attention=attention, linear=linear,
        mlp_layers=mlp_layers, moe=moe)
    f.finish()
    return cfg


def convert(f: ConfigFields, t: CheckpointTensors, model_type: str, name: str, prefix: str) -> Conversion:
    cfg = model_config(f, name)
    state: dict[str, torch.Tensor] = {}
    take_ends(t, state, cfg.tie_embeddings, f"{prefix}word_embeddings.weight", f"{prefix}norm.weight")
    for i, kind in enumerate(cfg.layers):
        src, dst = f"{prefix}layers.{i}", f"blocks.{i}"
        att, mix = f"{src}.attention", f"{dst}.mixer"
        state[f"{dst}.mixer_norm.weight"] = t.take(f"{src}.input_layernorm.weight")
        state[f"{dst}.mlp_norm.weight"] = t.take(f"{src}.post_attention_layernorm.weight")
        if kind == FULL:
            mla_weights(t, att, mix, cfg, state, o_proj="dense")
        else:
            kda_weights(t, att, mix, cfg, state)
        m, o = f"{src}.mlp", f"{dst}.mlp"
        if cfg.mlp_kind(i) == MOE:
            state[f"{o}.router.weight"] = t.take(f"{m}.gate.weight")
            state[f"{o}.router_bias"] = t.take(f"{m}.gate.expert_bias")
            moe_experts(t, m, o, cfg.moe.num_experts, state)
            if cfg.moe.shared_intermediate_size:
                dense_mlp(t, f"{m}.shared_experts", f"{o}.shared", state)
        else:
            dense_mlp(t, m, o, state)
    notes = []
    after = sorted({int(n[len(f"{prefix}layers."):].split(".")[0]) for n in t.unused()
                    if n.startswith(f"{prefix}layers.")} - set(range(cfg.num_layers)))
    names = [n for j in after if j >= cfg.num_layers for n in t.skip(f"{prefix}layers.{j}.")]
    if names:
        notes.append(f"skipped the multi-token-prediction layers ({len(names)} tensors under "
                     f"{prefix}layers.{cfg.num_layers}. onwards)")
    return Conversion(cfg, state, notes)
