"""What a model load returns (`LoadedModel`), dtype names, and the model fingerprint:
the pieces every loader shares (engine/models/weights.py for our own format and presets,
engine/models/hf/ for Hugging Face checkpoints), kept below both so neither imports the
other's module for them.

Fingerprint of stored or trained weights: sha256 over a domain tag, the canonical config
JSON, and every tensor of the state dict in sorted name order (name, dtype, shape, raw
little-endian bytes).

Fingerprint of a seeded random init (a preset without trained weights): sha256 over its
own domain tag, the canonical config JSON, the seed, the init recipe's name, the dtype,
the generator's device (`generator_identity`: CPU and CUDA generators, and different GPU
models, draw different numbers) and the torch version (its generators define the draws).
Everything that determines the bytes, so the bytes need not be read: a 35B preset is
not hashed (~70 GB) at start-up.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

import torch

from engine.errors import ConfigError
from engine.models.config import ModelConfig
from engine.models.decoder import HybridDecoder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FINGERPRINT_TAG = b"hypercache-model-fingerprint-v1\x00"
INIT_FINGERPRINT_TAG = b"hypercache-model-init-fingerprint-v1\x00"


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ConfigError(f"dtype={name!r} must be one of {sorted(DTYPES)}")
    return DTYPES[name]


def _tensor_bytes(t: torch.Tensor):
    flat = t.detach().reshape(-1).contiguous().cpu()
    return flat.view(torch.uint8).numpy()


def fingerprint_state(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    h.update(FINGERPRINT_TAG)
    h.update(cfg.to_json().encode())
    for name in sorted(state):
        t = state[name]
        h.update(f"\x00{name}\x00{str(t.dtype).removeprefix('torch.')}\x00{tuple(t.shape)}\x00".encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def fingerprint_init(cfg: ModelConfig, seed: int, recipe: str, dtype: torch.dtype, device: torch.device | str) -> str:
    """The fingerprint of `cfg` initialised by `recipe` from `seed` in `dtype` on a device
    of `device`'s type (see the module docstring); reads no weights."""
    h = hashlib.sha256()
    h.update(INIT_FINGERPRINT_TAG)
    h.update(cfg.to_json().encode())
    h.update(f"\x00seed={int(seed)}\x00recipe={recipe}\x00dtype={str(dtype).removeprefix('torch.')}"
             f"\x00device={generator_identity(device)}\x00torch={torch.__version__}".encode())
    return h.hexdigest()


def generator_identity(device: torch.device | str) -> str:
    """What, besides the seed and torch's version, decides the numbers a generator on
    `device` draws: CUDA's kernels spread a draw over a grid sized by the GPU's SM count
    (so two GPU models may draw differently), the CPU's vectorised samplers depend on its
    instruction set."""
    dev = torch.device(device)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        return f"cuda:{props.name}:sm{props.multi_processor_count}"
    if dev.type == "cpu":
        return f"cpu:{torch.backends.cpu.get_cpu_capability()}"
    return dev.type


def fingerprint(model: HybridDecoder) -> str:
    """The model fingerprint (hex sha256) of a model's config and current weights."""
    return fingerprint_state(model.config, model.state_dict())


@dataclass
class LoadedModel:
    model: HybridDecoder
    config: ModelConfig
    #: where the weights came from: "weights:<dir>" or "init:seed=<n>"
    source: str
    _fingerprint: str | None = field(default=None, repr=False)

    @property
    def trained(self) -> bool:
        return self.source.startswith("weights:")

    @functools.cached_property
    def fingerprint(self) -> str:
        return self._fingerprint or fingerprint(self.model)
