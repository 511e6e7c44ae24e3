"""Model configuration: the frozen dataclasses that describe a hybrid decoder, their
validation, and their canonical JSON form (the one hashed into the model fingerprint).

A model is a stack of decoder blocks; `ModelConfig.layers` names the token mixer of each
block (one entry per layer, in order):

| kind        | mixer                                              | recurrence family |
|-------------|----------------------------------------------------|-------------------|
| `full`      | global causal attention (GQA, RoPE, optional gate) | -                 |
| `swa`       | sliding-window causal attention (window w)         | -                 |
| `gdn`       | Gated DeltaNet (Qwen3-Next style)                  | `delta`           |
| `gla`       | Gated Linear Attention, per-key-dim decay          | `diag`            |
| `lightning` | lightning attention, fixed per-head decay (Ring)   | `scalar`          |
| `mamba2`    | Mamba2 SSD, data-dependent scalar decay            | `scalar`          |
| `kda`       | Kimi Delta Attention (Kimi-Linear), per-key-dim decay | `kda`          |

All linear kinds in one model share one `LinearConfig`.

The feed-forward half of each block is a gated MLP (`hidden_act`: SiLU or tanh-GELU) or,
for the layers `mlp_layers` marks `moe`, a top-k mixture of experts (`MoEConfig`, with an
optional gated shared expert). Block variants that checkpoints need (Gemma-3's norms after
the mixer and the MLP, its scaled embedding, soft-capped logits) are fields too.

Canonical form: fields added after format version 1 (`EXTENDED_FIELDS`) enter the
canonical JSON only when they differ from their defaults, so every config written before
they existed keeps its fingerprint.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from engine.errors import ConfigError

FULL = "full"
SWA = "swa"
GDN = "gdn"
GLA = "gla"
LIGHTNING = "lightning"
MAMBA2 = "mamba2"
KDA = "kda"

ATTENTION_KINDS = (FULL, SWA)
LINEAR_KINDS = (GDN, GLA, LIGHTNING, MAMBA2, KDA)
LAYER_KINDS = ATTENTION_KINDS + LINEAR_KINDS

#: recurrence family of each linear kind (see engine/models/layers/linear_ops.py)
RECURRENCE_FAMILY = {GDN: "delta", GLA: "diag", LIGHTNING: "scalar", MAMBA2: "scalar", KDA: "kda"}

CONFIG_FORMAT_VERSION = 1
DTYPES = ("float32", "bfloat16", "float16")

DENSE = "dense"
MOE = "moe"
NO_MLP = "none"
MLP_KINDS = (DENSE, MOE, NO_MLP)
HIDDEN_ACTS = ("silu", "gelu_tanh", "relu2")
MAMBA_NORMS = ("head", "group")
MOE_SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class AttentionConfig:
    """Shapes of the full and sliding-window attention layers."""

    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    #: RoPE is applied to the first `rotary_dim` dims of each head (0: no RoPE).
    rotary_dim: int = 32
    rope_theta: float = 10000.0
    #: RoPE base of sliding-window layers (Gemma-3 uses a smaller local base); None: rope_theta.
    swa_rope_theta: float | None = None
    #: window w of `swa` layers: a token attends to itself and the w-1 tokens before it.
    sliding_window: int | None = None
    #: Qwen3-Next-style sigmoid output gate (q_proj emits the gate beside the queries).
    output_gate: bool = False
    #: per-head RMSNorm of q and k before RoPE (Qwen3 / Gemma-3).
    qk_norm: bool = False
    #: softmax scale is `query_scale ** -0.5` (Gemma-3's query_pre_attn_scalar); None: head_dim.
    query_scale: float | None = None
    #: linear RoPE scaling of full-attention layers (positions divided by this factor).
    rope_linear_factor: float = 1.0
    #: multi-head latent attention (DeepSeek-V2 MLA, as Kimi-Linear and Ling 3 use it) when
    #: > 0: keys and values come from a `mla_kv_lora_rank` latent (RMSNorm, then up-projected
    #: per head) plus a `mla_rope_dim` key part shared by all heads; queries from `q_proj` or,
    #: with `mla_q_lora_rank` > 0, a normed low-rank pair. Each head's K is laid out
    #: [shared part | per-head part `mla_nope_dim` | zeros] and V as [`mla_v_dim` | zeros] in
    #: `head_dim` = max(rope + nope, v) (the expanded K/V are what the caches hold);
    #: `rotary_dim` is 0 (NoPE, Kimi-Linear) or `mla_rope_dim` (RoPE on the shared part).
    mla_kv_lora_rank: int = 0
    mla_q_lora_rank: int = 0
    mla_nope_dim: int = 0
    mla_rope_dim: int = 0
    mla_v_dim: int = 0
    #: MLA: a per-head sigmoid output gate `sigmoid(g_proj(x))` (Ling 3's bailing_hybrid).
    mla_head_gate: bool = False

    def validate(self, needs_window: bool) -> None:
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise ConfigError(f"attention heads/dims must be positive, got {self}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if not 0 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ConfigError(
                f"rotary_dim={self.rotary_dim} must be even and within [0, head_dim={self.head_dim}]")
        if needs_window and (self.sliding_window is None or self.sliding_window < 1):
            raise ConfigError(f"swa layers need sliding_window >= 1, got {self.sliding_window}")
        if self.query_scale is not None and self.query_scale <= 0:
            raise ConfigError(f"query_scale={self.query_scale} must be positive")
        if self.rope_linear_factor <= 0:
            raise ConfigError(f"rope_linear_factor={self.rope_linear_factor} must be positive")
        if self.mla_kv_lora_rank:
            self._validate_mla()

    def _validate_mla(self) -> None:
        qk = self.mla_nope_dim + self.mla_rope_dim
        if min(self.mla_kv_lora_rank, self.mla_v_dim, qk) <= 0 or self.mla_q_lora_rank < 0:
            raise ConfigError(f"mla ranks/dims must be positive, got kv_lora_rank={self.mla_kv_lora_rank}, "
                              f"qk dims={qk}, v_dim={self.mla_v_dim}, q_lora_rank={self.mla_q_lora_rank}")
        if self.num_kv_heads != self.num_heads:
            raise ConfigError(f"mla expands K/V per head: num_kv_heads={self.num_kv_heads} must equal "
                              f"num_heads={self.num_heads}")
        if self.head_dim != max(qk, self.mla_v_dim):
            raise ConfigError(f"mla head_dim={self.head_dim} must be max(nope + rope, v) = {max(qk, self.mla_v_dim)}")
        if self.rotary_dim not in (0, self.mla_rope_dim):
            raise ConfigError(f"mla rotary_dim={self.rotary_dim} must be 0 (NoPE) or mla_rope_dim={self.mla_rope_dim}")
        if self.output_gate or self.qk_norm:
            raise ConfigError("mla takes neither output_gate nor qk_norm")

    @property
    def is_mla(self) -> bool:
        return self.mla_kv_lora_rank > 0

    @property
    def softmax_scale(self) -> float:
        return (self.query_scale if self.query_scale is not None else self.head_dim) ** -0.5


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts MLP of the layers `ModelConfig.mlp_layers` marks `moe`.

    Router: `softmax` over all experts, the top `top_k` kept (renormalised to sum 1 when
    `norm_topk_prob`), as Qwen3-Next / Qwen3.5-MoE route. Each expert is a gated MLP of
    width `intermediate_size`; a shared expert of width `shared_intermediate_size` (0: none)
    is added to every token, scaled by `sigmoid(shared_gate(x))` when `shared_expert_gate`.
    """

    num_experts: int = 0
    top_k: int = 1
    intermediate_size: int = 0
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    norm_topk_prob: bool = True
    #: router scores: `softmax` over the experts, or `sigmoid` per expert (Ring-linear),
    #: computed in float32 from a float32 router product.
    scoring: str = "softmax"
    #: a per-expert bias (`router_bias`) added to the scores only to pick the experts; the
    #: weights are the unbiased scores (Ring-linear's `expert_bias`).
    expert_bias: bool = False
    #: group-limited top-k: the experts form `num_groups` groups, a group's score is the sum
    #: of its two best (biased) scores, and only the best `topk_groups` groups are eligible.
    num_groups: int = 1
    topk_groups: int = 1
    #: the chosen experts' weights (after the top_k renormalisation) are multiplied by this.
    routed_scaling_factor: float = 1.0

    def validate(self) -> None:
        if self.num_experts < 1 or self.intermediate_size < 1:
            raise ConfigError(
                f"moe layers need num_experts >= 1 and intermediate_size >= 1, got {self.num_experts}, "
                f"{self.intermediate_size}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"moe top_k={self.top_k} must lie in [1, num_experts={self.num_experts}]")
        if self.shared_intermediate_size < 0:
            raise ConfigError(f"moe shared_intermediate_size={self.shared_intermediate_size} must be >= 0")
        if self.scoring not in MOE_SCORINGS:
            raise ConfigError(f"moe scoring={self.scoring!r} must be one of {MOE_SCORINGS}")
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ConfigError(f"moe num_groups={self.num_groups} must divide num_experts={self.num_experts}")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ConfigError(f"moe topk_groups={self.topk_groups} must lie in [1, num_groups={self.num_groups}]")
        if self.num_groups > 1 and self.num_experts // self.num_groups < 2:
            raise ConfigError(f"moe num_groups={self.num_groups} leaves fewer than 2 experts per group")
        if self.num_groups > 1 and self.top_k > self.topk_groups * (self.num_experts // self.num_groups):
            raise ConfigError(f"moe top_k={self.top_k} exceeds the experts of topk_groups={self.topk_groups} groups")


@dataclass(frozen=True)
class LinearConfig:
    """Shapes of the linear-attention layers.

    `num_heads` query/key heads of size `key_dim`, `num_v_heads` value heads of size
    `value_dim` (num_v_heads a multiple of num_heads: grouped value heads, as Qwen3-Next's
    GDN; for mamba2, num_heads is the number of B/C groups, key_dim is d_state and
    value_dim is the SSM head dim). The recurrent state per slot is
    `[num_v_heads, key_dim, value_dim]` float32.
    """

    num_heads: int = 2
    num_v_heads: int = 4
    key_dim: int = 32
    value_dim: int = 32
    #: short causal depthwise conv width (0: no conv). gdn and mamba2 use one; lightning and
    #: gla use one only if this is set for them (`conv_kinds`).
    conv_size: int = 4
    conv_kinds: tuple[str, ...] = (GDN, MAMBA2)
    #: chunk length of the torch chunked (parallel-within-chunk) prefill form.
    chunk_size: int = 64
    #: GLA: rank of the gate projection and the gate logit normaliser.
    gla_gate_rank: int = 16
    gla_gate_normalizer: float = 16.0
    #: mamba2 output norm: `head` (rmsnorm per head, then * silu(z)) or `group` (Nemotron-H:
    #: y * silu(z) first, then rmsnorm over each of the `num_heads` B/C groups' channels,
    #: weight over all `num_v_heads * value_dim` channels).
    mamba_norm: str = "head"
    #: mamba2: dt = max(softplus(dt_raw + dt_bias), mamba_dt_min) (Nemotron-H's time_step_min).
    mamba_dt_min: float = 0.0
    #: lightning (Ring-linear): SiLU on q, k, v (the fused projection's output).
    qkv_silu: bool = True
    #: lightning: per-head RMSNorm of q and k (weights over key_dim) before RoPE.
    qk_norm: bool = False
    #: lightning: RoPE (rotate-half, as attention) on the first `rotary_dim` dims of q and k
    #: at each token's absolute position (0: none). A segment's end state then depends on
    #: its offset: placed at offset d it is `R_d E` (R_d rotating the key dims).
    rotary_dim: int = 0
    rope_theta: float = 10000.0
    #: lightning output norm: 0 = RMSNorm per head; g > 0 = RMSNorm over each of g equal
    #: groups of all `num_v_heads * value_dim` channels (Ring-linear's group_norm_size),
    #: then times the weight and the sigmoid gate.
    norm_groups: int = 0
    #: lightning decay depth: `1 - (layer + decay_layer_offset) / (L - 1) + 1e-5` (Ring-linear's
    #: published code uses layer - 1).
    decay_layer_offset: int = 0
    #: kda forget and output gates: low rank through `key_dim` (Kimi-Linear: f_a/f_b, g_a/g_b),
    #: or full rank (Ling 3: f_proj, g_proj).
    kda_full_rank_gates: bool = False
    #: kda log decay: 0 -> `-exp(A_log) softplus(f + dt_bias)` (Kimi-Linear); a bound b < 0 ->
    #: `b * sigmoid(exp(A_log) (f + dt_bias))` (Ling 3's safe gate, kda_lower_bound).
    kda_gate_lower_bound: float = 0.0
    #: the short convs keep float32 weights and compute in float32 in a bf16/fp16 model
    #: (Ling 3's reference keeps conv1d in float32); False: the model's dtype.
    conv_float32: bool = False

    def validate(self) -> None:
        if min(self.num_heads, self.num_v_heads, self.key_dim, self.value_dim) <= 0:
            raise ConfigError(f"linear heads/dims must be positive, got {self}")
        if self.num_v_heads % self.num_heads:
            raise ConfigError(
                f"num_v_heads={self.num_v_heads} is not a multiple of num_heads={self.num_heads}")
        if self.conv_size < 0 or self.conv_size == 1:
            raise ConfigError(f"conv_size must be 0 (off) or >= 2, got {self.conv_size}")
        if self.chunk_size < 1:
            raise ConfigError(f"chunk_size must be >= 1, got {self.chunk_size}")
        for kind in self.conv_kinds:
            if kind not in LINEAR_KINDS:
                raise ConfigError(f"conv_kinds names {kind!r}, not a linear layer kind")
        if self.mamba_norm not in MAMBA_NORMS:
            raise ConfigError(f"mamba_norm={self.mamba_norm!r} must be one of {MAMBA_NORMS}")
        if self.mamba_dt_min < 0:
            raise ConfigError(f"mamba_dt_min={self.mamba_dt_min} must be >= 0")
        if not 0 <= self.rotary_dim <= self.key_dim or self.rotary_dim % 2:
            raise ConfigError(f"linear rotary_dim={self.rotary_dim} must be even and within [0, key_dim={self.key_dim}]")
        if self.kda_gate_lower_bound > 0:
            raise ConfigError(f"kda_gate_lower_bound={self.kda_gate_lower_bound} must be 0 (off) or negative")
        channels = self.num_v_heads * self.value_dim
        if self.norm_groups < 0 or (self.norm_groups and channels % self.norm_groups):
            raise ConfigError(f"linear norm_groups={self.norm_groups} must be 0 or divide {channels} channels")

    def conv_width(self, kind: str) -> int:
        """Conv width used by layers of `kind` (0 when that kind has no conv)."""
        return self.conv_size if kind in self.conv_kinds else 0


@dataclass(frozen=True)
class ModelConfig:
    """One hybrid decoder: embedding, `len(layers)` blocks (mixer + SwiGLU MLP), final
    RMSNorm, tied or untied LM head."""

    name: str = "custom"
    family: str = "custom"
    scale: str = "tiny"
    vocab_size: int = 260
    hidden_size: int = 128
    intermediate_size: int = 384
    layers: tuple[str, ...] = (GDN, GDN, GDN, FULL)
    tie_embeddings: bool = True
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    linear: LinearConfig = field(default_factory=LinearConfig)
    #: seed of the deterministic initialisation used when no trained weights exist.
    init_seed: int = 0
    #: dtype the model runs in by default ("float32" on CPU tests, "bfloat16" for bench).
    dtype: str = "float32"
    format_version: int = CONFIG_FORMAT_VERSION
    #: MLP of each layer, `dense`, `moe` or `none` (a block that is only its mixer,
    #: Nemotron-H's consecutive mixer layers); empty: all dense.
    mlp_layers: tuple[str, ...] = ()
    moe: MoEConfig = field(default_factory=MoEConfig)
    #: activation of the MLPs: `silu` (SwiGLU) or `gelu_tanh` (GeGLU, Gemma); `relu2`
    #: (squared ReLU, Nemotron-H) with `gated_mlp=False`.
    hidden_act: str = "silu"
    #: gated MLP `down(act(gate(x)) * up(x))`; False: `down(act(up(x)))`.
    gated_mlp: bool = True
    #: Gemma-3 blocks: RMSNorm on the mixer's and the MLP's outputs before their residuals.
    post_norms: bool = False
    #: the embedding's output is multiplied by this (Gemma: sqrt(hidden_size)); the tied LM
    #: head uses the unscaled table.
    embed_scale: float = 1.0
    #: logits -> cap * tanh(logits / cap) (Gemma's final_logit_softcapping); None: off.
    final_logit_softcap: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.layers, tuple):
            object.__setattr__(self, "layers", tuple(self.layers))
        if not isinstance(self.mlp_layers, tuple):
            object.__setattr__(self, "mlp_layers", tuple(self.mlp_layers))
        if not isinstance(self.linear.conv_kinds, tuple):
            object.__setattr__(self.linear, "conv_kinds", tuple(self.linear.conv_kinds))
        self.validate()

    # ------------------------------------------------------------------ queries
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def mlp_kind(self, layer_idx: int) -> str:
        """`dense`, `moe` or `none`: the MLP of layer `layer_idx`."""
        return self.mlp_layers[layer_idx] if self.mlp_layers else DENSE

    def layer_indices(self, *kinds: str) -> list[int]:
        """Indices of the layers whose kind is one of `kinds`."""
        return [i for i, k in enumerate(self.layers) if k in kinds]

    @property
    def has_attention(self) -> bool:
        return any(k in ATTENTION_KINDS for k in self.layers)

    @property
    def has_linear(self) -> bool:
        return any(k in LINEAR_KINDS for k in self.layers)

    # --------------------------------------------------------------- validation
    def validate(self) -> None:
        if not self.layers:
            raise ConfigError("layers is empty: a model needs at least one layer")
        for i, kind in enumerate(self.layers):
            if kind not in LAYER_KINDS:
                raise ConfigError(f"layers[{i}]={kind!r} is not one of {LAYER_KINDS}")
        if self.scale not in ("tiny", "bench", "custom"):
            raise ConfigError(f"scale={self.scale!r} must be 'tiny', 'bench' or 'custom'")
        if self.vocab_size < 2 or self.hidden_size < 1 or self.intermediate_size < 1:
            raise ConfigError(
                f"vocab_size={self.vocab_size}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size} must be positive")
        if self.max_position_embeddings < 1:
            raise ConfigError(f"max_position_embeddings={self.max_position_embeddings} must be >= 1")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} must be one of {DTYPES}")
        if self.has_attention:
            self.attention.validate(needs_window=SWA in self.layers)
        if self.has_linear:
            self.linear.validate()
        if self.mlp_layers:
            if len(self.mlp_layers) != len(self.layers):
                raise ConfigError(
                    f"mlp_layers has {len(self.mlp_layers)} entries for {len(self.layers)} layers")
            for i, kind in enumerate(self.mlp_layers):
                if kind not in MLP_KINDS:
                    raise ConfigError(f"mlp_layers[{i}]={kind!r} is not one of {MLP_KINDS}")
            if MOE in self.mlp_layers:
                self.moe.validate()
        if self.hidden_act not in HIDDEN_ACTS:
            raise ConfigError(f"hidden_act={self.hidden_act!r} must be one of {HIDDEN_ACTS}")
        if self.embed_scale <= 0:
            raise ConfigError(f"embed_scale={self.embed_scale} must be positive")
        if self.final_logit_softcap is not None and self.final_logit_softcap <= 0:
            raise ConfigError(f"final_logit_softcap={self.final_logit_softcap} must be positive")

    # ------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layers"] = list(self.layers)
        d["mlp_layers"] = list(self.mlp_layers)
        d["linear"]["conv_kinds"] = list(self.linear.conv_kinds)
        for key, default in EXTENDED_FIELDS.items():
            if d.get(key) == default:
                del d[key]
        for key, default in EXTENDED_ATTENTION_FIELDS.items():
            if d["attention"].get(key) == default:
                del d["attention"][key]
        for key, default in EXTENDED_LINEAR_FIELDS.items():
            if d["linear"].get(key) == default:
                del d["linear"][key]
        if "moe" in d:
            for key, default in EXTENDED_MOE_FIELDS.items():
                if d["moe"].get(key) == default:
                    del d["moe"][key]
        return d

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no whitespace): the form hashed into fingerprints."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def config_hash(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        version = d.get("format_version", CONFIG_FORMAT_VERSION)
        if version != CONFIG_FORMAT_VERSION:
            raise ConfigError(
                f"config format_version={version} is not supported (this engine reads "
                f"{CONFIG_FORMAT_VERSION})")
        try:
            attn = AttentionConfig(**d.pop("attention", {}))
            lin = d.pop("linear", {})
            if "conv_kinds" in lin:
                lin = {**lin, "conv_kinds": tuple(lin["conv_kinds"])}
            linear = LinearConfig(**lin)
            moe = MoEConfig(**d.pop("moe", {}))
            return cls(attention=attn, linear=linear, moe=moe,
                       **{**d, "layers": tuple(d.get("layers", ())), "mlp_layers": tuple(d.get("mlp_layers", ()))})
        except TypeError as e:  # unknown or missing field
            raise ConfigError(f"bad model config field: {e}") from e

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise ConfigError(f"config is not valid JSON: {e}") from e

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed (nested configs replaced whole)."""
        return dataclasses.replace(self, **changes)


#: ModelConfig fields added after format version 1, with their defaults: left out of the
#: canonical form while at the default (so older configs keep their fingerprints).
EXTENDED_FIELDS: dict[str, Any] = {
    "mlp_layers": [], "moe": dataclasses.asdict(MoEConfig()), "hidden_act": "silu", "gated_mlp": True,
    "post_norms": False,
    "embed_scale": 1.0, "final_logit_softcap": None,
}
EXTENDED_ATTENTION_FIELDS: dict[str, Any] = {
    "query_scale": None, "rope_linear_factor": 1.0,
    "mla_kv_lora_rank": 0, "mla_q_lora_rank": 0, "mla_nope_dim": 0, "mla_rope_dim": 0, "mla_v_dim": 0,
    "mla_head_gate": False,
}
EXTENDED_LINEAR_FIELDS: dict[str, Any] = {
    "mamba_norm": "head", "mamba_dt_min": 0.0, "qkv_silu": True, "qk_norm": False, "rotary_dim": 0,
    "rope_theta": 10000.0, "norm_groups": 0, "decay_layer_offset": 0, "kda_full_rank_gates": False,
    "kda_gate_lower_bound": 0.0, "conv_float32": False,
}
EXTENDED_MOE_FIELDS: dict[str, Any] = {
    "scoring": "softmax", "expert_bias": False, "num_groups": 1, "topk_groups": 1, "routed_scaling_factor": 1.0,
}
