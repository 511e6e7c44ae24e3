"""Nemotron-H (`nemotron_h`: Mamba2 + attention + MLP) onto the engine.

Mapping (transformers' modeling_nemotron_h.py): every HF layer is ONE of a Mamba2 mixer
(`linear_attention`), attention (`full_attention`) or an MLP (`mlp`), each behind its own
RMSNorm with a residual. Our block is a mixer then an MLP (each pre-normed, each with a
residual), so a mixer layer and the MLP layer right after it become one block (the same
function), and a mixer layer followed by another mixer layer becomes a block without MLP
(`mlp_layers` entry `none`). An MLP layer that follows no mixer layer, and MoE layers
(Nemotron-3), are refused.
- Mamba2: in_proj -> [z | x, B, C | dt], short conv with bias and SiLU, `dt =
  max(softplus(dt + dt_bias), time_step_min)`, decay `-exp(A_log) dt`, skip `D x`, output
  norm `rmsnorm_group(y * silu(z)) * w` over the `n_groups` groups (`mamba_norm="group"`).
- Attention: GQA without RoPE, q/k norms or gate. MLP: `down(relu(up(x))^2)`.
"""
from __future__ import annotations

import torch

from engine.errors import UnsupportedConfigError
from engine.models.config import DENSE, FULL, MAMBA2, NO_MLP, AttentionConfig, LinearConfig, ModelConfig
from engine.models.hf.checkpoint import CheckpointTensors
from engine.models.hf.common import Conversion
from engine.models.hf.fields import ConfigFields

MODEL_TYPES = ("nemotron_h",)
MIXERS = {"linear_attention": MAMBA2, "full_attention": FULL}
LEGACY = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
#: fields that only concern MoE layers, multi-token prediction or training
IGNORED = ("n_routed_experts", "n_shared_experts", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
           "moe_latent_size", "moe_shared_expert_overlap", "num_experts_per_tok", "routed_scaling_factor", "n_group",
           "topk_group", "norm_topk_prob", "mtp_layers_block_type", "num_logits_to_keep", "time_step_max",
           "time_step_floor", "time_step_limit", "chunk_size", "use_mamba_kernels", "rescale_prenorm_residual",
           "hidden_dropout", "expand", "num_hidden_layers", "num_nextn_predict_layers")


def block_plan(types: list[str], where: str) -> list[tuple[int, str, int | None]]:
    """HF layer types -> our blocks: (mixer layer index, our kind, MLP layer index or None)."""
    blocks: list[tuple[int, str, int | None]] = []
    for i, t in enumerate(types):
        if t in MIXERS:
            blocks.append((i, MIXERS[t], None))
        elif t == "mlp":
            if not blocks or blocks[-1][2] is not None:
                raise UnsupportedConfigError(
                    f"{where}: layers_block_type[{i}]='mlp' follows no mixer layer (not supported)")
            blocks[-1] = (blocks[-1][0], blocks[-1][1], i)
        else:
            raise UnsupportedConfigError(f"{where}: layers_block_type[{i}]={t!r} is not supported")
    return blocks


def _layer_types(f: ConfigFields) -> list[str]:
    if f.has("layers_block_type"):
        f.ignore(("hybrid_override_pattern",))
        return list(f.get("layers_block_type"))
    pattern = f.get("hybrid_override_pattern")
    try:
        return [LEGACY[c] for c in pattern]
    except KeyError as e:
        raise UnsupportedConfigError(f"{f.where}: hybrid_override_pattern has unknown symbol {e}") from None


def model_config(f: ConfigFields, name: str) -> tuple[ModelConfig, list[tuple[int, str, int | None]]]:
    for key, value in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2"), ("use_conv_bias", True),
                       ("use_bias", False), ("mamba_proj_bias", False), ("mlp_bias", False), ("attention_bias", False),
                       ("residual_in_fp32", False), ("mamba_ssm_cache_dtype", "float32")):
        f.expect(key, value)
    if f.get("sliding_window", None) is not None:
        raise UnsupportedConfigError(f"{f.where}: sliding_window={f.data['sliding_window']!r} is not supported")
    f.ignore(IGNORED)
    blocks = block_plan(_layer_types(f), f.where)
    hidden = int(f.get("hidden_size"))
    heads = int(f.get("num_attention_heads"))
    kinds = tuple(k for _, k, _ in blocks)
    attention = AttentionConfig(num_heads=heads, num_kv_heads=int(f.get("num_key_value_heads")),
                                head_dim=int(f.get("head_dim", hidden // heads)), rotary_dim=0)
    linear = LinearConfig(
        num_heads=int(f.get("n_groups")), num_v_heads=int(f.get("mamba_num_heads")),
        key_dim=int(f.get("ssm_state_size")), value_dim=int(f.get("mamba_head_dim")),
        conv_size=int(f.get("conv_kernel")), mamba_norm="group", mamba_dt_min=float(f.get("time_step_min", 0.0)))
    cfg = ModelConfig(
        name=name, family="nemotron_h", scale="custom", vocab_size=int(f.get("vocab_size")), hidden_size=hidden,
        intermediate_size=int(f.get("intermediate_size")), layers=kinds,
        tie_embeddings=bool(f.get("tie_word_embeddings", False)),
        rms_norm_eps=float(f.get("layer_norm_epsilon", 1e-5)),
        max_position_embeddings=int(f.get("max_position_embeddings")), attention=attention, linear=linear,
        mlp_layers=tuple(DENSE if m is not None else NO_MLP for _, _, m in blocks),
        hidden_act="relu2", gated_mlp=False)
    f.finish()
    return cfg, blocks


def convert(f: ConfigFields, t: CheckpointTensors, model_type: str, name: str, prefix: str) -> Conversion:
    cfg, blocks = model_config(f, name)
    state: dict[str, torch.Tensor] = {
        "embed.weight": t.take(f"{prefix}embeddings.weight"),
        "norm.weight": t.take(f"{prefix}norm_f.weight"),
    }
    if not cfg.tie_embeddings:
        state["lm_head.weight"] = t.take("lm_head.weight")
    elif "lm_head.weight" in t:
        t.take("lm_head.weight")
    for b, (i, kind, mlp) in enumerate(blocks):
        src, dst = f"{prefix}layers.{i}", f"blocks.{b}"
        state[f"{dst}.mixer_norm.weight"] = t.take(f"{src}.norm.weight")
        m = f"{src}.mixer"
        if kind == FULL:
            for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
                state[f"{dst}.mixer.{p}.weight"] = t.take(f"{m}.{p}.weight")
        else:
            state[f"{dst}.mixer.in_proj.weight"] = t.take(f"{m}.in_proj.weight")
            state[f"{dst}.mixer.conv.weight"] = t.take(f"{m}.conv1d.weight")[:, 0, :]
            state[f"{dst}.mixer.conv.bias"] = t.take(f"{m}.conv1d.bias")
            for p in ("A_log", "dt_bias", "D"):
                state[f"{dst}.mixer.{p}"] = t.take(f"{m}.{p}")
            state[f"{dst}.mixer.norm.weight"] = t.take(f"{m}.norm.weight")
            state[f"{dst}.mixer.out_proj.weight"] = t.take(f"{m}.out_proj.weight")
        if mlp is not None:
            s = f"{prefix}layers.{mlp}"
            state[f"{dst}.mlp_norm.weight"] = t.take(f"{s}.norm.weight")
            state[f"{dst}.mlp.up.weight"] = t.take(f"{s}.mixer.up_proj.weight")
            state[f"{dst}.mlp.down.weight"] = t.take(f"{s}.mixer.down_proj.weight")
    notes = []
    names = t.skip("mtp.")
    if names:
        notes.append(f"skipped the multi-token-prediction layers ({len(names)} tensors under mtp.)")
    return Conversion(cfg, state, notes)
