"""Model FLOPs of a config for tools/bench_models.py's MFU: every projection (nn.Linear,
counted from the modules built on the meta device), the active experts only (top-k of
each MoE layer plus its shared expert and router), short convs, the LM head once per
prompt; attention 2*H*hd*T^2 per full layer (4*H*hd*T*min(T, window) per sliding-window
layer); linear layers (4|6)*dk*dv per token and value head plus their chunk terms."""
from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True)
class FlopModel:
    """Per-token and per-prompt FLOPs of one config (see the module docstring)."""

    dense_per_token: int  # every projection, active experts, convs; no LM head
    lm_head_per_row: int
    full_layers_heads_dim: int  # sum over full layers of heads x head_dim
    swa_terms: list  # (heads x head_dim, window) per sliding-window layer
    linear_per_token: int  # state update + read-out, all linear layers
    linear_chunk_terms: int  # sum over linear layers of v_heads x (dk + dv)
    chunk: int

    def prefill(self, length: int) -> dict[str, float]:
        dense = self.dense_per_token * length + self.lm_head_per_row
        attn = 2 * self.full_layers_heads_dim * length ** 2
        attn += sum(4 * hd * length * min(length, w) for hd, w in self.swa_terms)
        lin = self.linear_per_token * length + self.linear_chunk_terms * self.chunk * length
        return {"dense": float(dense), "attention": float(attn), "linear": float(lin),
                "total": float(dense + attn + lin)}


def flop_model(cfg) -> FlopModel:
    import torch
    from torch import nn

    from engine.models.config import FULL, GDN, KDA, LINEAR_KINDS, SWA
    from engine.models.decoder import HybridDecoder
    from engine.models.layers.moe import SparseMoE

    with torch.device("meta"):
        model = HybridDecoder(cfg)

    def linears(module) -> int:
        return sum(2 * m.in_features * m.out_features for m in module.modules() if isinstance(m, nn.Linear))

    def convs(module) -> int:
        return sum(2 * m.weight.numel() for m in module.modules() if type(m).__name__ == "ShortConv")

    dense = 0
    for block in model.blocks:
        dense += linears(block.mixer) + convs(block.mixer)
        mlp = block.mlp
        if isinstance(mlp, SparseMoE):
            per_expert = (mlp.experts_gate_up[0].numel() + mlp.experts_down[0].numel()) * 2
            dense += linears(mlp.router) + mlp.top_k * per_expert
            dense += (linears(mlp.shared) if mlp.shared is not None else 0)
            dense += (linears(mlp.shared_gate) if mlp.shared_gate is not None else 0)
        elif mlp is not None:
            dense += linears(mlp)
    a, lin = cfg.attention, cfg.linear
    n_full = len(cfg.layer_indices(FULL))
    swa = [(a.num_heads * a.head_dim, a.sliding_window) for _ in cfg.layer_indices(SWA)]
    lin_tok, lin_chunk = 0, 0
    for kind in cfg.layers:
        if kind in LINEAR_KINDS:
            lin_tok += (6 if kind in (GDN, KDA) else 4) * lin.num_v_heads * lin.key_dim * lin.value_dim
            lin_chunk += lin.num_v_heads * (lin.key_dim + lin.value_dim)
    return FlopModel(dense_per_token=dense, lm_head_per_row=2 * cfg.hidden_size * cfg.vocab_size,
                     full_layers_heads_dim=n_full * a.num_heads * a.head_dim, swa_terms=swa,
                     linear_per_token=lin_tok, linear_chunk_terms=lin_chunk, chunk=lin.chunk_size)
