"""Reference model of Ring-linear-2.0 (`BailingMoeLinearV2ForCausalLM`, model_type
`bailing_moe_linear`; Ring-mini-linear-2.0 / Ring-flash-linear-2.0) in plain torch, for
the parity tests of engine/models/hf/bailing.py.

This is a transcription, not the published file: the published modelling code
(`modeling_bailing_moe_linear_v2.py`, remote code on the Hugging Face hub) was not
reachable here. It is transcribed from two public ports of that code, cross-checked
detail by detail:
- SGLang, `python/sglang/srt/models/bailing_moe_linear.py` (Apache-2.0), and
- mlx-lm, `mlx_lm/models/bailing_moe_linear.py` (MIT, Copyright 2025 Apple Inc.),
with the decay-slope formula as write-ups of the published code quote it and mlx-lm's
first port has it (`-build_slope_tensor(H) * (1 - (layer_idx - 1) / (num_hidden_layers -
1) + 1e-5)`); the current mlx-lm clamps `layer_idx - 1` at 0, and vLLM's / SGLang's
serving kernels use `layer_idx` (the MiniMax form): the published, unclamped form is
used here. Where the ports disagree (layer
counts that are not a multiple of `layer_group_size`, `head_dim` not spanning
`hidden_size`) the engine refuses the config; this reference does not model those.

No fla and no custom kernels: the linear attention is the plain token-by-token
recurrence `S_t = exp(slope_h) S_{t-1} + k_t^T v_t`, `o_t = (q_t * head_dim^-0.5) S_t`;
softmax attention is an explicit masked softmax; the MoE loops over experts.

`BailingMoeLinearV2Config(**fields)` holds the published config's fields;
`BailingMoeLinearV2ForCausalLM(config)` the model (tensor names as the real
checkpoint's); `save_pretrained(model, directory, max_shard_size)` writes config.json
(model_type bailing_moe_linear) and one safetensors file or an index with shards.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

DEFAULTS = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=600000.0,
    partial_rotary_factor=0.5, rope_scaling=None, use_qk_norm=True, use_bias=False, use_qkv_bias=False,
    norm_head=False, norm_softmax=False, use_rmsnorm=True, hidden_act="silu", tie_word_embeddings=False,
    layer_group_size=3, group_norm_size=2, linear_silu=False, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=16, num_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True,
    score_function="sigmoid", moe_router_enable_expert_bias=True, n_group=4, topk_group=2,
    routed_scaling_factor=2.5, initializer_range=0.02, pad_token_id=0, eos_token_id=1, torch_dtype="float32",
)


class BailingMoeLinearV2Config:
    model_type = "bailing_moe_linear"

    def __init__(self, **fields) -> None:
        unknown = set(fields) - set(DEFAULTS)
        if unknown:
            raise TypeError(f"unknown config fields {sorted(unknown)}")
        for k, v in {**DEFAULTS, **fields}.items():
            setattr(self, k, v)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in DEFAULTS}
        d.update(model_type=self.model_type, architectures=["BailingMoeLinearV2ForCausalLM"])
        return d


class BailingMoeV2RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class BailingMoeV2GroupRMSNorm(nn.Module):
    """RMSNorm within each of `group_norm_size` groups of the channels (weight over all)."""

    def __init__(self, hidden_size: int, group_norm_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_norm_size = group_norm_size
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        shape = hidden_states.shape
        hidden_states = hidden_states.to(torch.float32).view(*shape[:-1], self.group_norm_size, -1)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.view(shape).to(input_dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class BailingMoeV2RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE over the first `rotary_dim` dims of a head."""

    def __init__(self, rotary_dim: int, base: float) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x `[B, T, H, D]`, positions `[T]`."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]
        rot, rest = x[..., : self.rotary_dim].float(), x[..., self.rotary_dim:]
        rot = rot * cos + rotate_half(rot) * sin
        return torch.cat((rot.to(x.dtype), rest), dim=-1)


def rotary_dim_of(config: BailingMoeLinearV2Config, head_dim: int) -> int:
    return int(head_dim * config.partial_rotary_factor)


class BailingMoeV2MLP(nn.Module):
    def __init__(self, config: BailingMoeLinearV2Config, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class BailingMoeV2Gate(nn.Module):
    """Sigmoid scores, expert bias for the choice only, group-limited top-k."""

    def __init__(self, config: BailingMoeLinearV2Config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.routed_scaling_factor = config.routed_scaling_factor
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(self.num_experts))

    def group_limited_topk(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = scores.shape[0]
        group_scores = scores.view(num_tokens, self.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (group_mask.unsqueeze(-1).expand(num_tokens, self.n_group, self.num_experts // self.n_group)
                      .reshape(num_tokens, -1))
        masked_scores = scores.masked_fill(~score_mask.bool(), float("-inf"))
        return torch.topk(masked_scores, k=self.top_k, dim=-1)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
        scores = torch.sigmoid(logits.float()).type_as(logits)
        scores_for_routing = scores + self.expert_bias
        _, topk_idx = self.group_limited_topk(scores_for_routing)
        scores = torch.gather(scores, dim=1, index=topk_idx).type_as(logits)
        if self.top_k > 1 and self.norm_topk_prob:
            topk_weight = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            topk_weight = scores
        return topk_idx, topk_weight * self.routed_scaling_factor


class BailingMoeV2SparseMoeBlock(nn.Module):
    def __init__(self, config: BailingMoeLinearV2Config) -> None:
        super().__init__()
        self.gate = BailingMoeV2Gate(config)
        self.experts = nn.ModuleList(BailingMoeV2MLP(config, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))
        self.shared_experts = (BailingMoeV2MLP(config, config.moe_intermediate_size * config.num_shared_experts)
                               if config.num_shared_experts else None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        flat = hidden_states.view(-1, shape[-1])
        topk_idx, topk_weight = self.gate(flat)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, which = (topk_idx == e).nonzero(as_tuple=True)
            if rows.numel():
                out.index_add_(0, rows, expert(flat[rows]) * topk_weight[rows, which, None].to(flat.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)


class BailingMoeV2Attention(nn.Module):
    """Softmax attention (GQA) with q/k RMSNorm and partial RoPE."""

    def __init__(self, config: BailingMoeLinearV2Config) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim or config.hidden_size // self.num_heads
        self.scale = self.head_dim ** -0.5
        self.query_key_value = nn.Linear(config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim,
                                         bias=False)
        self.dense = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.use_qk_norm = config.use_qk_norm
        if self.use_qk_norm:
            self.query_layernorm = BailingMoeV2RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.key_layernorm = BailingMoeV2RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = BailingMoeV2RotaryEmbedding(rotary_dim_of(config, self.head_dim), config.rope_theta)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: dict) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.query_key_value(x).view(b, t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=2)
        if self.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q, k = self.rotary_emb(q, positions), self.rotary_emb(k, positions)
        if "k" in cache:
            k, v = torch.cat([cache["k"], k], dim=1), torch.cat([cache["v"], v], dim=1)
        cache["k"], cache["v"] = k, v
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * self.scale
        key_pos = torch.arange(k.shape[1])
        scores = scores.masked_fill(key_pos[None, :] > positions[:, None], float("-inf"))
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.float()).to(x.dtype)
        return self.dense(out.reshape(b, t, -1))


class BailingMoeV2LinearAttention(nn.Module):
    """Lightning (scalar-decay) linear attention with RoPE, q/k norm and a gated group norm."""

    def __init__(self, config: BailingMoeLinearV2Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim or config.hidden_size // self.num_heads
        self.scale = self.head_dim ** -0.5
        self.linear_silu = config.linear_silu
        self.query_key_value = nn.Linear(config.hidden_size, 3 * self.num_heads * self.head_dim, bias=False)
        self.dense = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.g_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.g_norm = BailingMoeV2GroupRMSNorm(self.num_heads * self.head_dim, config.group_norm_size,
                                               eps=config.rms_norm_eps)
        self.use_qk_norm = config.use_qk_norm
        if self.use_qk_norm:
            self.query_layernorm = BailingMoeV2RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.key_layernorm = BailingMoeV2RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = BailingMoeV2RotaryEmbedding(rotary_dim_of(config, self.head_dim), config.rope_theta)
        self.slope = -self.build_slope_tensor(self.num_heads) * (
            1 - (self.layer_idx - 1) / (config.num_hidden_layers - 1) + 1e-5)

    @staticmethod
    def build_slope_tensor(n_attention_heads: int) -> torch.Tensor:
        def get_slopes(n):
            def get_slopes_power_of_2(n):
                start = 2 ** (-(2 ** -(math.log2(n) - 3)))
                ratio = start
                return [start * ratio ** i for i in range(n)]

            if math.log2(n).is_integer():
                return get_slopes_power_of_2(n)
            closest_power_of_2 = 2 ** math.floor(math.log2(n))
            return (get_slopes_power_of_2(closest_power_of_2)
                    + get_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2])

        return torch.tensor(get_slopes(n_attention_heads), dtype=torch.float32)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: dict) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.query_key_value(x)
        if self.linear_silu:
            qkv = F.silu(qkv)
        q, k, v = qkv.view(b, t, 3 * self.num_heads, self.head_dim).split([self.num_heads] * 3, dim=2)
        if self.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q, k = self.rotary_emb(q, positions), self.rotary_emb(k, positions)
        q = q.float() * self.scale
        decay = self.slope.exp()[None, :, None, None]  # [1, H, 1, 1]
        state = cache.get("state", torch.zeros(b, self.num_heads, self.head_dim, self.head_dim))
        outs = []
        for i in range(t):
            kv = k[:, i].float()[..., :, None] * v[:, i].float()[..., None, :]  # [B, H, Dk, Dv]
            state = decay * state + kv
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, i], state))
        cache["state"] = state
        o = torch.stack(outs, dim=1).to(x.dtype).reshape(b, t, -1)
        o = self.g_norm(o) * torch.sigmoid(self.g_proj(x))
        return self.dense(o)


class BailingMoeV2DecoderLayer(nn.Module):
    def __init__(self, config: BailingMoeLinearV2Config, layer_idx: int) -> None:
        super().__init__()
        is_linear = (layer_idx + 1) % config.layer_group_size != 0
        self.attention = (BailingMoeV2LinearAttention(config, layer_idx) if is_linear
                          else BailingMoeV2Attention(config))
        self.mlp = (BailingMoeV2SparseMoeBlock(config)
                    if config.num_experts and layer_idx >= config.first_k_dense_replace
                    else BailingMoeV2MLP(config, config.intermediate_size))
        self.input_layernorm = BailingMoeV2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = BailingMoeV2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: dict) -> torch.Tensor:
        h = x + self.attention(self.input_layernorm(x), positions, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class BailingMoeV2Model(nn.Module):
    def __init__(self, config: BailingMoeLinearV2Config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(BailingMoeV2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = BailingMoeV2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class BailingMoeLinearV2ForCausalLM(nn.Module):
    def __init__(self, config: BailingMoeLinearV2Config) -> None:
        super().__init__()
        self.config = config
        self.model = BailingMoeV2Model(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                            bias=False)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=g) * config.initializer_range)

    def forward(self, input_ids: torch.Tensor, cache: dict | None = None, use_cache: bool = True) -> SimpleNamespace:
        cache = cache if cache is not None else {"seen": 0, "layers": [{} for _ in self.model.layers]}
        positions = torch.arange(cache["seen"], cache["seen"] + input_ids.shape[1])
        h = self.model.word_embeddings(input_ids)
        for layer, c in zip(self.model.layers, cache["layers"]):
            h = layer(h, positions, c)
        h = self.model.norm(h)
        logits = F.linear(h, self.model.word_embeddings.weight if self.lm_head is None else self.lm_head.weight)
        cache["seen"] += input_ids.shape[1]
        return SimpleNamespace(logits=logits, cache=cache)

    def save_pretrained(self, directory: str, max_shard_size: str = "5GB") -> None:
        """transformers' signature: `max_shard_size` like "40KB" or "5GB"."""
        units = {"KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9}
        limit = int(max_shard_size[:-2]) * units[max_shard_size[-2:].upper()]
        total = sum(t.numel() * t.element_size() for t in self.checkpoint_tensors().values())
        save_pretrained(self, Path(directory), limit if total > limit else None)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The state dict under the real checkpoint's names (a tied head is not saved)."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()}


def save_pretrained(model: BailingMoeLinearV2ForCausalLM, directory: Path, max_shard_size: int | None = None) -> None:
    """config.json + model.safetensors, or (`max_shard_size` bytes per shard) shards and
    model.safetensors.index.json, as transformers' save_pretrained lays them out."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(model.config.to_dict(), indent=1))
    tensors = model.checkpoint_tensors()
    if max_shard_size is None:
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
