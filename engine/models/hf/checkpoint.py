"""A Hugging Face model directory on disk: its JSON files and its tensors.

Layout read (nothing is ever downloaded):
    config.json                       the architecture (`model_type`; multimodal
                                      checkpoints nest the text model under `text_config`)
    model.safetensors                 one file, or
    model.safetensors.index.json      {"weight_map": {tensor name: shard file}} + the shards
    generation_config.json            optional: eos_token_id (int or list) = stop tokens
    tokenizer.json, tokenizer_config.json   read by engine/models/hf/tokenizer.py

`CheckpointTensors` opens every shard lazily and hands out tensors by name; `take(name)`
marks a tensor used, so a converter can refuse a checkpoint that holds tensors it did
not map (`unused()`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from engine.errors import WeightsError

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_FILE = "generation_config.json"


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise WeightsError(f"{path} does not exist") from None
    except (OSError, json.JSONDecodeError) as e:
        raise WeightsError(f"{path} is not readable JSON: {e}") from e
    if not isinstance(data, dict):
        raise WeightsError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def is_hf_checkpoint(path: str | Path) -> bool:
    """A directory whose config.json names a Hugging Face `model_type` (our own saved
    models have no such field)."""
    p = Path(path)
    cfg = p / CONFIG_FILE
    if not (p.is_dir() and cfg.is_file()):
        return False
    try:
        return "model_type" in read_json(cfg)
    except WeightsError:
        return False


class CheckpointTensors:
    """The tensors of a checkpoint directory, one safetensors file or an index + shards."""

    def __init__(self, directory: str | Path) -> None:
        from safetensors import safe_open

        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        single = self.directory / SINGLE_FILE
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise WeightsError(f"{index}: 'weight_map' must be a non-empty object")
            files = sorted(set(weight_map.values()))
        elif single.is_file():
            weight_map, files = None, [SINGLE_FILE]
        else:
            raise WeightsError(f"{self.directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
        self._handles = {}
        self._where: dict[str, str] = {}
        for name in files:
            path = self.directory / name
            if not path.is_file():
                raise WeightsError(f"{index}: shard {name} is missing")
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types for bad files
                raise WeightsError(f"cannot read {path}: {e}") from e
            self._handles[name] = handle
            for key in handle.keys():
                if key in self._where:
                    raise WeightsError(f"tensor {key} is in both {self._where[key]} and {name}")
                self._where[key] = name
        if weight_map is not None:
            for key, shard in weight_map.items():
                if self._where.get(key) != shard:
                    raise WeightsError(f"{index}: tensor {key} is not in {shard}")
        self._taken: set[str] = set()

    def names(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def take(self, name: str) -> torch.Tensor:
        """The tensor `name` (marked used); a clear error when the checkpoint lacks it."""
        shard = self._where.get(name)
        if shard is None:
            raise WeightsError(f"{self.directory}: tensor {name} is missing from the checkpoint")
        self._taken.add(name)
        return self._handles[shard].get_tensor(name)

    def skip(self, prefix: str) -> list[str]:
        """Mark every tensor under `prefix` used without reading it; returns their names."""
        names = [n for n in self._where if n.startswith(prefix)]
        self._taken.update(names)
        return names

    def unused(self) -> list[str]:
        return sorted(set(self._where) - self._taken)
