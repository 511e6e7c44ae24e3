"""Qwen3-Next (`qwen3_next`) and Qwen3.5 (`qwen3_5_text`, `qwen3_5_moe_text`; the
multimodal `qwen3_5` / `qwen3_5_moe` checkpoints map their text model) onto the engine.

Mapping (transformers' modeling_qwen3_next.py / modeling_qwen3_5*.py):
- `linear_attention` layers -> `gdn` (Gated DeltaNet: conv over [q, k, v], L2-normed q/k,
  `g = -exp(A_log) softplus(a + dt_bias)`, `beta = sigmoid(b)`, gated RMSNorm with SiLU);
  `full_attention` -> `full` with the sigmoid output gate, q/k RMSNorm and partial rotary.
- Qwen3-Next packs its GDN input projections per key head (`in_proj_qkvz` holds, for each
  key head, q, k, then its value heads' v and z; `in_proj_ba` its b and a); they are
  regrouped into our `in_proj` order [q | k | v | z | b | a]. Qwen3.5 keeps them apart
  (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`), already in that order.
- Every RMSNorm outside the GDN output norm is zero-centred (`x_hat * (1 + w)`): its
  weight is loaded as `1 + w` (float32), which is the same function.
- MoE (Qwen3-Next: layers with `(i + 1) % decoder_sparse_step == 0` not in
  `mlp_only_layers`; Qwen3.5-MoE: every layer): softmax router, top-k renormalised when
  `norm_topk_prob` (Qwen3.5-MoE always), a shared expert scaled by sigmoid(shared_expert_gate).
- Multi-token-prediction weights (`mtp.*`) are skipped with a log line (the loader skips
  a vision tower).
"""
from __future__ import annotations

import torch

from engine.models.config import DENSE, FULL, GDN, MOE, AttentionConfig, LinearConfig, ModelConfig, MoEConfig
from engine.models.hf.checkpoint import CheckpointTensors
from engine.models.hf.common import (Conversion, centred, dense_mlp, layer_kinds, legacy_rope_parameters, moe_experts,
                                      rope_settings, take_ends)
from engine.models.hf.fields import ConfigFields

MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
LAYER_KIND = {"linear_attention": GDN, "full_attention": FULL}


def model_config(f: ConfigFields, model_type: str, name: str) -> ModelConfig:
    f.expect("hidden_act", "silu")
    f.expect("attention_bias", False)
    f.expect("use_sliding_window", False)
    f.expect("sliding_window", None)
    n_layers = int(f.get("num_hidden_layers"))
    if f.has("layer_types"):
        f.ignore(("full_attention_interval",))
        types = f.get("layer_types")
    else:  # older configs: every `full_attention_interval`-th layer is full attention
        interval = int(f.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]
    layers = layer_kinds(f, types, n_layers, LAYER_KIND)
    hidden = int(f.get("hidden_size"))
    heads = int(f.get("num_attention_heads"))
    head_dim = int(f.get("head_dim", hidden // heads))
    rope = rope_settings(legacy_rope_parameters(f), head_dim, f"{f.where}: rope_parameters",
                         extra_ok=("mrope_section", "mrope_interleaved"), default_partial=0.25)
    attention = AttentionConfig(
        num_heads=heads, num_kv_heads=int(f.get("num_key_value_heads")), head_dim=head_dim,
        rotary_dim=rope.rotary_dim, rope_theta=rope.theta, output_gate=True, qk_norm=True)
    linear = LinearConfig(
        num_heads=int(f.get("linear_num_key_heads")), num_v_heads=int(f.get("linear_num_value_heads")),
        key_dim=int(f.get("linear_key_head_dim")), value_dim=int(f.get("linear_value_head_dim")),
        conv_size=int(f.get("linear_conv_kernel_dim")))
    mlp_layers: tuple[str, ...] = ()
    moe = MoEConfig()
    num_experts = int(f.get("num_experts", 0))
    if model_type == "qwen3_5_moe_text" or num_experts:
        if model_type == "qwen3_next":
            step = int(f.get("decoder_sparse_step", 1))
            only = set(f.get("mlp_only_layers", []))
            mlp_layers = tuple(MOE if i not in only and (i + 1) % step == 0 else DENSE for i in range(n_layers))
            norm_topk = bool(f.get("norm_topk_prob", True))
        else:
            mlp_layers = (MOE,) * n_layers
            norm_topk = bool(f.expect("norm_topk_prob", True))
        moe = MoEConfig(
            num_experts=num_experts, top_k=int(f.get("num_experts_per_tok")),
            intermediate_size=int(f.get("moe_intermediate_size")),
            shared_intermediate_size=int(f.get("shared_expert_intermediate_size", 0)),
            shared_expert_gate=True, norm_topk_prob=norm_topk)
    intermediate = int(f.get("intermediate_size", 1))  # Qwen3.5-MoE has no dense MLP
    cfg = ModelConfig(
        name=name, family=model_type, scale="custom", vocab_size=int(f.get("vocab_size")), hidden_size=hidden,
        intermediate_size=intermediate, layers=tuple(layers),
        tie_embeddings=bool(f.get("tie_word_embeddings", False)), rms_norm_eps=float(f.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(f.get("max_position_embeddings")), attention=attention, linear=linear,
        mlp_layers=mlp_layers, moe=moe)
    f.finish()
    return cfg


def _gdn_in_proj_next(t: CheckpointTensors, src: str, cfg: ModelConfig) -> torch.Tensor:
    """Qwen3-Next's per-key-head packed `in_proj_qkvz` / `in_proj_ba` -> [q | k | v | z | b | a]."""
    lin = cfg.linear
    hk, hv, dk, dv = lin.num_heads, lin.num_v_heads, lin.key_dim, lin.value_dim
    r = hv // hk
    qkvz = t.take(f"{src}.in_proj_qkvz.weight").reshape(hk, 2 * dk + 2 * r * dv, -1)
    ba = t.take(f"{src}.in_proj_ba.weight").reshape(hk, 2 * r, -1)
    q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=1)
    b, a = ba.split([r, r], dim=1)
    d = qkvz.shape[-1]
    return torch.cat([x.reshape(-1, d) for x in (q, k, v, z, b, a)])


def convert(f: ConfigFields, t: CheckpointTensors, model_type: str, name: str, prefix: str) -> Conversion:
    cfg = model_config(f, model_type, name)
    state: dict[str, torch.Tensor] = {}
    take_ends(t, state, cfg.tie_embeddings, f"{prefix}embed_tokens.weight", f"{prefix}norm.weight", centred)
    for i, kind in enumerate(cfg.layers):
        src, dst = f"{prefix}layers.{i}", f"blocks.{i}"
        state[f"{dst}.mixer_norm.weight"] = centred(t.take(f"{src}.input_layernorm.weight"))
        state[f"{dst}.mlp_norm.weight"] = centred(t.take(f"{src}.post_attention_layernorm.weight"))
        if kind == FULL:
            for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
                state[f"{dst}.mixer.{p}.weight"] = t.take(f"{src}.self_attn.{p}.weight")
            for p in ("q_norm", "k_norm"):
                state[f"{dst}.mixer.{p}.weight"] = centred(t.take(f"{src}.self_attn.{p}.weight"))
        else:
            la = f"{src}.linear_attn"
            if model_type == "qwen3_next":
                in_proj = _gdn_in_proj_next(t, la, cfg)
            else:
                in_proj = torch.cat([t.take(f"{la}.in_proj_{p}.weight") for p in ("qkv", "z", "b", "a")])
            state[f"{dst}.mixer.in_proj.weight"] = in_proj
            state[f"{dst}.mixer.conv.weight"] = t.take(f"{la}.conv1d.weight")[:, 0, :]
            for p in ("A_log", "dt_bias"):
                state[f"{dst}.mixer.{p}"] = t.take(f"{la}.{p}")
            state[f"{dst}.mixer.norm.weight"] = t.take(f"{la}.norm.weight")
            state[f"{dst}.mixer.out_proj.weight"] = t.take(f"{la}.out_proj.weight")
        if cfg.mlp_kind(i) == MOE:
            m, o = f"{src}.mlp", f"{dst}.mlp"
            state[f"{o}.router.weight"] = t.take(f"{m}.gate.weight")
            moe_experts(t, m, o, cfg.moe.num_experts, state)
            if cfg.moe.shared_intermediate_size:
                dense_mlp(t, f"{m}.shared_expert", f"{o}.shared", state)
                state[f"{o}.shared_gate.weight"] = t.take(f"{m}.shared_expert_gate.weight")
        else:
            dense_mlp(t, f"{src}.mlp", f"{dst}.mlp", state)
    notes = []
    names = t.skip("mtp.")
    if names:
        notes.append(f"skipped the multi-token-prediction layers ({len(names)} tensors under mtp.)")
    return Conversion(cfg, state, notes)
