"""Pieces every architecture converter shares: RoPE settings, the zero-centred norm
conversion, gated-MLP and mixture-of-experts weights, and the `Conversion` record a
converter returns."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.errors import UnsupportedConfigError, WeightsError
from engine.models.config import ModelConfig
from engine.models.hf.checkpoint import CheckpointTensors
from engine.models.hf.fields import ConfigFields


@dataclass
class Conversion:
    """A checkpoint mapped onto the engine: its ModelConfig and the HybridDecoder state dict
    (float32 or the checkpoint's dtype; the loader casts). `notes` are log lines (parts of
    the checkpoint skipped on purpose)."""

    config: ModelConfig
    state: dict[str, torch.Tensor]
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Rope:
    theta: float
    rotary_dim: int
    linear_factor: float = 1.0


def rope_settings(params: dict, head_dim: int, where: str, allow_linear: bool = False,
                  extra_ok: tuple[str, ...] = (), default_partial: float = 1.0) -> Rope:
    """One `rope_parameters` dict (transformers >= 5) -> Rope. Types: `default` (and `linear`
    when allowed); any other key is refused unless listed in `extra_ok`.
    `default_partial`: the architecture's partial_rotary_factor when the dict has none."""
    f = ConfigFields(params, where)
    kind = f.expect("rope_type", "default", *(("linear",) if allow_linear else ()))
    theta = float(f.get("rope_theta", 10000.0))
    partial = float(f.get("partial_rotary_factor", default_partial))
    factor = float(f.get("factor", 1.0)) if kind == "linear" else 1.0
    f.ignore(extra_ok)
    f.finish()
    rotary = int(head_dim * partial)
    if rotary % 2 or rotary > head_dim:
        raise UnsupportedConfigError(f"{where}: partial_rotary_factor={partial} gives an odd rotary dim {rotary}")
    return Rope(theta, rotary, factor)


def layer_kinds(fields: ConfigFields, types: list, num_layers: int, kinds: dict[str, str]) -> list[str]:
    """The engine's layer kind of each entry of a config's `layer_types` (via `kinds`),
    refusing a list of the wrong length or an unsupported type by name."""
    if len(types) != num_layers:
        raise UnsupportedConfigError(f"{fields.where}: layer_types has {len(types)} entries, "
                                     f"num_hidden_layers={num_layers}")
    out = []
    for i, t in enumerate(types):
        if t not in kinds:
            raise UnsupportedConfigError(f"{fields.where}: layer_types[{i}]={t!r} is not supported")
        out.append(kinds[t])
    return out


def legacy_rope_parameters(fields: ConfigFields) -> dict:
    """`rope_parameters`, or the pre-5 spelling (rope_theta, partial_rotary_factor,
    rope_scaling) folded into that form."""
    if fields.has("rope_parameters"):
        fields.ignore(("rope_theta", "partial_rotary_factor", "rope_scaling"))
        return dict(fields.get("rope_parameters"))
    params: dict = {"rope_type": "default"}
    if fields.has("rope_theta"):
        params["rope_theta"] = fields.get("rope_theta")
    if fields.has("partial_rotary_factor"):
        params["partial_rotary_factor"] = fields.get("partial_rotary_factor")
    scaling = fields.get("rope_scaling", None)
    if scaling:
        params.update(scaling)
        params["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
        params.pop("type", None)
    return params


def centred(w: torch.Tensor) -> torch.Tensor:
    """A zero-centred RMSNorm weight (output `x_hat * (1 + w)`, Qwen3-Next / Gemma) as the
    plain weight our RMSNorm multiplies by, computed in float32."""
    return 1.0 + w.to(torch.float32)


def dense_mlp(t: CheckpointTensors, src: str, dst: str, state: dict[str, torch.Tensor]) -> None:
    """HF gate_proj / up_proj / down_proj under `src` -> our `gate_up` / `down` under `dst`."""
    state[f"{dst}.gate_up.weight"] = torch.cat([t.take(f"{src}.gate_proj.weight"), t.take(f"{src}.up_proj.weight")])
    state[f"{dst}.down.weight"] = t.take(f"{src}.down_proj.weight")


def moe_experts(t: CheckpointTensors, src: str, dst: str, num_experts: int, state: dict[str, torch.Tensor],
                names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
    """Experts under `src.experts`, per expert (`experts.<e>.<gate>.weight`, ..., the hub
    layout; `names` = the gate, up and down projections' names) or fused
    (`experts.gate_up_proj [E, 2I, D]`, `experts.down_proj [E, D, I]`) -> our
    `experts_gate_up` / `experts_down` under `dst`."""
    if f"{src}.experts.gate_up_proj" in t:
        state[f"{dst}.experts_gate_up"] = t.take(f"{src}.experts.gate_up_proj")
        state[f"{dst}.experts_down"] = t.take(f"{src}.experts.down_proj")
        return
    gate, up, down_name = names
    gate_up, down = [], []
    for e in range(num_experts):
        p = f"{src}.experts.{e}"
        gate_up.append(torch.cat([t.take(f"{p}.{gate}.weight"), t.take(f"{p}.{up}.weight")]))
        down.append(t.take(f"{p}.{down_name}.weight"))
    state[f"{dst}.experts_gate_up"] = torch.stack(gate_up)
    state[f"{dst}.experts_down"] = torch.stack(down)


def take_ends(t: CheckpointTensors, state: dict[str, torch.Tensor], tie_embeddings: bool, embed: str, norm: str,
              norm_fn=None) -> None:
    """The embedding (`embed`), the final norm (`norm`, through `norm_fn` when given) and the
    head into `state`; a tied head saved in the checkpoint anyway is taken and dropped (the
    embedding serves)."""
    state["embed.weight"] = t.take(embed)
    w = t.take(norm)
    state["norm.weight"] = norm_fn(w) if norm_fn is not None else w
    if not tie_embeddings:
        state["lm_head.weight"] = t.take("lm_head.weight")
    elif "lm_head.weight" in t:
        t.take("lm_head.weight")


def check_all_used(t: CheckpointTensors) -> None:
    left = t.unused()
    if left:
        more = f" (and {len(left) - 5} more)" if len(left) > 5 else ""
        raise WeightsError(f"{t.directory}: tensors this engine does not map: {', '.join(left[:5])}{more}")
