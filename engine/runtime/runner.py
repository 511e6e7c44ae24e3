"""`ModelRunner`: executes one model over the caches of a `CacheManager`.

- `prefill(seq, token_ids, start_pos)` runs one chunk of one sequence at positions
  `start_pos .. start_pos+n-1` (start_pos must equal `seq.num_computed_tokens`), appends it
  to the sequence's caches and returns the last token's logits `[vocab]` (every token's
  `[n, vocab]` with `all_logits=True`). Chunked prefill is successive calls.
- `decode(seqs, last_tokens)` feeds one token to each of B sequences of any lengths (each at
  its own position `num_computed_tokens`) and returns logits `[B, vocab]`; through the
  decode CUDA graphs (engine/runtime/cuda_graphs.py, HiSparse layer caches included) where
  they are on and the step fits them, else eagerly.

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
from engine.models.layers.base import PrefillContext
from engine.models.layers.fla_backend import resolve_backend
from engine.runtime.decode_batch import (COL_TOKEN, check_token_ids, decode_context,
                                         pack_decode_rows, to_device)
from engine.runtime.sequence import Sequence

DECODE_ATTENTION = ("paged", "gather")


class ModelRunner:
    def __init__(self, model: HybridDecoder, cache: CacheManager, backend: str = "auto",
                 cuda_graphs: bool | None = None, decode_attention: str = "paged") -> None:
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention={decode_attention!r} must be one of {DECODE_ATTENTION}")
        self.model = model.eval()
        self.cache = cache
        self.device = model.device
        self.backend = resolve_backend(backend, self.device)
        self.max_positions = model.config.max_position_embeddings
        self.decode_attention = decode_attention
        self.graphs = None
        self.set_cuda_graphs(cuda_graphs)

    def set_cuda_graphs(self, enabled: bool | None) -> None:
        """Turn CUDA graphs on or off (None: on where the device is CUDA): decode steps, and
        the token-wise stages of short fused prefills. On the CPU, True runs the decode
        step's static-buffer path eagerly (what tests compare). Needs the paged decode
        attention; dropping graphs frees their memory."""
        from engine.runtime.cuda_graphs import DecodeGraphs

        from engine.runtime.prefill_graphs import PrefillStages

        on = self.device.type == "cuda" if enabled is None else enabled
        if on and self.decode_attention != "paged":
            raise ValueError("cuda_graphs needs decode_attention='paged' (the gather path has host-side shapes)")
        self.graphs = DecodeGraphs(self.model, self.cache, self.backend) if on else None
        #: the token-wise stages of short fused prefills (PIC's seams and suffix) as CUDA
        #: graphs per computed-token bucket (engine.runtime.prefill_graphs); CUDA only, and
        #: not over external KV caches (HiSparse: its prefill is its own, host-planned)
        external = self.graphs is not None and bool(self.graphs.external)
        self.prefill_stages = PrefillStages(self.device) if on and self.device.type == "cuda" and not external \
            else None

    def capture_decode_graphs(self, max_batch: int, only: Seq[int] | None = None) -> list[int]:
        """Compile (and on CUDA capture) the decode step of every graph bucket up to
        `max_batch` sequences (or just the buckets `only`) ahead of requests
        (DecodeGraphs.capture_buckets); the buckets run, [] without decode graphs."""
        return [] if self.graphs is None else self.graphs.capture_buckets(max_batch, only)

    def _ids(self, token_ids) -> torch.Tensor:
        """Token ids as a long tensor on the device, range-checked on the host first (ids
        given already on the device are not read back)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        check_token_ids(ids, self.model.config.vocab_size)
        return to_device(ids, self.device) if ids.device.type == "cpu" else ids.to(self.device)

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
        write, context = self.cache.prefill_slots(seq, start, end, with_context=start > 0)
        ctx = PrefillContext(
            start_pos=start,
            positions=torch.arange(start, end, device=self.device),
            slot=seq.slot,
            write_slots=write,
            context_slots=context,
            backend=self.backend,
        )
        logits = self.model.prefill(ids, ctx, self.cache.layers, all_logits=all_logits,
                                    mixer_input_hook=mixer_input_hook)
        seq.num_computed_tokens = end
        return logits

    @torch.inference_mode()
    def decode(self, seqs: Seq[Sequence], last_tokens: Seq[int] | torch.Tensor) -> torch.Tensor:
        """One token per sequence -> logits `[B, vocab]` (see the module docstring)."""
        ids = torch.as_tensor(last_tokens, dtype=torch.long).reshape(-1)
        if not seqs or ids.numel() != len(seqs):
            raise RuntimeStateError(f"decode needs one token per sequence: {len(seqs)} sequences, {ids.numel()} tokens")
        if len({id(s) for s in seqs}) != len(seqs):
            raise RuntimeStateError("decode batch holds the same sequence twice")
        check_token_ids(ids, self.model.config.vocab_size)
        positions = [s.num_computed_tokens for s in seqs]
        for s, p in zip(seqs, positions):
            if p + 1 > self.max_positions:
                raise RuntimeStateError(
                    f"sequence {s.seq_id!r} would reach {p + 1} tokens > max_position_embeddings={self.max_positions}")
            if not s.is_allocated:
                raise RuntimeStateError(f"sequence {s.seq_id!r} holds no cache slot")
        for s, p in zip(seqs, positions):
            self.cache.ensure_capacity(s, p + 1)
        host_ids = ids.device.type == "cpu"
        tokens = ids.tolist() if host_ids else None
        plan = self.graphs.plan(seqs, positions) if self.graphs is not None else None
        if plan is not None and plan.key is not None:
            logits = self.graphs.run(seqs, positions, tokens if host_ids else ids.to(self.device), plan)
        else:
            logits = self._decode_eager(seqs, positions, tokens, None if host_ids else ids.to(self.device))
        for s in seqs:
            s.num_computed_tokens += 1
        return logits

    def _decode_eager(self, seqs: Seq[Sequence], positions: list[int], tokens: list[int] | None,
                      device_ids: torch.Tensor | None) -> torch.Tensor:
        rows = to_device(pack_decode_rows(seqs, positions, tokens, self.cache.block_size, self.cache.has_paged),
                         self.device)
        ids = rows[:, COL_TOKEN] if device_ids is None else device_ids
        ctx = decode_context(rows, self.cache.has_paged, self.backend, self.decode_attention == "paged")
        ctx.host_positions, ctx.host_slots = positions, [s.slot for s in seqs]
        if not ctx.paged_attention and self.cache.has_paged:
            lengths = [p + 1 for p in positions]
            ctx.context_slots = self.cache.batch_context_slots(list(seqs), lengths, ctx.block_tables)
        return self.model.decode(ids, ctx, self.cache.layers)
