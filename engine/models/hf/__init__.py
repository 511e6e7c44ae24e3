"""Hugging Face checkpoints: a model directory (config.json, safetensors, tokenizer files)
mapped onto the engine's layer families.

- `checkpoint.py`: the directory's JSON files and its tensors (one file or sharded);
- `fields.py`: strict config reading (an unsupported field is refused by name);
- `common.py`: RoPE settings, norm and MLP/MoE weight conversions shared by architectures;
- `qwen3.py`, `gemma3.py`, `nemotron_h.py`, `bailing.py` (Ring-linear-2.0): one converter per
  architecture family;
- `loader.py`: `load_hf_model(dir)` -> `LoadedModel`;
- `tokenizer.py`: the checkpoint's tokenizer, chat template and stop tokens.
"""
from engine.models.hf.checkpoint import is_hf_checkpoint
from engine.models.hf.loader import convert_checkpoint, load_hf_model, supported_architectures

__all__ = ["is_hf_checkpoint", "load_hf_model", "convert_checkpoint", "supported_architectures"]
