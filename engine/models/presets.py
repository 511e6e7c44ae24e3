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
"""
from __future__ import annotations

from engine.errors import PresetNotFoundError
from engine.models.config import (FULL, GDN, GLA, LIGHTNING, MAMBA2, SWA, AttentionConfig, LinearConfig,
                                  ModelConfig)

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


_PRESETS: dict[str, ModelConfig] = {
    cfg.name: cfg for group in (_qwen3next(), _ring(), _gemma3(), _nemotronh(), _gla()) for cfg in group
}


def list_presets(scale: str | None = None) -> list[ModelConfig]:
    """All presets (optionally one scale), in a fixed order."""
    return [c for c in _PRESETS.values() if scale is None or c.scale == scale]


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
            "max_position_embeddings": cfg.max_position_embeddings}
