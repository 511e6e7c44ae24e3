"""Model weights: deterministic initialisation, safetensors save/load with `config.json`
beside the tensors, the model fingerprint, and `load_model` (trained weights when present,
else a seeded init).

Fingerprint: sha256 over a domain tag, the canonical config JSON, and every tensor of the
state dict in sorted name order (name, dtype, shape, raw little-endian bytes). It depends
only on those bytes, so it is the same in every process and on every machine that holds the
same weights in the same dtype (never Python's `hash()`); cache keys are built on it. A
preset loaded from its seed (no trained weights) is fingerprinted from its config, seed and
`INIT_RECIPE` instead (`fingerprint_init`, engine/models/loaded.py): nothing is hashed.

Directory layout written by `save_model` and read by `load_weights`:
    <dir>/config.json          ModelConfig.to_dict(), pretty-printed
    <dir>/model.safetensors    state dict; metadata {"fingerprint": ..., "format": "pt"}
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from engine.errors import ConfigError, WeightsError
from engine.models.config import ModelConfig
from engine.models.decoder import HybridDecoder
from engine.models.loaded import (  # noqa: F401  (re-exported)
    DTYPES, FINGERPRINT_TAG, LoadedModel, fingerprint, fingerprint_init, fingerprint_state, torch_dtype)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def default_models_root() -> Path:
    """`$KVENGINE_MODELS_DIR`, else `models/` at the repository root."""
    env = os.environ.get("KVENGINE_MODELS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "models"


# --------------------------------------------------------------------- initialisation
#: names the recipe of `initialize` in init fingerprints; a change to the draws (what is
#: drawn, in which order, in which dtype) must change it
INIT_RECIPE = "initialize-v1"


def _init_tensor(name: str, shape: torch.Size, num_layers: int, gen: torch.Generator,
                 device: torch.device) -> torch.Tensor:
    f32 = dict(dtype=torch.float32, device=device)
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        return torch.log(torch.empty(shape, **f32).uniform_(1.0, 16.0, generator=gen))
    if leaf == "dt_bias":
        dt = torch.exp(torch.empty(shape, **f32).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if leaf == "D":
        return torch.ones(shape, **f32)
    if leaf == "bias":
        return torch.zeros(shape, **f32)
    parts = name.split(".")
    if leaf == "weight" and len(parts) > 1 and "norm" in parts[-2]:
        return torch.ones(shape, **f32)
    if name.endswith("conv.weight"):
        bound = 1.0 / math.sqrt(shape[-1])
        return torch.empty(shape, **f32).uniform_(-bound, bound, generator=gen)
    std = 0.02
    if name.endswith(("o_proj.weight", "out_proj.weight", "down.weight")):
        std = 0.02 / math.sqrt(2 * num_layers)
    return torch.empty(shape, **f32).normal_(0.0, std, generator=gen)


@torch.no_grad()
def initialize(model: HybridDecoder, seed: int | None = None) -> HybridDecoder:
    """Fill every parameter deterministically from `seed` (default: config.init_seed), in sorted
    name order: RMSNorm weights 1, biases 0, A_log = log U(1, 16), dt_bias = softplus^-1 of a
    log-uniform dt in [1e-3, 0.1], D = 1, conv weights U(+-1/sqrt(width)), linear weights and
    the embedding N(0, 0.02) (output projections scaled by 1/sqrt(2L)). Same seed, device and
    torch version -> same weights."""
    cfg = model.config
    seed = cfg.init_seed if seed is None else seed
    device = model.device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    params = dict(model.named_parameters())
    for name in sorted(params):
        p = params[name]
        p.copy_(_init_tensor(name, p.shape, cfg.num_layers, gen, device).to(p.dtype))
    return model


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype | str | None = None,
                seed: int | None = None) -> HybridDecoder:
    """A freshly initialised model (see `initialize`) on `device` in `dtype`. The modules
    are made on the meta device (no memory, no default init), given uninitialised storage
    of `dtype` directly on `device`, then filled in place: no float32 copy of the model,
    nothing made on the host for a GPU model (a 35B bf16 preset needs its ~65 GiB and
    one float32 temporary of its largest tensor)."""
    dt = torch_dtype(dtype or cfg.dtype)
    with torch.device("meta"):
        model = HybridDecoder(cfg)
    model = model.to(dtype=dt).to_empty(device=device)
    return initialize(model, seed).eval()


# ------------------------------------------------------------------------ fingerprint


# ------------------------------------------------------------------------- save / load
def save_model(model: HybridDecoder, directory: str | os.PathLike) -> str:
    """Write config.json and model.safetensors under `directory`; returns the fingerprint."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    fp = fingerprint_state(model.config, state)
    save_file(state, str(d / WEIGHTS_FILE), metadata={"fingerprint": fp, "format": "pt"})
    (d / CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2, sort_keys=True) + "\n")
    return fp


def read_config(directory: str | os.PathLike) -> ModelConfig:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise WeightsError(f"no {CONFIG_FILE} in {directory}")
    return ModelConfig.from_json(path.read_text())


def load_weights(directory: str | os.PathLike, device: torch.device | str = "cpu",
                 dtype: torch.dtype | str | None = None, verify: bool = True) -> tuple[HybridDecoder, str]:
    """Load a saved model; returns (model, fingerprint). With `verify`, the stored fingerprint
    must match the one recomputed from the loaded bytes (catches corruption)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    d = Path(directory)
    cfg = read_config(d)
    wpath = d / WEIGHTS_FILE
    if not wpath.is_file():
        raise WeightsError(f"no {WEIGHTS_FILE} in {directory}")
    try:
        with safe_open(str(wpath), framework="pt") as f:
            stored_fp = (f.metadata() or {}).get("fingerprint")
        state = load_file(str(wpath))
    except Exception as e:  # safetensors raises its own error types for bad files
        raise WeightsError(f"cannot read {wpath}: {e}") from e
    file_fp = fingerprint_state(cfg, state)
    if verify and stored_fp is not None and stored_fp != file_fp:
        raise WeightsError(f"{wpath}: stored fingerprint {stored_fp[:16]}... != recomputed {file_fp[:16]}...")
    dt = torch_dtype(dtype or cfg.dtype)
    with torch.device("meta"):
        model = HybridDecoder(cfg)
    model = model.to_empty(device=device)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise WeightsError(f"{wpath} does not match its config: {e}") from e
    if missing or unexpected:
        raise WeightsError(f"{wpath} does not match its config: missing {missing}, unexpected {unexpected}")
    model.to(dtype=dt)
    model.eval()
    fp = file_fp if all(t.dtype == dt for t in state.values()) else fingerprint(model)
    return model, fp


# --------------------------------------------------------------------------- load_model


def load_model(preset_or_dir: str | os.PathLike, device: torch.device | str = "cpu",
               dtype: torch.dtype | str | None = None, models_root: str | os.PathLike | None = None,
               seed: int | None = None) -> LoadedModel:
    """A Hugging Face checkpoint directory -> the model it holds (engine/models/hf/). A
    directory with our config.json -> its weights. A preset name -> its trained weights under
    `<models_root>/<name>/` when they exist, else the preset initialised from its seed.
    `LoadedModel.source` says which happened."""
    from engine.models.presets import get_preset

    from engine.models.hf import is_hf_checkpoint, load_hf_model

    path = Path(preset_or_dir)
    if is_hf_checkpoint(path):
        return load_hf_model(path, device, dtype)
    if path.is_dir() and (path / CONFIG_FILE).is_file():
        model, fp = load_weights(path, device, dtype)
        return LoadedModel(model, model.config, f"weights:{path}", fp)
    cfg = get_preset(str(preset_or_dir))
    root = Path(models_root) if models_root is not None else default_models_root()
    trained = root / cfg.name
    if (trained / WEIGHTS_FILE).is_file() and seed is None:
        model, fp = load_weights(trained, device, dtype)
        return LoadedModel(model, model.config, f"weights:{trained}", fp)
    model = build_model(cfg, device, dtype, seed)
    seed = cfg.init_seed if seed is None else seed
    fp = fingerprint_init(cfg, seed, INIT_RECIPE, model.dtype, model.device)
    return LoadedModel(model, cfg, f"init:seed={seed}", fp)
