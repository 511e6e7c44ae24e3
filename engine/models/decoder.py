"""The hybrid decoder: token embedding, one pre-norm block per entry of
`ModelConfig.layers` (mixer chosen by kind, then a gated MLP or a mixture of experts, each
with a residual; with `post_norms` each output is normalised again before its residual, as
Gemma-3), a final RMSNorm and a tied or untied LM head (logits soft-capped when the config
says so). The embedding scales its output by `embed_scale` (Gemma).

Three forwards, mirroring the mixers' (engine/models/layers/base.py):
- `forward(input_ids [B, T])`: whole sequences, no cache (training and references);
- `prefill(token_ids [n], ctx, caches)`: one chunk of one sequence, appending to its caches;
- `decode(token_ids [B], ctx, caches)`: one token for each of B sequences.
`caches[i]` is layer i's cache object (engine/cache/layer_caches.py).

`prefill` and `forward` accept `mixer_input_hook(layer_idx, h)`, called with each layer's
normalised mixer input before the mixer runs: position-independent caching uses it to get a
linear layer's per-token recurrence inputs (and so its transition operator) from one pass.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from engine.models.config import FULL, GDN, GLA, KDA, LIGHTNING, MAMBA2, MOE, NO_MLP, SWA, ModelConfig
from engine.models.layers.attention import Attention
from engine.models.layers.base import DecodeContext, PrefillContext, TokenMixer
from engine.models.layers.gated_deltanet import GatedDeltaNet
from engine.models.layers.gla import GatedLinearAttention
from engine.models.layers.kda import KimiDeltaAttention
from engine.models.layers.linear_base import LinearMixer
from engine.models.layers.mla import LatentAttention
from engine.models.layers.mlp import PlainMLP, SwiGLU
from engine.models.layers.moe import SparseMoE
from engine.models.layers.norm import RMSNorm
from engine.models.layers.scalar_decay import LightningAttention, Mamba2Mixer

MixerHook = Callable[[int, torch.Tensor], None]


def build_mixer(cfg: ModelConfig, kind: str, layer_idx: int) -> TokenMixer:
    if kind in (FULL, SWA):
        return LatentAttention(cfg, kind) if cfg.attention.is_mla else Attention(cfg, kind)
    if kind == GDN:
        return GatedDeltaNet(cfg, kind)
    if kind == GLA:
        return GatedLinearAttention(cfg, kind)
    if kind == LIGHTNING:
        return LightningAttention(cfg, kind, layer_idx)
    if kind == MAMBA2:
        return Mamba2Mixer(cfg, kind)
    if kind == KDA:
        return KimiDeltaAttention(cfg, kind)
    raise ValueError(f"layer kind {kind!r} has no mixer")


class ScaledEmbedding(nn.Embedding):
    """Token embedding whose output is multiplied by `scale` (cast to the table's dtype,
    as Gemma's scaled embedding does); scale 1 is a plain lookup."""

    def __init__(self, num: int, dim: int, scale: float = 1.0) -> None:
        super().__init__(num, dim)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = super().forward(ids)
        if self.scale != 1.0:
            x = x * torch.tensor(self.scale, dtype=self.weight.dtype, device=x.device)
        return x


class DecoderBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str, layer_idx: int) -> None:
        super().__init__()
        self.kind = kind
        self.layer_idx = layer_idx
        self.mixer_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer = build_mixer(cfg, kind, layer_idx)
        mlp_kind = cfg.mlp_kind(layer_idx)
        self.mlp_norm = None if mlp_kind == NO_MLP else RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if mlp_kind == NO_MLP:
            self.mlp = None
        elif mlp_kind == MOE:
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe, cfg.hidden_act)
        elif cfg.gated_mlp:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        else:
            self.mlp = PlainMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        self.post_mixer_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.post_norms else None
        self.post_mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.post_norms else None

    def _finish(self, x: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
        if self.post_mixer_norm is not None:
            mixed = self.post_mixer_norm(mixed)
        x = x + mixed
        if self.mlp is None:
            return x
        y = self.mlp(self.mlp_norm(x))
        if self.post_mlp_norm is not None:
            y = self.post_mlp_norm(y)
        return x + y


class HybridDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.embed_scale)
        self.blocks = nn.ModuleList(DecoderBlock(cfg, kind, i) for i, kind in enumerate(cfg.layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def mixer(self, layer_idx: int) -> TokenMixer:
        return self.blocks[layer_idx].mixer

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h)
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        out = h @ weight.t()
        cap = self.config.final_logit_softcap
        return out if cap is None else torch.tanh(out / cap) * cap

    def _check_ids(self, ids: torch.Tensor) -> None:
        """Range-check host token ids. Ids already on an accelerator are not read back (that
        would sync every step): the runner checks them on the host before moving them, and
        the embedding asserts on the device."""
        if ids.device.type != "cpu":
            return
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {self.config.vocab_size}); got min {int(ids.min())}, "
                f"max {int(ids.max())}")

    def forward(self, input_ids: torch.Tensor, backend: str = "torch",
                mixer_input_hook: MixerHook | None = None) -> torch.Tensor:
        """input_ids `[B, T]` (positions 0..T-1, zero state) -> logits `[B, T, vocab]`."""
        self._check_ids(input_ids)
        x = self.embed(input_ids)
        for block in self.blocks:
            h = block.mixer_norm(x)
            if mixer_input_hook is not None:
                mixer_input_hook(block.layer_idx, h)
            if isinstance(block.mixer, LinearMixer):
                mixed = block.mixer.forward_train(h, backend)
            else:
                mixed = block.mixer.forward_train(h)
            x = block._finish(x, mixed)
        return self.logits(x)

    def prefill(self, token_ids: torch.Tensor, ctx: PrefillContext, caches: Sequence,
                all_logits: bool = False, mixer_input_hook: MixerHook | None = None) -> torch.Tensor:
        """token_ids `[n]` at `ctx.positions` -> logits of the last token `[vocab]`
        (or of every token `[n, vocab]` with `all_logits`)."""
        self._check_ids(token_ids)
        x = self.embed(token_ids)
        for block, cache in zip(self.blocks, caches):
            h = block.mixer_norm(x)
            if mixer_input_hook is not None:
                mixer_input_hook(block.layer_idx, h)
            x = block._finish(x, block.mixer.forward_prefill(h, ctx, cache))
        return self.logits(x if all_logits else x[-1])

    def decode(self, token_ids: torch.Tensor, ctx: DecodeContext, caches: Sequence) -> torch.Tensor:
        """token_ids `[B]` at `ctx.positions` -> logits `[B, vocab]`."""
        self._check_ids(token_ids)
        x = self.embed(token_ids)
        for block, cache in zip(self.blocks, caches):
            x = block._finish(x, block.mixer.forward_decode(block.mixer_norm(x), ctx, cache))
        return self.logits(x)
