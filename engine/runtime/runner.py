"""`ModelRunner`: executes one model over the caches of a `CacheManager`.

- `prefill(seq, token_ids, start_pos)` runs one chunk of one sequence at positions
  `start_pos .. start_pos+n-1` (start_pos must equal `seq.num_computed_tokens`), appends it
  to the sequence's caches and returns the last token's logits `[vocab]` (every token's
  `[n, vocab]` with `all_logits=True`). Chunked prefill is successive calls.
- `decode(seqs, last_tokens)` feeds one token to each of B sequences of any lengths (each at
  its own position `num_computed_tokens`) and returns logits `[B, vocab]`.

Both advance `seq.num_computed_tokens`. Blocks are allocated on demand; a full pool raises
`CacheFullError` before anything is written. Linear layers run through fla's kernels when
`backend` resolves to "fla" (CUDA + fla-core importable), else through the torch forms;
attention runs through torch SDPA either way.
"""
from __future__ import annotations

from typing import Sequence as Seq

import torch

from engine.cache.manager import CacheManager
from engine.errors import RuntimeStateError
from engine.models.decoder import HybridDecoder, MixerHook
from engine.models.layers.base import DecodeContext, PrefillContext
from engine.models.layers.fla_backend import resolve_backend
from engine.runtime.sequence import Sequence


class ModelRunner:
    def __init__(self, model: HybridDecoder, cache: CacheManager, backend: str = "auto") -> None:
        self.model = model.eval()
        self.cache = cache
        self.device = model.device
        self.backend = resolve_backend(backend, self.device)
        self.max_positions = model.config.max_position_embeddings

    def _ids(self, token_ids) -> torch.Tensor:
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        return ids.to(self.device)

    @torch.inference_mode()
    def prefill(self, seq: Sequence, token_ids: Seq[int] | torch.Tensor, start_pos: int | None = None,
                all_logits: bool = False, mixer_input_hook: MixerHook | None = None) -> torch.Tensor:
        """One chunk at positions start_pos.. (see module docstring). `mixer_input_hook(layer,
        h)` sees each layer's normalised input (PIC uses it for linear transition operators)."""
        ids = self._ids(token_ids)
        if ids.dim() != 1 or ids.numel() == 0:
            raise RuntimeStateError(f"prefill takes a non-empty 1-D chunk of token ids, got shape {tuple(ids.shape)}")
        start = seq.num_computed_tokens if start_pos is None else start_pos
        if start != seq.num_computed_tokens:
            raise RuntimeStateError(
                f"prefill of {seq.seq_id!r} at start_pos={start_pos}, but its caches hold "
                f"{seq.num_computed_tokens} tokens (chunks must be contiguous)")
        end = start + ids.numel()
        if end > self.max_positions:
            raise RuntimeStateError(
                f"sequence {seq.seq_id!r} would reach {end} tokens > max_position_embeddings={self.max_positions}")
        self.cache.ensure_capacity(seq, end)
        ctx = PrefillContext(
            start_pos=start,
            positions=torch.arange(start, end, device=self.device),
            slot=seq.slot,
            write_slots=self.cache.flat_slots(seq, start, end),
            context_slots=self.cache.flat_slots(seq, 0, end) if start > 0 else None,
            backend=self.backend,
        )
        logits = self.model.prefill(ids, ctx, self.cache.layers, all_logits=all_logits,
                                    mixer_input_hook=mixer_input_hook)
        seq.num_computed_tokens = end
        return logits

    @torch.inference_mode()
    def decode(self, seqs: Seq[Sequence], last_tokens: Seq[int] | torch.Tensor) -> torch.Tensor:
        ids = self._ids(last_tokens).reshape(-1)
        if not seqs or ids.numel() != len(seqs):
            raise RuntimeStateError(f"decode needs one token per sequence: {len(seqs)} sequences, {ids.numel()} tokens")
        if len({id(s) for s in seqs}) != len(seqs):
            raise RuntimeStateError("decode batch holds the same sequence twice")
        positions = [s.num_computed_tokens for s in seqs]
        for s, p in zip(seqs, positions):
            if p + 1 > self.max_positions:
                raise RuntimeStateError(
                    f"sequence {s.seq_id!r} would reach {p + 1} tokens > max_position_embeddings={self.max_positions}")
            if not s.is_allocated:
                raise RuntimeStateError(f"sequence {s.seq_id!r} holds no cache slot")
        for s, p in zip(seqs, positions):
            self.cache.ensure_capacity(s, p + 1)
        write = None
        if self.cache.has_paged:
            write = torch.cat([self.cache.flat_slots(s, p, p + 1) for s, p in zip(seqs, positions)])
        lengths = [p + 1 for p in positions]
        tables = self.cache.batch_block_tables(list(seqs), lengths)
        ctx = DecodeContext(
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            slots=torch.tensor([s.slot for s in seqs], dtype=torch.long, device=self.device),
            write_slots=write,
            context_slots=self.cache.batch_context_slots(list(seqs), lengths, tables),
            backend=self.backend,
            block_tables=tables,
        )
        logits = self.model.decode(ids, ctx, self.cache.layers)
        for s in seqs:
            s.num_computed_tokens += 1
        return logits
