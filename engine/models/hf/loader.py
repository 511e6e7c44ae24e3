"""Loading a Hugging Face checkpoint directory as an engine model.

`load_hf_model(dir)` reads config.json (for a multimodal checkpoint, its `text_config`;
the vision part is skipped with a log line), picks the converter of its `model_type`
(`ARCHITECTURES`), converts config and tensors (one safetensors file or an index with
shards), and returns a `LoadedModel` whose `source` is `weights:<dir>`. Unsupported
config fields and tensors the converter does not map are refused, each named.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

import torch

from engine.errors import UnsupportedConfigError, WeightsError
from engine.models.hf import bailing, bailing_hybrid, gemma3, kimi_linear, nemotron_h, qwen3
from engine.models.hf.checkpoint import CONFIG_FILE, CheckpointTensors, read_json
from engine.models.hf.common import Conversion, check_all_used
from engine.models.hf.fields import ConfigFields

log = logging.getLogger(__name__)

Converter = Callable[[ConfigFields, CheckpointTensors, str, str, str], Conversion]

#: model_type (of the text model) -> converter
ARCHITECTURES: dict[str, Converter] = {
    **{t: qwen3.convert for t in qwen3.MODEL_TYPES},
    **{t: gemma3.convert for t in gemma3.MODEL_TYPES},
    **{t: nemotron_h.convert for t in nemotron_h.MODEL_TYPES},
    **{t: bailing.convert for t in bailing.MODEL_TYPES},
    **{t: kimi_linear.convert for t in kimi_linear.MODEL_TYPES},
    **{t: bailing_hybrid.convert for t in bailing_hybrid.MODEL_TYPES},
}
#: multimodal wrappers: outer model_type -> the text model_type their text_config holds
MULTIMODAL = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "gemma3": "gemma3_text"}
#: where the text model's tensors may sit, tried in order
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.", "backbone.")
#: the embedding table's name under a text prefix (Qwen/Gemma, Nemotron-H, Bailing)
EMBEDDING_NAMES = ("embed_tokens", "embeddings", "word_embeddings")
#: tensors of a multimodal checkpoint's vision part (skipped with a log line)
VISION_PREFIXES = ("model.visual.", "model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                   "multi_modal_projector.", "visual.")
#: outer multimodal config fields that only concern the vision part
VISION_FIELDS = ("vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
                 "vision_end_token_id", "image_token_index", "boi_token_index", "eoi_token_index",
                 "mm_tokens_per_image", "vision_feature_layer", "text_config")


def supported_architectures() -> list[str]:
    return sorted(set(ARCHITECTURES) | set(MULTIMODAL))


def text_config(directory: Path) -> tuple[dict, str, list[str]]:
    """(text model config dict, its model_type, notes) of a checkpoint's config.json."""
    raw = read_json(directory / CONFIG_FILE)
    model_type = raw.get("model_type")
    notes: list[str] = []
    if model_type in MULTIMODAL:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise UnsupportedConfigError(f"{directory / CONFIG_FILE}: {model_type} needs a text_config object")
        outer = ConfigFields(raw, str(directory / CONFIG_FILE))
        outer.ignore(VISION_FIELDS)
        outer.ignore(("tie_word_embeddings",))
        outer.finish()
        text = dict(text)
        if "tie_word_embeddings" in raw and "tie_word_embeddings" not in text:
            text["tie_word_embeddings"] = raw["tie_word_embeddings"]
        if "vision_config" in raw:
            notes.append(f"{model_type}: the vision tower is skipped (text model only)")
        text.setdefault("model_type", MULTIMODAL[model_type])
        return text, text["model_type"], notes
    if model_type not in ARCHITECTURES:
        raise UnsupportedConfigError(
            f"{directory / CONFIG_FILE}: model_type={model_type!r} is not supported "
            f"(supported: {', '.join(supported_architectures())})")
    return raw, model_type, notes


def convert_checkpoint(directory: str | os.PathLike) -> Conversion:
    """Config and state dict of a checkpoint, on the CPU in the checkpoint's dtypes."""
    d = Path(directory)
    data, model_type, notes = text_config(d)
    convert = ARCHITECTURES.get(model_type)
    if convert is None:
        raise UnsupportedConfigError(f"{d / CONFIG_FILE}: text model_type={model_type!r} is not supported")
    tensors = CheckpointTensors(d)
    prefix = next((p for p in TEXT_PREFIXES if any(f"{p}{e}.weight" in tensors for e in EMBEDDING_NAMES)), None)
    if prefix is None:
        raise WeightsError(f"{d}: no embedding table under any of {', '.join(TEXT_PREFIXES)}")
    fields = ConfigFields(data, f"{d / CONFIG_FILE}" + ("" if data.get("model_type") == model_type else ":text_config"))
    conv = convert(fields, tensors, model_type, d.name, prefix)
    for vision in VISION_PREFIXES:
        names = tensors.skip(vision)
        if names:
            notes.append(f"skipped {len(names)} vision tensors under {vision}")
    check_all_used(tensors)
    conv.notes[:0] = notes
    return conv


def load_hf_model(directory: str | os.PathLike, device: torch.device | str = "cpu",
                  dtype: torch.dtype | str | None = None):
    """A checkpoint directory -> `engine.models.weights.LoadedModel` on `device` in `dtype`
    (default: the checkpoint's dtype when it is float32, else bfloat16)."""
    from engine.models.decoder import HybridDecoder
    from engine.models.loaded import LoadedModel, torch_dtype

    d = Path(directory)
    conv = convert_checkpoint(d)
    for note in conv.notes:
        log.info("%s: %s", d, note)
    raw_dtype = read_json(d / CONFIG_FILE).get("dtype") or read_json(d / CONFIG_FILE).get("torch_dtype")
    cfg = conv.config.replace(dtype="float32" if raw_dtype == "float32" else "bfloat16")
    dt = torch_dtype(dtype or cfg.dtype)
    with torch.device("meta"):
        model = HybridDecoder(cfg)
    model = model.to_empty(device=device)
    try:
        missing, unexpected = model.load_state_dict(conv.state, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise WeightsError(f"{d}: tensors do not match the config: {e}") from e
    if missing or unexpected:
        raise WeightsError(f"{d}: conversion left missing {missing} / unexpected {unexpected}")
    model.to(dtype=dt)
    keep_norms_float32(model, conv.state)
    model.eval()
    return LoadedModel(model, cfg, f"weights:{d}")


def keep_norms_float32(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """RMSNorm weights stay float32 in a bf16/fp16 model, as the checkpoints' own norms
    compute (`x_hat * (1 + w)` in float32): a zero-centred weight `1 + w` rounded to bf16
    would lose w's low bits (bf16 spacing near 1 is 2^-7). RMSNorm takes a weight of
    another dtype than its input and computes in float32. A sigmoid router (Ring-linear)
    keeps its weight and expert bias float32 too: it scores in float32, and the expert
    choice compares biased scores. Kimi Delta Attention keeps `dt_bias` (float32 in the
    checkpoint, as transformers keeps it) and `A_log` float32: the decay is computed in
    float32 from them. A short conv marked `float32` (Ling 3) keeps its weight float32."""
    from engine.models.layers.conv import ShortConv
    from engine.models.layers.kda import KimiDeltaAttention
    from engine.models.layers.moe import SparseMoE
    from engine.models.layers.norm import RMSNorm

    for name, module in model.named_modules():
        if isinstance(module, RMSNorm) and module.weight.dtype != torch.float32:
            module.weight.data = state[f"{name}.weight"].to(device=module.weight.device, dtype=torch.float32)
        if isinstance(module, ShortConv) and module.float32:
            module.weight.data = state[f"{name}.weight"].to(device=module.weight.device, dtype=torch.float32)
        if isinstance(module, KimiDeltaAttention):
            for key in ("dt_bias", "A_log"):
                p = getattr(module, key)
                p.data = state[f"{name}.{key}"].to(device=p.device, dtype=torch.float32)
        if isinstance(module, SparseMoE) and module.scoring == "sigmoid":
            for key, p in (("router.weight", module.router.weight), ("router_bias", module.router_bias)):
                if p is not None and p.dtype != torch.float32:
                    p.data = state[f"{name}.{key}"].to(device=p.device, dtype=torch.float32)
