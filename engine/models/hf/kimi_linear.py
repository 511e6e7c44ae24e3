"""Kimi-Linear (`kimi_linear`, transformers' modeling_kimi_linear.py) onto the engine.

Mapping:
- `linear_attention` layers -> `kda` (Kimi Delta Attention, engine/models/layers/kda.py):
  separate q/k/v projections, one short conv per projection in the checkpoint (`q_conv1d`,
  `k_conv1d`, `v_conv1d`, concatenated into our conv over [q | k | v]), the low-rank forget
  gate (`f_a_proj`, `f_b_proj`, `dt_bias` per channel, `A_log` per head), `b_proj`, the
  low-rank output gate (`g_a_proj`, `g_b_proj`) and the sigmoid-gated `o_norm`.
- `full_attention` layers -> `full` with multi-head latent attention (engine/models/layers/
  mla.py): `q_proj` or `q_a_proj`/`q_a_layernorm`/`q_b_proj` (`q_lora_rank`),
  `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, no RoPE (the reference applies none);
  the expanded per-head K/V are what the caches hold.
- MLP: `mlp_layer_types` (or `first_k_dense_replace`) `dense` -> SwiGLU, `sparse` -> MoE
  with sigmoid scores, `e_score_correction_bias` for the choice only, group-limited top-k
  (`num_expert_group` groups, `topk_group` kept), renormalised (`moe_renormalize`) and
  scaled by `routed_scaling_factor`, plus `num_shared_experts` ungated shared experts.
  Experts in the hub layout (`experts.<e>.w1/w3/w2` = gate/up/down) or fused.
- The hub config's `linear_attn_config` (head_dim, num_heads, short_conv_kernel_size,
  1-indexed kda_layers / full_attn_layers) is read as transformers reads it; any other key
  there, and any config field not mapped here, is refused by name. The hub config's
  descriptive fields are accepted at the values the reference implements (`HUB_FIELDS`):
  `mla_use_nope` true (then `rope_theta` has no effect; a `rope_scaling` is refused),
  sigmoid routing, grouped top-k, every layer after the dense ones MoE, no MTP layers.
"""
from __future__ import annotations

import torch

from engine.errors import UnsupportedConfigError
from engine.models.config import DENSE, FULL, KDA, MOE, AttentionConfig, LinearConfig, ModelConfig, MoEConfig
from engine.models.hf.checkpoint import CheckpointTensors
from engine.models.hf.common import Conversion, dense_mlp, layer_kinds, moe_experts, take_ends
from engine.models.hf.fields import ConfigFields

MODEL_TYPES = ("kimi_linear",)
LAYER_KIND = {"linear_attention": KDA, "full_attention": FULL}
MLP_KIND = {"dense": DENSE, "sparse": MOE}
#: alternative spellings of one field (transformers' attribute_map writes the second ones)
ALIASES = {
    "max_position_embeddings": ("max_position_embeddings", "model_max_length"),
    "norm_topk_prob": ("norm_topk_prob", "moe_renormalize"),
    "n_group": ("n_group", "num_expert_group"),
    "num_experts": ("num_local_experts", "num_experts"),
    "top_k": ("num_experts_per_tok", "num_experts_per_token"),
    "n_shared_experts": ("n_shared_experts", "num_shared_experts"),
}


#: descriptive fields of the published config.json, each with the one value the reference
#: implements (transformers' KimiLinearConfig does not read them)
HUB_FIELDS = {"mla_use_nope": True, "moe_router_activation_func": "sigmoid", "use_grouped_topk": True,
              "moe_layer_freq": 1, "num_nextn_predict_layers": 0, "topk_method": "noaux_tc"}


def aliased(f: ConfigFields, name: str, default=None):
    """The first present spelling of `name` (ALIASES), every spelling marked as read."""
    names = ALIASES[name]
    f.ignore(names)
    for n in names:
        if f.has(n):
            return f.data[n]
    if default is None:
        raise UnsupportedConfigError(f"{f.where}: required field {names[0]!r} is missing")
    return default


def mla_attention(f: ConfigFields, rotary: bool = False, head_gate: bool = False,
                  rope_theta: float = 10000.0) -> AttentionConfig:
    """The MLA fields of a Kimi-Linear / Ling 3 / DeepSeek-style config -> AttentionConfig
    (expanded K/V: one KV head per query head; `rotary`: RoPE on the `qk_rope_head_dim`
    shared part, theta set by the caller)."""
    heads = int(f.get("num_attention_heads"))
    kv_heads = int(f.get("num_key_value_heads", heads))
    if kv_heads != heads:
        raise UnsupportedConfigError(f"{f.where}: num_key_value_heads={kv_heads} != num_attention_heads={heads} is "
                                     f"not supported (MLA expands K/V to every head)")
    nope, rope, v_dim = int(f.get("qk_nope_head_dim")), int(f.get("qk_rope_head_dim")), int(f.get("v_head_dim"))
    if f.has("qk_head_dim") and int(f.get("qk_head_dim")) != nope + rope:
        raise UnsupportedConfigError(f"{f.where}: qk_head_dim={f.data['qk_head_dim']} != qk_nope_head_dim + "
                                     f"qk_rope_head_dim = {nope + rope}")
    q_lora = f.get("q_lora_rank", 0) or 0
    return AttentionConfig(
        num_heads=heads, num_kv_heads=heads, head_dim=max(nope + rope, v_dim), rotary_dim=rope if rotary else 0,
        rope_theta=rope_theta,
        query_scale=float(nope + rope), mla_kv_lora_rank=int(f.get("kv_lora_rank")), mla_q_lora_rank=int(q_lora),
        mla_nope_dim=nope, mla_rope_dim=rope, mla_v_dim=v_dim, mla_head_gate=head_gate)


def mlp_kinds(f: ConfigFields, n_layers: int, first_dense_default: int) -> tuple[str, ...]:
    """`mlp_layer_types` (dense / sparse), or dense for the first `first_k_dense_replace`."""
    if f.has("mlp_layer_types"):
        f.ignore(("first_k_dense_replace",))
        mlp_types = f.get("mlp_layer_types")
        if len(mlp_types) != n_layers:
            raise UnsupportedConfigError(f"{f.where}: mlp_layer_types has {len(mlp_types)} entries, "
                                         f"num_hidden_layers={n_layers}")
    else:
        first_dense = int(f.get("first_k_dense_replace", first_dense_default))
        mlp_types = ["dense" if i < first_dense else "sparse" for i in range(n_layers)]
    for i, t in enumerate(mlp_types):
        if t not in MLP_KIND:
            raise UnsupportedConfigError(f"{f.where}: mlp_layer_types[{i}]={t!r} is not supported")
    return tuple(MLP_KIND[t] for t in mlp_types)


def grouped_sigmoid_moe(f: ConfigFields, mlp_layers: tuple[str, ...]) -> MoEConfig:
    """DeepSeek-V3-style router fields -> MoEConfig: sigmoid scores, a choice-only bias,
    group-limited top-k, renormalised, scaled; ungated shared experts."""
    inter = int(f.get("moe_intermediate_size", 0))
    num_experts = int(aliased(f, "num_experts", 0))
    groups = int(aliased(f, "n_group", 1))
    f.ignore(("topk_group", "routed_scaling_factor"))
    if MOE not in mlp_layers:
        f.ignore(ALIASES["top_k"] + ALIASES["n_shared_experts"] + ALIASES["norm_topk_prob"])
        return MoEConfig()
    shared = int(aliased(f, "n_shared_experts", 0))
    return MoEConfig(num_experts=num_experts, top_k=int(aliased(f, "top_k")), intermediate_size=inter,
                     shared_intermediate_size=inter * shared, norm_topk_prob=bool(aliased(f, "norm_topk_prob", True)),
                     scoring="sigmoid", expert_bias=True, num_groups=groups,
                     topk_groups=int(f.get("topk_group", 1)) if groups > 1 else 1,
                     routed_scaling_factor=float(f.get("routed_scaling_factor", 1.0)))


def _linear_attn_config(f: ConfigFields, n_layers: int) -> tuple[dict, list | None]:
    """The hub config's `linear_attn_config` dict -> (shape fields, layer_types or None)."""
    raw = f.get("linear_attn_config", {}) or {}
    sub = ConfigFields(raw, f"{f.where}: linear_attn_config")
    shapes = {k: sub.get(k) for k in ("head_dim", "num_heads", "short_conv_kernel_size") if sub.has(k)}
    types = None
    if sub.has("full_attn_layers") and sub.has("kda_layers"):
        types = [None] * n_layers
        for i in sub.get("full_attn_layers"):
            types[int(i) - 1] = "full_attention"
        for i in sub.get("kda_layers"):
            types[int(i) - 1] = "linear_attention"
    sub.finish()
    return shapes, types


def model_config(f: ConfigFields, name: str) -> ModelConfig:
    f.expect("hidden_act", "silu")
    f.expect("attention_bias", False)
    f.expect("pretraining_tp", 1)
    for key, value in HUB_FIELDS.items():
        f.expect(key, value)
    f.ignore(("rope_theta",))  # NoPE: the reference applies no rotary embedding
    f.expect("rope_scaling", None)
    n_layers = int(f.get("num_hidden_layers"))
    lin_cfg, lin_types = _linear_attn_config(f, n_layers)
    if f.has("layer_types"):
        types = f.get("layer_types")
    elif lin_types is not None:
        types = lin_types
    else:  # transformers' default
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n_layers)]
    layers = layer_kinds(f, types, n_layers, LAYER_KIND)
    hidden = int(f.get("hidden_size"))
    f.expect("head_dim", int(f.get("qk_rope_head_dim")))  # transformers writes head_dim = qk_rope_head_dim
    attention = mla_attention(f)
    head_dim = int(lin_cfg.get("head_dim", f.get("linear_head_dim", 128)))
    lin_heads = int(lin_cfg.get("num_heads", f.get("linear_num_heads", 32)))
    conv = int(lin_cfg.get("short_conv_kernel_size", f.get("linear_conv_kernel_dim", 4)))
    linear = LinearConfig(num_heads=lin_heads, num_v_heads=lin_heads, key_dim=head_dim, value_dim=head_dim,
                          conv_size=conv, conv_kinds=(KDA,))
    mlp_layers = mlp_kinds(f, n_layers, first_dense_default=1)
    moe = grouped_sigmoid_moe(f, mlp_layers)
    cfg = ModelConfig(
        name=name, family="kimi_linear", scale="custom", vocab_size=int(f.get("vocab_size")), hidden_size=hidden,
        intermediate_size=int(f.get("intermediate_size")), layers=tuple(layers),
        tie_embeddings=bool(f.get("tie_word_embeddings", False)), rms_norm_eps=float(f.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(aliased(f, "max_position_embeddings")), attention=attention, linear=linear,
        mlp_layers=mlp_layers, moe=moe)
    f.finish()
    return cfg


def kda_weights(t: CheckpointTensors, att: str, mix: str, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    """One kda layer's tensors under `att` (Kimi-Linear's names; Ling 3's full-rank gates
    `f_proj`/`g_proj`, its output projection `dense`)."""
    gates = ("f_proj", "g_proj") if cfg.linear.kda_full_rank_gates else ("f_a_proj", "f_b_proj", "g_a_proj",
                                                                         "g_b_proj")
    for p in ("q_proj", "k_proj", "v_proj", "b_proj") + gates:
        state[f"{mix}.{p}.weight"] = t.take(f"{att}.{p}.weight")
    if f"{att}.conv1d.weight" in t:  # transformers' packed in-memory layout
        state[f"{mix}.conv.weight"] = t.take(f"{att}.conv1d.weight")[:, 0, :]
    else:
        state[f"{mix}.conv.weight"] = torch.cat([t.take(f"{att}.{p}_conv1d.weight")[:, 0, :] for p in "qkv"])
    state[f"{mix}.A_log"] = t.take(f"{att}.A_log").reshape(-1)
    state[f"{mix}.dt_bias"] = t.take(f"{att}.dt_bias").reshape(-1)
    state[f"{mix}.norm.weight"] = t.take(f"{att}.o_norm.weight")
    state[f"{mix}.out_proj.weight"] = t.take(f"{att}.{'o_proj' if f'{att}.o_proj.weight' in t else 'dense'}.weight")


def mla_weights(t: CheckpointTensors, att: str, mix: str, cfg: ModelConfig, state: dict[str, torch.Tensor],
                o_proj: str = "o_proj") -> None:
    """One MLA layer's tensors under `att`. With RoPE (`rotary_dim`), the rows that make
    the rotated parts (each head's last `mla_rope_dim` query rows, the shared key rows) are
    reordered from DeepSeek's interleaved pairs to [even | odd], the order rotate-half
    rotates (the same rotation, so the same dot products); `mla_head_gate` takes `g_proj`."""
    a = cfg.attention
    qk = a.mla_nope_dim + a.mla_rope_dim
    perm = None
    if a.rotary_dim:
        perm = torch.cat([torch.arange(0, a.mla_rope_dim, 2), torch.arange(1, a.mla_rope_dim, 2)])

    def q_rows(w: torch.Tensor) -> torch.Tensor:
        if perm is None:
            return w
        w = w.reshape(a.num_heads, qk, -1)
        w = torch.cat([w[:, :a.mla_nope_dim], w[:, a.mla_nope_dim:][:, perm]], dim=1)
        return w.reshape(a.num_heads * qk, -1)

    if a.mla_q_lora_rank:
        state[f"{mix}.q_a_proj.weight"] = t.take(f"{att}.q_a_proj.weight")
        state[f"{mix}.q_a_norm.weight"] = t.take(f"{att}.q_a_layernorm.weight")
        state[f"{mix}.q_b_proj.weight"] = q_rows(t.take(f"{att}.q_b_proj.weight"))
    else:
        state[f"{mix}.q_proj.weight"] = q_rows(t.take(f"{att}.q_proj.weight"))
    kv_a = t.take(f"{att}.kv_a_proj_with_mqa.weight")
    if perm is not None:
        kv_a = torch.cat([kv_a[:a.mla_kv_lora_rank], kv_a[a.mla_kv_lora_rank:][perm]])
    state[f"{mix}.kv_a_proj.weight"] = kv_a
    state[f"{mix}.kv_a_norm.weight"] = t.take(f"{att}.kv_a_layernorm.weight")
    state[f"{mix}.kv_b_proj.weight"] = t.take(f"{att}.kv_b_proj.weight")
    state[f"{mix}.o_proj.weight"] = t.take(f"{att}.{o_proj}.weight")
    if a.mla_head_gate:
        state[f"{mix}.g_proj.weight"] = t.take(f"{att}.g_proj.weight")


def convert(f: ConfigFields, t: CheckpointTensors, model_type: str, name: str, prefix: str) -> Conversion:
    cfg = model_config(f, name)
    state: dict[str, torch.Tensor] = {}
    take_ends(t, state, cfg.tie_embeddings, f"{prefix}embed_tokens.weight", f"{prefix}norm.weight")
    for i, kind in enumerate(cfg.layers):
        src, dst = f"{prefix}layers.{i}", f"blocks.{i}"
        att, mix = f"{src}.self_attn", f"{dst}.mixer"
        state[f"{dst}.mixer_norm.weight"] = t.take(f"{src}.input_layernorm.weight")
        state[f"{dst}.mlp_norm.weight"] = t.take(f"{src}.post_attention_layernorm.weight")
        if kind == FULL:
            mla_weights(t, att, mix, cfg, state)
        else:
            kda_weights(t, att, mix, cfg, state)
        # the hub layout names every layer's MLP `block_sparse_moe`; transformers' own, `mlp`
        m = f"{src}.block_sparse_moe" if f"{src}.block_sparse_moe.gate.weight" in t or \
            f"{src}.block_sparse_moe.gate_proj.weight" in t else f"{src}.mlp"
        o = f"{dst}.mlp"
        if cfg.mlp_kind(i) == MOE:
            state[f"{o}.router.weight"] = t.take(f"{m}.gate.weight")
            state[f"{o}.router_bias"] = t.take(f"{m}.gate.e_score_correction_bias")
            moe_experts(t, m, o, cfg.moe.num_experts, state, names=("w1", "w3", "w2"))
            if cfg.moe.shared_intermediate_size:
                dense_mlp(t, f"{m}.shared_experts", f"{o}.shared", state)
        else:
            dense_mlp(t, m, o, state)
    return Conversion(cfg, state, [])
