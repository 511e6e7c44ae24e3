"""Ring-linear-2.0 (Ring-mini-linear-2.0 / Ring-flash-linear-2.0: `BailingMoeLinearV2`,
model_type `bailing_moe_linear`, published as remote code) onto the engine.

Mapping (the published modelling code as the SGLang and mlx-lm ports carry it; every
detail below is in both unless said otherwise):
- layer i is softmax attention when `(i + 1) % layer_group_size == 0`, else linear
  attention; `num_hidden_layers` must be a multiple of `layer_group_size` (SGLang asserts
  it, mlx-lm then makes the trailing layers attention: refused rather than guessed).
- linear layers -> `lightning` (scalar decay): fused `query_key_value` [q | k | v] (MHA,
  `num_attention_heads` heads of `head_dim`), SiLU on it when `linear_silu`, q/k RMSNorm
  per head (`use_qk_norm`), RoPE (rotate-half, `rotary_dim` or `head_dim *
  partial_rotary_factor`, `rope_theta`) on q and k at the absolute positions, scale
  `head_dim ** -0.5`, decay `-alibi_slope_h * (1 - (i - 1) / (L - 1) + 1e-5)` with i the
  layer's index among all layers (`decay_layer_offset=-1`), output
  `g_norm(o) * sigmoid(g_proj(x))` with `g_norm` an RMSNorm over `group_norm_size` groups
  of all channels, then `dense`.
- attention layers -> `full`: fused `query_key_value` (GQA), q/k RMSNorm, the same partial
  RoPE, scale `head_dim ** -0.5`, no output gate, `dense`.
- MLP: dense SwiGLU for the first `first_k_dense_replace` layers, then MoE: sigmoid
  scores (float32 router), `expert_bias` for the choice only, group-limited top-k
  (`n_group`, `topk_group`, two best per group), renormalised (`norm_topk_prob`), times
  `routed_scaling_factor`; `num_shared_experts` ungated shared experts of width
  `moe_intermediate_size * num_shared_experts`.
- `word_embeddings`, final `norm`, `lm_head` (or tied). Multi-token-prediction weights
  (`model.mtp.*`) are skipped with a log line.
"""
from __future__ import annotations

import torch

from engine.errors import UnsupportedConfigError
from engine.models.config import DENSE, FULL, LIGHTNING, MOE, AttentionConfig, LinearConfig, ModelConfig, MoEConfig
from engine.models.hf.checkpoint import CheckpointTensors
from engine.models.hf.common import Conversion, dense_mlp, moe_experts, take_ends
from engine.models.hf.fields import ConfigFields

MODEL_TYPES = ("bailing_moe_linear",)

#: training-only fields of the published config (dropouts, load-balancing, the MTP loss)
TRAINING_FIELDS = ("embedding_dropout", "output_dropout", "moe_router_bias_update_rate", "mtp_loss_scaling_factor",
                   "router_dtype", "moe_router_dtype", "linear_backend")


def _rotary_dim(f: ConfigFields, head_dim: int) -> int:
    if f.has("rotary_dim"):
        f.ignore(("partial_rotary_factor",))
        rot = int(f.get("rotary_dim"))
    else:
        rot = int(head_dim * float(f.get("partial_rotary_factor", 1.0)))
    if rot % 2 or not 0 < rot <= head_dim:
        raise UnsupportedConfigError(f"{f.where}: rotary dim {rot} must be even and within (0, head_dim={head_dim}]")
    return rot


def model_config(f: ConfigFields, name: str) -> ModelConfig:
    f.expect("hidden_act", "silu")
    for key in ("use_bias", "use_qkv_bias", "norm_head", "norm_softmax", "using_split_qkv_in_self_attention"):
        f.expect(key, False)
    f.expect("use_rmsnorm", True)
    f.expect("linear_rope", True)
    f.expect("moe_router_enable_routed_scaling", True)
    f.expect("rope_traditional", False)
    if f.get("rope_scaling", None):
        raise UnsupportedConfigError(f"{f.where}: rope_scaling={f.data['rope_scaling']!r} is not supported")
    f.ignore(TRAINING_FIELDS + ("num_nextn_predict_layers",))
    n_layers = int(f.get("num_hidden_layers"))
    group = int(f.get("layer_group_size", 1))
    if group < 1 or n_layers % group:
        raise UnsupportedConfigError(f"{f.where}: num_hidden_layers={n_layers} is not a multiple of "
                                     f"layer_group_size={group}")
    layers = tuple(FULL if (i + 1) % group == 0 else LIGHTNING for i in range(n_layers))
    hidden = int(f.get("hidden_size"))
    heads = int(f.get("num_attention_heads"))
    head_dim = int(f.get("head_dim", hidden // heads))
    if head_dim * heads != hidden:
        raise UnsupportedConfigError(f"{f.where}: head_dim={head_dim} with num_attention_heads={heads} does not "
                                     f"span hidden_size={hidden} (the ports disagree on that case)")
    rot = _rotary_dim(f, head_dim)
    theta = float(f.get("rope_theta"))
    qk_norm = bool(f.get("use_qk_norm", False))
    attention = AttentionConfig(num_heads=heads, num_kv_heads=int(f.get("num_key_value_heads")), head_dim=head_dim,
                                rotary_dim=rot, rope_theta=theta, qk_norm=qk_norm)
    silu = f.get("linear_silu", None)
    if silu is None:
        silu = f.get("use_linear_silu", False)
    f.ignore(("linear_silu", "use_linear_silu"))
    linear = LinearConfig(num_heads=heads, num_v_heads=heads, key_dim=head_dim, value_dim=head_dim, conv_size=0,
                          conv_kinds=(), qkv_silu=bool(silu), qk_norm=qk_norm, rotary_dim=rot, rope_theta=theta,
                          norm_groups=int(f.get("group_norm_size", 1)), decay_layer_offset=-1)
    mlp_layers: tuple[str, ...] = ()
    moe = MoEConfig()
    num_experts = int(f.get("num_experts", 0) or 0)
    if num_experts > 1:
        first_dense = int(f.get("first_k_dense_replace", 0))
        mlp_layers = tuple(DENSE if i < first_dense else MOE for i in range(n_layers))
        scoring = f.expect("score_function", "softmax", "sigmoid")
        bias = bool(f.get("moe_router_enable_expert_bias", False))
        if bias != (scoring == "sigmoid"):
            raise UnsupportedConfigError(f"{f.where}: score_function={scoring!r} with moe_router_enable_expert_bias="
                                         f"{bias} is not supported (the ports pair sigmoid with a bias)")
        inter = int(f.get("moe_intermediate_size"))
        shared = int(f.get("num_shared_experts", 0) or 0)
        if not f.expect("moe_router_enable_shared_expert", True, False):
            shared = 0
        f.expect("moe_shared_expert_intermediate_size", None, inter)
        groups, topk_groups = int(f.get("n_group", 1) or 1), int(f.get("topk_group", 1) or 1)
        moe = MoEConfig(num_experts=num_experts, top_k=int(f.get("num_experts_per_tok")), intermediate_size=inter,
                        shared_intermediate_size=inter * shared, norm_topk_prob=bool(f.get("norm_topk_prob", True)),
                        scoring=scoring, expert_bias=bias, num_groups=groups,
                        topk_groups=topk_groups if groups > 1 else 1,
                        routed_scaling_factor=float(f.get("routed_scaling_factor", 1.0)))
    else:
        f.ignore(("first_k_dense_replace", "num_experts_per_tok", "moe_intermediate_size", "num_shared_experts",
                  "n_group", "topk_group", "routed_scaling_factor", "score_function", "norm_topk_prob",
                  "moe_router_enable_expert_bias", "moe_router_enable_shared_expert",
                  "moe_shared_expert_intermediate_size"))
    cfg = ModelConfig(
        name=name, family="bailing_moe_linear", scale="custom", vocab_size=int(f.get("vocab_size")),
        hidden_size=hidden, intermediate_size=int(f.get("intermediate_size")), layers=layers,
        tie_embeddings=bool(f.get("tie_word_embeddings", False)), rms_norm_eps=float(f.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(f.get("max_position_embeddings")), attention=attention, linear=linear,
        mlp_layers=mlp_layers, moe=moe)
    f.finish()
    return cfg


def convert(f: ConfigFields, t: CheckpointTensors, model_type: str, name: str, prefix: str) -> Conversion:
    cfg = model_config(f, name)
    a = cfg.attention
    q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    state: dict[str, torch.Tensor] = {}
    take_ends(t, state, cfg.tie_embeddings, f"{prefix}word_embeddings.weight", f"{prefix}norm.weight")
    for i, kind in enumerate(cfg.layers):
        src, dst = f"{prefix}layers.{i}", f"blocks.{i}"
        att, mix = f"{src}.attention", f"{dst}.mixer"
        state[f"{dst}.mixer_norm.weight"] = t.take(f"{src}.input_layernorm.weight")
        state[f"{dst}.mlp_norm.weight"] = t.take(f"{src}.post_attention_layernorm.weight")
        qkv = t.take(f"{att}.query_key_value.weight")
        if kind == FULL:
            q, k, v = qkv.split([q_size, kv_size, kv_size])
            state[f"{mix}.q_proj.weight"], state[f"{mix}.k_proj.weight"], state[f"{mix}.v_proj.weight"] = q, k, v
            state[f"{mix}.o_proj.weight"] = t.take(f"{att}.dense.weight")
        else:
            state[f"{mix}.qkv_proj.weight"] = qkv
            state[f"{mix}.g_proj.weight"] = t.take(f"{att}.g_proj.weight")
            state[f"{mix}.norm.weight"] = t.take(f"{att}.g_norm.weight")
            state[f"{mix}.o_proj.weight"] = t.take(f"{att}.dense.weight")
        if a.qk_norm:
            state[f"{mix}.q_norm.weight"] = t.take(f"{att}.query_layernorm.weight")
            state[f"{mix}.k_norm.weight"] = t.take(f"{att}.key_layernorm.weight")
        if cfg.mlp_kind(i) == MOE:
            m, o = f"{src}.mlp", f"{dst}.mlp"
            state[f"{o}.router.weight"] = t.take(f"{m}.gate.weight")
            if cfg.moe.expert_bias:
                state[f"{o}.router_bias"] = t.take(f"{m}.gate.expert_bias")
            moe_experts(t, m, o, cfg.moe.num_experts, state)
            if cfg.moe.shared_intermediate_size:
                dense_mlp(t, f"{m}.shared_experts", f"{o}.shared", state)
        else:
            dense_mlp(t, f"{src}.mlp", f"{dst}.mlp", state)
    notes = []
    names = t.skip(f"{prefix}mtp.")
    if names:
        notes.append(f"skipped the multi-token-prediction layers ({len(names)} tensors under {prefix}mtp.)")
    return Conversion(cfg, state, notes)
