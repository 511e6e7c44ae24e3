"""Model presets that mirror production hybrids' layer patterns and head shapes, each at two
scales: "tiny" (byte vocabulary, ~1-3M params, fp32; CPU tests and training here) and
"bench" (~1.7-2B params, random weights, bf16; GPU timing).

| family      | mirrors                       | pattern                                   |
|-------------|-------------------------------|-------------------------------------------|
| `qwen3next` | Qwen3-Next / Qwen3.5          | 3 Gated DeltaNet : 1 full (gated output, 25% rotary, qk-norm) |
| `ring`      | Ring-linear-2.0 (lightning)   | 7 scalar-decay (fixed per-head decay) : 1 full (50% rotary) |
| `gemma3`    | Gemma-3                       | 5 sliding-window : 1 full (local/global RoPE bases) |
| `nemotronh` | Nemotron-H / Jamba            | Mamba2 with one attention layer per 8 (no RoPE, as Jamba) |
| `gla`       | GLA hybrids                   | 3 GLA : 1 full                            |

Names are `<family>-<scale>`. `list_presets()` / `get_preset(name)` return `ModelConfig`s;
engine.models.weights.load_model loads trained weights from `models/<name>/` when present.

Real-shape presets (scale "bench", `real_shape` true in `preset_info`): the published
dimensions of a real model, whole depth, real vocabulary and expert counts, random bf16
weights; the numbers and where each was read are in engine/models/published.py.

| preset                      | model                  | params  | bf16    |
|-----------------------------|------------------------|---------|---------|
| `qwen3.5-35b-a3b-real`      | Qwen3.5-35B-A3B (text) | 34.66 B | 64.6 GiB |
| `ring-mini-linear-2.0-real` | Ring-mini-linear-2.0   | 16.42 B | 30.6 GiB |

`qwen3.5-35b-a3b-real` is exactly what the Hugging Face converter
(engine/models/hf/qwen3.py) makes of the published text config (a test pins it).
`ring-mini-linear-2.0-real` is likewise exactly what the Ring-linear-2.0 converter
(engine/models/hf/bailing.py) makes of the published config (a test pins it): the shapes
and every numeric detail (linear RoPE and q/k norm, grouped output norm, sigmoid routing
with an expert bias, group-limited top-k, the routed scaling factor), on the `ring`
family name. Its decay's layer offset follows the published expression, which the ports
disagree on (docs/models.md).
"""
from __future__ import annotations

from engine.errors import PresetNotFoundError
from engine.models import published
from engine.models.config import (DENSE, FULL, GDN, GLA, LIGHTNING, MAMBA2, MOE, SWA, AttentionConfig, LinearConfig,
                                  ModelConfig, MoEConfig)

BYTE_VOCAB = 260  # engine.tokenizer.ByteTokenizer: 256 bytes + BOS, EOS, PAD, SEP
BENCH_VOCAB = 32768

_TINY = dict(scale="tiny", vocab_size=BYTE_VOCAB, hidden_size=128, intermediate_size=384,
             tie_embeddings=True, max_position_embeddings=8192, dtype="float32")
_BENCH = dict(scale="bench", vocab_size=BENCH_VOCAB, hidden_size=2048, tie_embeddings=False,
              max_position_embeddings=131072, dtype="bfloat16")


def _qwen3next() -> list[ModelConfig]:
    tiny = ModelConfig(
        name="qwen3next-tiny", family="qwen3next", layers=(GDN, GDN, GDN, FULL) * 2, **_TINY,
        attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=32, rotary_dim=8,
                                  output_gate=True, qk_norm=True),
        linear=LinearConfig(num_heads=2, num_v_heads=4, key_dim=32, value_dim=32, conv_size=4))
    bench = ModelConfig(
        name="qwen3next-bench", family="qwen3next", layers=(GDN, GDN, GDN, FULL) * 6,
        intermediate_size=6144, **_BENCH,
        attention=AttentionConfig(num_heads=16, num_kv_heads=2, head_dim=256, rotary_dim=64,
                                  rope_theta=1e7, output_gate=True, qk_norm=True),
        linear=LinearConfig(num_heads=16, num_v_heads=32, key_dim=128, value_dim=128, conv_size=4))
    return [tiny, bench]


def _ring() -> list[ModelConfig]:
    pattern = (LIGHTNING,) * 7 + (FULL,)
    tiny = ModelConfig(
        name="ring-tiny", family="ring", layers=pattern, **_TINY,
        attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=32, rotary_dim=16, qk_norm=True),
        linear=LinearConfig(num_heads=4, num_v_heads=4, key_dim=32, value_dim=32, conv_size=0))
    bench = ModelConfig(
        name="ring-bench", family="ring", layers=pattern * 3, intermediate_size=8192, **_BENCH,
        attention=AttentionConfig(num_heads=16, num_kv_heads=4, head_dim=128, rotary_dim=64,
                                  rope_theta=6e5, qk_norm=True),
        linear=LinearConfig(num_heads=16, num_v_heads=16, key_dim=128, value_dim=128, conv_size=0))
    return [tiny, bench]


def _gemma3() -> list[ModelConfig]:
    pattern = (SWA,) * 5 + (FULL,)
    tiny = ModelConfig(
        name="gemma3-tiny", family="gemma3", layers=pattern * 2, **_TINY,
        attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=32, rotary_dim=32,
                                  rope_theta=1e6, swa_rope_theta=1e4, sliding_window=128, qk_norm=True))
    bench = ModelConfig(
        name="gemma3-bench", family="gemma3", layers=pattern * 4, intermediate_size=8192, **_BENCH,
        attention=AttentionConfig(num_heads=8, num_kv_heads=4, head_dim=256, rotary_dim=256,
                                  rope_theta=1e6, swa_rope_theta=1e4, sliding_window=1024, qk_norm=True))
    return [tiny, bench]


def _nemotronh() -> list[ModelConfig]:
    pattern = (MAMBA2,) * 4 + (FULL,) + (MAMBA2,) * 3  # Jamba: attention at offset 4 of every 8
    tiny = ModelConfig(
        name="nemotronh-tiny", family="nemotronh", layers=pattern, **_TINY,
        attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=32, rotary_dim=0),
        linear=LinearConfig(num_heads=1, num_v_heads=8, key_dim=32, value_dim=32, conv_size=4))
    bench = ModelConfig(
        name="nemotronh-bench", family="nemotronh", layers=pattern * 3, intermediate_size=8192, **_BENCH,
        attention=AttentionConfig(num_heads=16, num_kv_heads=8, head_dim=128, rotary_dim=0),
        linear=LinearConfig(num_heads=8, num_v_heads=64, key_dim=128, value_dim=64, conv_size=4))
    return [tiny, bench]


def _gla() -> list[ModelConfig]:
    pattern = (GLA, GLA, GLA, FULL)
    tiny = ModelConfig(
        name="gla-tiny", family="gla", layers=pattern * 2, **_TINY,
        attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=32, rotary_dim=32),
        linear=LinearConfig(num_heads=4, num_v_heads=4, key_dim=16, value_dim=32, conv_size=0))
    bench = ModelConfig(
        name="gla-bench", family="gla", layers=pattern * 6, intermediate_size=8192, **_BENCH,
        attention=AttentionConfig(num_heads=16, num_kv_heads=4, head_dim=128, rotary_dim=128),
        linear=LinearConfig(num_heads=16, num_v_heads=16, key_dim=64, value_dim=128, conv_size=0))
    return [tiny, bench]


def _qwen3_5_35b_a3b_real() -> ModelConfig:
    """Qwen3.5-35B-A3B's text model (published.QWEN3_5_35B_A3B_TEXT): 40 layers, 3 Gated
    DeltaNet : 1 gated full attention, every layer MoE (256 experts, top 8, width 512,
    sigmoid-gated shared expert of 512), vocab 248320."""
    c = published.QWEN3_5_35B_A3B_TEXT
    n = c["num_hidden_layers"]
    every = c["full_attention_interval"]
    rope = c["rope_parameters"]
    return ModelConfig(
        name="qwen3.5-35b-a3b-real", family="qwen3next", scale="bench", vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"], intermediate_size=1,  # no dense MLP: every layer is MoE
        layers=tuple(GDN if (i + 1) % every else FULL for i in range(n)),
        tie_embeddings=c["tie_word_embeddings"], rms_norm_eps=c["rms_norm_eps"],
        max_position_embeddings=c["max_position_embeddings"], dtype="bfloat16",
        attention=AttentionConfig(
            num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
            rotary_dim=int(c["head_dim"] * rope["partial_rotary_factor"]), rope_theta=rope["rope_theta"],
            output_gate=True, qk_norm=True),
        linear=LinearConfig(
            num_heads=c["linear_num_key_heads"], num_v_heads=c["linear_num_value_heads"],
            key_dim=c["linear_key_head_dim"], value_dim=c["linear_value_head_dim"],
            conv_size=c["linear_conv_kernel_dim"]),
        mlp_layers=(MOE,) * n,
        moe=MoEConfig(num_experts=c["num_experts"], top_k=c["num_experts_per_tok"],
                      intermediate_size=c["moe_intermediate_size"],
                      shared_intermediate_size=c["shared_expert_intermediate_size"], shared_expert_gate=True,
                      norm_topk_prob=c["norm_topk_prob"]))


def _ring_mini_linear_real() -> ModelConfig:
    """Ring-mini-linear-2.0 (published.RING_MINI_LINEAR_2_0) as the Ring-linear-2.0
    converter maps it: 20 layers in groups of 5 (4 lightning, then 1 GQA attention: full
    at 4, 9, 14, 19), q/k RMSNorm and 50% rotary in both kinds, the linear output normed
    over `group_norm_size` groups, the first layer a dense MLP of 5120, the rest MoE (256
    experts, top 8 of sigmoid scores with an expert bias, 4 of 8 groups, scaled by 2.5,
    width 512, one ungated shared expert of 512), vocab 157184."""
    c = published.RING_MINI_LINEAR_2_0
    n = c["num_hidden_layers"]
    group = c["layer_group_size"]
    heads, head_dim = c["num_attention_heads"], c["head_dim"]
    rotary = int(head_dim * c["partial_rotary_factor"])
    theta = float(c["rope_theta"])
    return ModelConfig(
        name="ring-mini-linear-2.0-real", family="ring", scale="bench", vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        layers=tuple(FULL if (i + 1) % group == 0 else LIGHTNING for i in range(n)),
        tie_embeddings=c["tie_word_embeddings"], rms_norm_eps=c["rms_norm_eps"],
        max_position_embeddings=c["max_position_embeddings"], dtype="bfloat16",
        attention=AttentionConfig(
            num_heads=heads, num_kv_heads=c["num_key_value_heads"], head_dim=head_dim,
            rotary_dim=rotary, rope_theta=theta, qk_norm=c["use_qk_norm"]),
        # the linear layers are multi-head (16 q, k and v heads of 128: qkv width 3 * 2048)
        linear=LinearConfig(num_heads=heads, num_v_heads=heads, key_dim=head_dim, value_dim=head_dim, conv_size=0,
                            conv_kinds=(), qkv_silu=c["linear_silu"], qk_norm=c["use_qk_norm"], rotary_dim=rotary,
                            rope_theta=theta, norm_groups=c["group_norm_size"],
                            decay_layer_offset=-1),  # the published `layer_idx - 1` (docs/models.md)
        mlp_layers=tuple(DENSE if i < c["first_k_dense_replace"] else MOE for i in range(n)),
        moe=MoEConfig(num_experts=c["num_experts"], top_k=c["num_experts_per_tok"],
                      intermediate_size=c["moe_intermediate_size"],
                      shared_intermediate_size=c["num_shared_experts"] * c["moe_shared_expert_intermediate_size"],
                      shared_expert_gate=False, norm_topk_prob=c["norm_topk_prob"],
                      scoring=c["score_function"], expert_bias=c["moe_router_enable_expert_bias"],
                      num_groups=c["n_group"], topk_groups=c["topk_group"],
                      routed_scaling_factor=float(c["routed_scaling_factor"])))


_REAL_SHAPE = (_qwen3_5_35b_a3b_real(), _ring_mini_linear_real())
REAL_SHAPE_PRESETS = tuple(cfg.name for cfg in _REAL_SHAPE)

_PRESETS: dict[str, ModelConfig] = {
    cfg.name: cfg for group in (_qwen3next(), _ring(), _gemma3(), _nemotronh(), _gla(), _REAL_SHAPE)
    for cfg in group
}


def list_presets(scale: str | None = None, real_shape: bool = False) -> list[ModelConfig]:
    """The presets (optionally one scale), in a fixed order; the real-shape ones (16-35B
    parameters) only with `real_shape`, so a tool that loops over every bench preset never
    loads one by accident."""
    return [c for c in _PRESETS.values()
            if (scale is None or c.scale == scale) and (real_shape or c.name not in REAL_SHAPE_PRESETS)]


def get_preset(name: str) -> ModelConfig:
    try:
        return _PRESETS[name]
    except KeyError:
        raise PresetNotFoundError(f"no preset named {name!r}; known: {', '.join(_PRESETS)}") from None


def count_parameters(cfg: ModelConfig) -> int:
    """Parameter count of a config (built on the meta device: no memory, no init)."""
    import torch

    from engine.models.decoder import HybridDecoder

    with torch.device("meta"):
        model = HybridDecoder(cfg)
    return sum(p.numel() for p in model.parameters())


def preset_info(cfg: ModelConfig) -> dict:
    """The JSON-able summary `kvengine presets --json` prints for one preset."""
    return {"name": cfg.name, "family": cfg.family, "scale": cfg.scale, "layers": list(cfg.layers),
            "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "parameters": count_parameters(cfg), "dtype": cfg.dtype,
            "max_position_embeddings": cfg.max_position_embeddings, "real_shape": cfg.name in REAL_SHAPE_PRESETS}
