"""Token sampling and stop conditions.

- `SamplingParams`: temperature (0 = greedy), top-p, top-k, seed, max_new_tokens, stop token
  ids, stop strings, ignore_eos.
- `sample(logits [B, V], params, generators)`: one token per row; greedy rows take the
  argmax, others sample from softmax(logits / T) restricted to top-k and the top-p nucleus,
  drawing with the row's own `torch.Generator` (seeded per request: `make_generator`), so a
  request's output does not depend on what it was batched with.
- `check_stop(...)`: the finish reason after a token, OpenAI style ("stop" | "length").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engine.errors import ConfigError

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p={self.top_p} must lie in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k} must be >= 0")
        if self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens} must be >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if any(not s for s in self.stop_strings):
            raise ConfigError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator seeded from `params.seed` (None for greedy or unseeded requests, which then
    draw from torch's global generator)."""
    if params.greedy or params.seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(params.seed)
    return g


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Row logits `[V]` -> probabilities `[V]` after temperature, top-k and top-p (the smallest
    set of most likely tokens whose mass reaches top_p; the top token always stays)."""
    scaled = logits.to(torch.float32) / temperature
    if 0 < top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of strictly more likely tokens
        drop = before >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
        probs = probs / probs.sum()
    return probs


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None] | None = None) -> torch.Tensor:
    """logits `[B, V]` -> token ids `[B]` (long, on logits' device)."""
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ConfigError(f"sample needs logits [B, V] with B == len(params)={len(params)}, got {tuple(logits.shape)}")
    generators = generators if generators is not None else [None] * len(params)
    out = torch.argmax(logits, dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = filter_logits(logits[i], p.temperature, p.top_k, p.top_p)
        out[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    return out


def find_stop_string(text: str, stop_strings: Sequence[str], search_from: int = 0) -> int | None:
    """Index in `text` of the earliest stop string starting at or after `search_from`."""
    hits = [i for s in stop_strings if (i := text.find(s, search_from)) >= 0]
    return min(hits) if hits else None


def check_stop(params: SamplingParams, token_id: int, num_generated: int, eos_id: int | tuple[int, ...] | None,
               text: str | None = None, total_tokens: int | None = None,
               max_total_tokens: int | None = None) -> str | None:
    """Finish reason after appending `token_id` (the `num_generated`-th new token), or None.
    "stop": EOS (`eos_id`: one id or the tokenizer's stop ids; unless ignore_eos), a stop token id, or a stop string in `text`;
    "length": max_new_tokens reached, or the context limit `max_total_tokens`."""
    eos_ids = (eos_id,) if isinstance(eos_id, int) else (eos_id or ())
    if (token_id in eos_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
        return FINISH_STOP
    if text is not None and params.stop_strings and find_stop_string(text, params.stop_strings) is not None:
        return FINISH_STOP
    if num_generated >= params.max_new_tokens:
        return FINISH_LENGTH
    if max_total_tokens is not None and total_tokens is not None and total_tokens >= max_total_tokens:
        return FINISH_LENGTH
    return None
