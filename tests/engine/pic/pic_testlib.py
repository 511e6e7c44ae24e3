"""Helpers of the PIC tests: small fp32 CPU model configs of every layer kind, segmented
requests built from token ids, and `execute`, which runs a planner's plan over a `ModelRunner`
exactly as `LLMEngine._run_prefill` does (apply steps as reached, compute steps through
`runner.prefill`) but keeps the caches for inspection afterwards."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from engine.models.config import AttentionConfig, LinearConfig, ModelConfig
from engine.runtime.planner import ApplyStep, FusedStep
from engine.runtime.request import PromptSegment, Request
from engine.runtime.runner import ModelRunner
from engine.runtime.sampling import SamplingParams
from engine.runtime.sequence import Sequence

BOS = 256
VOCAB = 260
ATTN = AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=8, rotary_dim=4, sliding_window=6,
                       output_gate=True, qk_norm=True)
LIN = LinearConfig(num_heads=2, num_v_heads=4, key_dim=8, value_dim=8, conv_size=3, chunk_size=8,
                   conv_kinds=("gdn", "mamba2"))
#: the linear shapes of a model with kda layers (as many value heads as key heads, values as
#: wide as keys; its conv on)
KDA_LIN = LinearConfig(num_heads=2, num_v_heads=2, key_dim=8, value_dim=8, conv_size=3, chunk_size=8,
                       conv_kinds=("gdn", "mamba2", "kda"))


def pic_config(layers, **overrides) -> ModelConfig:
    base = dict(name="pic-test", family="test", scale="custom", vocab_size=VOCAB, hidden_size=32,
                intermediate_size=64, layers=tuple(layers), attention=ATTN,
                linear=KDA_LIN if "kda" in layers else LIN, max_position_embeddings=8192)
    base.update(overrides)
    return ModelConfig(**base)


class FakeTokenizer:
    bos_id = BOS


@dataclass
class Executed:
    logits: torch.Tensor  # [n_last_chunk, vocab] logits of the final compute chunk
    seq: Sequence
    runner: ModelRunner


_ids = itertools.count()


def make_request(segments: list[tuple[list[int], bool]], bos: bool = True, bos_in_first: bool = False) -> Request:
    """A Request from (token ids, cache flag) segments. As the engine builds prompts, BOS
    sits at position 0 outside every segment; `bos_in_first` puts it inside the first
    segment instead (a caller's own token ids)."""
    ids: list[int] = [BOS] if (bos and not bos_in_first) else []
    segs = []
    for i, (toks, cache) in enumerate(segments):
        toks = ([BOS] if (bos and bos_in_first and i == 0) else []) + list(toks)
        segs.append(PromptSegment("", cache, len(ids), len(ids) + len(toks)))
        ids.extend(toks)
    return Request(f"r{next(_ids)}", ids, segs, SamplingParams())


def execute(planner, runner: ModelRunner, request: Request, chunk: int | None = None,
            skip_last_compute: bool = False) -> Executed:
    """Run `planner`'s plan for `request` on `runner` (see the module docstring);
    `skip_last_compute` stops before the final compute step (caches as spliced)."""
    plan = request.plan = planner.plan(request)
    request.seq = runner.cache.allocate(Sequence(request.request_id))
    runner.cache.ensure_capacity(request.seq, plan.num_tokens)
    ids = request.prefill_token_ids()
    logits = None
    steps = plan.steps[:-1] if skip_last_compute else plan.steps
    split = request.timeline.prefill_split
    for step in steps:
        t0 = time.perf_counter()
        if isinstance(step, FusedStep):
            logits = step.run(runner, request)[None]  # the last position's logits only
            assert request.seq.num_computed_tokens == step.end, step.label
        elif isinstance(step, ApplyStep):
            step.apply(runner, request)
            assert request.seq.num_computed_tokens == step.end, step.label
        else:
            pos = step.start
            while pos < step.end:
                end = step.end if chunk is None else min(step.end, pos + chunk)
                logits = runner.prefill(request.seq, ids[pos:end], start_pos=pos, all_logits=True)
                pos = end
        split[step.label] = split.get(step.label, 0.0) + time.perf_counter() - t0
    if not skip_last_compute:
        planner.on_prefill_done(request)
    return Executed(logits, request.seq, runner)


def plain_prefill(runner: ModelRunner, ids: list[int], boundaries: list[int]) -> Executed:
    """Plain prefill of `ids` in chunks ending at `boundaries` (the last = len(ids))."""
    seq = runner.cache.allocate(Sequence(f"plain{next(_ids)}"))
    start, logits = 0, None
    for end in boundaries:
        logits = runner.prefill(seq, ids[start:end], start_pos=start, all_logits=True)
        start = end
    return Executed(logits, seq, runner)


def rand_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def layer0_inputs(model, ids):
    """Recurrence inputs of layer 0 over the whole prompt (context-free: embeddings)."""
    with torch.no_grad():
        h = model.blocks[0].mixer_norm(model.embed(torch.tensor(ids)))
        mixer = model.mixer(0)
        conv_in, extras = mixer.project(h[None])
        conv_out, _ = mixer.apply_conv(conv_in, None)
        return mixer.family, mixer.prepare(conv_out, extras)


def fla_emulated(family, inp, initial_state, cu_seqlens=None):
    """fla_backend.fla_chunk's contract (packed sequences, [N, H, K, V] states) through the
    torch recurrence: lets the fla-only branches of the alone pass run on the CPU."""
    from engine.models.layers.linear_ops import chunked_recurrence

    cu = [0, inp.q.shape[1]] if cu_seqlens is None else [int(x) for x in cu_seqlens]
    outs, states = [], []
    for n in range(len(cu) - 1):
        s0 = None if initial_state is None else initial_state[n:n + 1]
        o, st = chunked_recurrence(family, inp.slice_time(cu[n], cu[n + 1]), s0, 16)
        outs.append(o)
        states.append(st)
    return torch.cat(outs, dim=1), torch.cat(states).to(torch.float32)
