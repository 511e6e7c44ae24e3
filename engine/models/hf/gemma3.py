"""Gemma 3 text models (`gemma3_text`; the multimodal `gemma3` maps its text model) onto
the engine.

Mapping (transformers' modeling_gemma3.py):
- `sliding_attention` layers -> `swa` (window `sliding_window`: a token sees itself and the
  w-1 before it, as transformers' sliding mask), `full_attention` -> `full`; each with its
  own RoPE (`rope_parameters[layer type]`: the local base for sliding layers, the global
  base and optional linear scaling for full layers).
- q/k RMSNorm per head, softmax scale `query_pre_attn_scalar ** -0.5`.
- Blocks with four norms: input norm -> attention -> post-attention norm -> residual;
  pre-feedforward norm -> GeGLU MLP (`gelu_pytorch_tanh`) -> post-feedforward norm ->
  residual (`ModelConfig.post_norms`).
- Every RMSNorm is zero-centred (`x_hat * (1 + w)`): loaded as `1 + w`.
- The embedding is scaled by sqrt(hidden_size) (in the weights' dtype); the LM head is
  tied to the unscaled table; `final_logit_softcapping` caps the logits when set.
- Attention-logit soft-capping and bidirectional attention are refused (Gemma 3 uses
  neither).
"""
from __future__ import annotations

import torch

from engine.errors import UnsupportedConfigError
from engine.models.config import FULL, SWA, AttentionConfig, ModelConfig
from engine.models.hf.checkpoint import CheckpointTensors
from engine.models.hf.common import Conversion, centred, dense_mlp, layer_kinds, rope_settings
from engine.models.hf.fields import ConfigFields

MODEL_TYPES = ("gemma3_text",)
LAYER_KIND = {"sliding_attention": SWA, "full_attention": FULL}


def _rope_params(f: ConfigFields) -> dict[str, dict]:
    """Per layer type RoPE parameters, from `rope_parameters` or the pre-5 fields
    (rope_theta, rope_local_base_freq, rope_scaling)."""
    if f.has("rope_parameters"):
        f.ignore(("rope_theta", "rope_local_base_freq", "rope_scaling"))
        params = f.get("rope_parameters")
        if "full_attention" in params or "sliding_attention" in params:
            return params
        return {"full_attention": params, "sliding_attention": params}
    full = {"rope_type": "default", "rope_theta": f.get("rope_theta", 1_000_000.0)}
    scaling = f.get("rope_scaling", None)
    if scaling:
        full.update(scaling)
        full["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
        full.pop("type", None)
    local = {"rope_type": "default", "rope_theta": f.get("rope_local_base_freq", 10_000.0)}
    return {"full_attention": full, "sliding_attention": local}


def model_config(f: ConfigFields, name: str) -> ModelConfig:
    act = f.get("hidden_activation", None) or f.get("hidden_act", "gelu_pytorch_tanh")
    f.ignore(("hidden_act", "hidden_activation"))
    if act != "gelu_pytorch_tanh":
        raise UnsupportedConfigError(f"{f.where}: hidden_activation={act!r} is not supported (gelu_pytorch_tanh)")
    f.expect("attention_bias", False)
    f.expect("use_bidirectional_attention", False)
    if f.get("attn_logit_softcapping", None) is not None:
        raise UnsupportedConfigError(f"{f.where}: attn_logit_softcapping={f.data['attn_logit_softcapping']!r} "
                                     "is not supported")
    f.ignore(("_sliding_window_pattern", "sliding_window_pattern", "cache_implementation"))
    n_layers = int(f.get("num_hidden_layers"))
    types = f.get("layer_types")
    layers = layer_kinds(f, types, n_layers, LAYER_KIND)
    hidden = int(f.get("hidden_size"))
    heads = int(f.get("num_attention_heads"))
    head_dim = int(f.get("head_dim", hidden // heads))
    ropes = _rope_params(f)
    full = rope_settings(ropes.get("full_attention") or {}, head_dim, f"{f.where}: rope_parameters.full_attention",
                         allow_linear=True)
    local = rope_settings(ropes.get("sliding_attention") or {}, head_dim,
                          f"{f.where}: rope_parameters.sliding_attention")
    if full.rotary_dim != head_dim or local.rotary_dim != head_dim:
        raise UnsupportedConfigError(f"{f.where}: partial rotary is not supported for gemma3")
    attention = AttentionConfig(
        num_heads=heads, num_kv_heads=int(f.get("num_key_value_heads")), head_dim=head_dim, rotary_dim=head_dim,
        rope_theta=full.theta, swa_rope_theta=local.theta, rope_linear_factor=full.linear_factor,
        sliding_window=int(f.get("sliding_window")) if SWA in layers else None,
        qk_norm=True, query_scale=float(f.get("query_pre_attn_scalar")))
    softcap = f.get("final_logit_softcapping", None)
    cfg = ModelConfig(
        name=name, family="gemma3_text", scale="custom", vocab_size=int(f.get("vocab_size")), hidden_size=hidden,
        intermediate_size=int(f.get("intermediate_size")), layers=tuple(layers),
        tie_embeddings=bool(f.get("tie_word_embeddings", True)), rms_norm_eps=float(f.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(f.get("max_position_embeddings")), attention=attention,
        hidden_act="gelu_tanh", post_norms=True, embed_scale=hidden ** 0.5,
        final_logit_softcap=None if softcap is None else float(softcap))
    f.finish()
    return cfg


def convert(f: ConfigFields, t: CheckpointTensors, model_type: str, name: str, prefix: str) -> Conversion:
    cfg = model_config(f, name)
    state: dict[str, torch.Tensor] = {
        "embed.weight": t.take(f"{prefix}embed_tokens.weight"),
        "norm.weight": centred(t.take(f"{prefix}norm.weight")),
    }
    if not cfg.tie_embeddings:
        state["lm_head.weight"] = t.take("lm_head.weight")
    elif "lm_head.weight" in t:
        t.take("lm_head.weight")
    norms = {"input_layernorm": "mixer_norm", "post_attention_layernorm": "post_mixer_norm",
             "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "post_mlp_norm"}
    for i in range(cfg.num_layers):
        src, dst = f"{prefix}layers.{i}", f"blocks.{i}"
        for theirs, ours in norms.items():
            state[f"{dst}.{ours}.weight"] = centred(t.take(f"{src}.{theirs}.weight"))
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[f"{dst}.mixer.{p}.weight"] = t.take(f"{src}.self_attn.{p}.weight")
        for p in ("q_norm", "k_norm"):
            state[f"{dst}.mixer.{p}.weight"] = centred(t.take(f"{src}.self_attn.{p}.weight"))
        dense_mlp(t, f"{src}.mlp", f"{dst}.mlp", state)
    return Conversion(cfg, state)
