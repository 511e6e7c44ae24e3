"""The published dimensions of the real hybrid models the real-shape bench presets
(engine/models/presets.py) copy, as the public `config.json` values, each with where it
was read. Only numbers live here; the presets map them onto our layer families.

Sources (no network here: read through public code that quotes them):
- Qwen3.5-35B-A3B (`Qwen/Qwen3.5-35B-A3B`, text model `qwen3_5_moe_text`): the defaults of
  transformers' `Qwen3_5MoeTextConfig` (transformers 5.x,
  models/qwen3_5_moe/configuration_qwen3_5_moe.py, documented as the configuration of
  that checkpoint: vocab 248320, hidden 2048, 40 layers, 16 q / 2 KV heads of 256,
  linear 16 key / 32 value heads of 128, conv 4, 256 experts top-8 of width 512, shared
  expert 512, every 4th layer full attention, partial rotary 0.25), and the checkpoint's
  `text_config` as quoted by public ports (`max_position_embeddings` 262144,
  `rope_parameters` {rope_theta 1e7, partial_rotary_factor 0.25, mrope_section [11, 11, 10]},
  `attn_output_gate` true, `mlp_only_layers` []).
- Ring-mini-linear-2.0 (`inclusionAI/Ring-mini-linear-2.0`, `BailingMoeLinearV2ForCausalLM`,
  `model_type` bailing_moe_linear): the `config.json` of `mlx-community/Ring-mini-linear-2.0-4bit`
  (a 4-bit conversion that keeps the original's dimensions; quantisation keys left out
  here), quoted field for field in the tests of a public MLX port (lablup/mlxcel).
"""
from __future__ import annotations

from typing import Any

QWEN3_5_35B_A3B_TEXT: dict[str, Any] = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10]},
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 8,
    "num_experts": 256,
    "norm_topk_prob": True,
}

RING_MINI_LINEAR_2_0: dict[str, Any] = {
    "architectures": ["BailingMoeLinearV2ForCausalLM"],
    "model_type": "bailing_moe_linear",
    "vocab_size": 157184,
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 20,
    "layer_group_size": 5,
    "first_k_dense_replace": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "partial_rotary_factor": 0.5,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "use_qk_norm": True,
    "use_qkv_bias": False,
    "use_bias": False,
    "linear_silu": False,
    "group_norm_size": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "num_shared_experts": 1,
    "moe_shared_expert_intermediate_size": 512,
    "score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 0,
    "eos_token_id": 156892,
    "pad_token_id": 156892,
    "torch_dtype": "bfloat16",
}
