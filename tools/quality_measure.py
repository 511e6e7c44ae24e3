"""Measuring one prefill method on one model over workload requests: greedy answers,
their scores, and fidelity against full recomputation on the question tokens. The
quality harness (tools/quality.py) is built on this; its tests call it directly.

A `ModelSession` holds one model, its tokenizer and one `ModelRunner` over caches sized
for `batch_size` live requests. `run_method(session, spec, requests, reference)` builds
ONE planner for the method (engine.pic: `full`, `prefix`, `naive`, `pic` with a seam), so
its signature cache or prefix tree lives across every request of the call: later
requests hit what earlier ones computed, in any order and at any offset, exactly as in
`kvengine run`. Per batch of `batch_size` requests, in request order:

1. each request's prefill plan runs on the runner (`engine.pic.offline.prefill_with_plan`,
   the engine's own plan execution, chunked like the engine's scheduler), keeping the
   logits of the plan's final compute step, which always covers the question segment
   (the last segment of a prompt is computed in context by every method);
2. the question positions' next-token distributions are compared with the reference
   (full recomputation of the same request): KL(full || method), summed in float64, and
   top-1 agreement. These are teacher-forced: every method sees the same question tokens;
3. the batch is decoded greedily together (`ModelRunner.decode`, one batched step per
   token) until each request emits a newline or a special token or reaches the bound of
   its metric (`tools.train.evaluate.max_new_tokens`, the same bound the training
   evaluation uses), then scored with `tools.workloads.score`.

Timing per request is measured wall time: `prefill_s` of its own plan (lookups, alone
passes of misses, splices, seams, question), `decode_s` the batch's decode time divided
by the batch size (decoding is batched).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

import torch

from engine.builder import model_tokenizer
from engine.cache.manager import CacheConfig, CacheManager
from engine.models.config import SWA
from engine.connector.settings import PicSettings
from engine.models.weights import LoadedModel, load_model
from engine.pic.config import MISS_SIGNATURE_SOURCES, STATE_DTYPES as PIC_STATE_DTYPES, PicConfig
from engine.pic.offline import build_request, prefill_with_plan, release
from engine.pic.planner import make_planner
from engine.runtime.runner import ModelRunner
from tools.train.evaluate import max_new_tokens
from tools.workloads import Request, score

METHODS = ("full", "prefix", "naive", "pic")
SWA_SEAM_POLICIES = ("window", "seam")
#: chunk size of compute steps, as the engine's scheduler default (prefill_chunk_size)
DEFAULT_CHUNK = 512


class QualityError(Exception):
    """A bad harness option or a run that cannot be measured; the message names the value."""


@dataclass(frozen=True)
class MethodSpec:
    """One row of the table: a method and, for `pic`, the seam the planner uses on this
    model (`seam` is the effective seam: the SWA window rule already applied) and the SWA
    seam policy (None for models without sliding-window layers)."""

    method: str
    seam: Optional[int] = None
    swa_seam: Optional[str] = None
    state_dtype: str = "float32"  # dtype of the cached linear states and T (PicConfig.state_dtype)
    #: pic: where misses' signatures come from (PicConfig.miss_signatures): "alone" passes in
    #: the request, or "context": misses computed in context, signatures from that pass
    miss_signatures: str = "alone"

    @property
    def label(self) -> str:
        dt = "" if self.state_dtype == "float32" else f" {self.state_dtype} states"
        if self.method != "pic":
            return self.method + dt
        rule = {"window": " (window rule)", "seam": " (plain seam)"}.get(self.swa_seam or "", "")
        src = " ctx sigs" if self.miss_signatures == "context" else ""
        return f"pic s={self.seam}{rule}{dt}{src}"

    def pic_config(self) -> PicConfig:
        """The row's PicConfig: the entry points' settings (PicSettings()) with this row's
        method, seam, state dtype and signature source. Rows with alone signatures compute
        their misses alone in the request (the harness has no idle time between requests
        for the default context path to cache them in)."""
        base = PicSettings()
        if self.method == "pic" and self.miss_signatures == "context":
            return base.with_pic(method="pic", seam=int(self.seam or 0), swa_seam="seam",
                                 state_dtype=self.state_dtype, miss_path="context", miss_signatures="context").pic
        if self.method == "pic":
            return base.with_pic(method="pic", seam=int(self.seam or 0), swa_seam="seam",
                                 state_dtype=self.state_dtype, miss_path="alone").pic
        if self.method == "naive":
            return base.with_pic(method="naive", state_dtype=self.state_dtype, miss_path="alone").pic
        return base.with_pic(method=self.method).pic


def expand_specs(model_config, methods: Sequence[str], seams: Sequence[int],
                 swa_policies: Sequence[str] = ("window",),
                 state_dtypes: Sequence[str] = ("float32",),
                 miss_signatures: Sequence[str] = ("alone",)) -> list[MethodSpec]:
    """The rows to measure for one model, `full` first (it is the reference). Each pic seam
    becomes its effective seam on this model under each SWA policy (`window`:
    max(seam, window) on a model with sliding-window layers, docs/pic.md); rows that end
    up identical are measured once. Each pic and naive row is repeated per cached-state
    dtype in `state_dtypes` (float32 rows first), and each pic row per source of miss
    signatures in `miss_signatures` (PicConfig.miss_signatures; "alone" rows first).
    `model_config` None: a model not loaded yet, taken as one without sliding-window
    layers (the options are checked; the rows are expanded again once it is loaded)."""
    for src in miss_signatures:
        if src not in MISS_SIGNATURE_SOURCES:
            raise QualityError(f"miss signature source {src!r} must be one of {', '.join(MISS_SIGNATURE_SOURCES)}")
    if tuple(miss_signatures) != ("alone",):
        base = expand_specs(model_config, methods, seams, swa_policies, state_dtypes)
        out = [sp for sp in base if sp.method != "pic" or "alone" in miss_signatures]
        for src in miss_signatures:
            if src != "alone":
                out += [replace(sp, miss_signatures=src) for sp in base if sp.method == "pic"]
        return list(dict.fromkeys(out))
    for d in state_dtypes:
        if d not in PIC_STATE_DTYPES:
            raise QualityError(f"state dtype {d!r} must be one of {', '.join(PIC_STATE_DTYPES)}")
    if len(state_dtypes) > 1 or tuple(state_dtypes) != ("float32",):
        base = expand_specs(model_config, methods, seams, swa_policies)
        out = [base[0]]
        for d in state_dtypes:
            out += [replace(sp, state_dtype=d) for sp in base[1:] if sp.method in ("pic", "naive")]
            if d == state_dtypes[0]:
                out += [sp for sp in base[1:] if sp.method not in ("pic", "naive")]
        return list(dict.fromkeys(out))
    for m in methods:
        if m not in METHODS:
            raise QualityError(f"unknown method {m!r}; expected some of {', '.join(METHODS)}")
    for s in seams:
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            raise QualityError(f"seam {s!r} must be an int >= 0")
    for p in swa_policies:
        if p not in SWA_SEAM_POLICIES:
            raise QualityError(f"SWA seam policy {p!r} must be one of {', '.join(SWA_SEAM_POLICIES)}")
    window = (model_config.attention.sliding_window
              if model_config is not None and SWA in model_config.layers else None)
    specs = [MethodSpec("full")]
    for m in methods:
        if m == "full":
            continue
        if m != "pic":
            specs.append(MethodSpec(m))
            continue
        if not seams:
            raise QualityError("method pic needs at least one seam (--seams)")
        for policy in swa_policies if window else (None,):
            for s in seams:
                eff = max(s, window) if policy == "window" else s
                spec = MethodSpec("pic", eff, policy)
                if spec in specs:
                    continue
                # a plain seam at or above the window is the window rule's row
                if policy == "seam" and MethodSpec("pic", eff, "window") in specs:
                    continue
                specs.append(spec)
    return specs


@dataclass
class ModelSession:
    """A model ready to be measured: weights, tokenizer, one runner over its caches."""

    name: str
    loaded: LoadedModel
    tokenizer: object
    runner: ModelRunner
    batch_size: int
    chunk_size: Optional[int] = DEFAULT_CHUNK

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def open_session(preset: str, device: str = "cpu", max_tokens: int = 1024, batch_size: int = 16,
                 init_seed: Optional[int] = None, chunk_size: Optional[int] = DEFAULT_CHUNK) -> ModelSession:
    """Load `preset` (trained weights under models/<preset>/ when present, else its seeded
    init; `init_seed` forces an init from that seed; or a Hugging Face checkpoint
    directory, with its own tokenizer) with caches for `batch_size` requests
    of up to `max_tokens` positions each (prompt plus generated tokens)."""
    if batch_size < 1:
        raise QualityError(f"batch size {batch_size!r} must be >= 1")
    loaded = load_model(preset, device=device, seed=init_seed)
    tokenizer = model_tokenizer(preset)  # a checkpoint's own, else the byte tokenizer
    limit = loaded.config.max_position_embeddings
    if max_tokens > limit:
        raise QualityError(f"requests need {max_tokens} positions, more than {preset}'s "
                           f"max_position_embeddings={limit}")
    block = 16
    cache = CacheManager.for_model(loaded.model, CacheConfig(
        block_size=block, num_slots=batch_size, num_blocks=batch_size * (math.ceil(max_tokens / block) + 1)))
    runner = ModelRunner(loaded.model, cache)
    return ModelSession(preset, loaded, tokenizer, runner, batch_size, chunk_size)


@dataclass
class RequestOutcome:
    """What one request gave under one method."""

    request_id: str
    task: str
    text: str
    points: float
    prompt_tokens: int
    reused_tokens: int
    recomputed_tokens: int
    prefill_s: float
    decode_s: float
    output_tokens: int
    token_ids: list[int] = field(default_factory=list)  # generated, stop token included
    #: fidelity on the question positions vs the reference (None when no reference)
    kl_sum: Optional[float] = None
    top1_hits: Optional[int] = None
    positions: int = 0


@dataclass
class MethodRun:
    """Every request's outcome under one method, and (when asked) the question
    log-probabilities by request id, to serve as the reference of later runs."""

    spec: MethodSpec
    outcomes: list[RequestOutcome] = field(default_factory=list)
    question_logprobs: dict[str, torch.Tensor] = field(default_factory=dict)
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # process CPU time (all threads): a load-independent cost measure


def question_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Log-softmax of question logits in float64, on the CPU (so that KL of a method whose
    logits equal the reference's is exactly 0, and never negative by rounding)."""
    return torch.log_softmax(logits.double(), dim=-1).cpu()


def fidelity(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, int]:
    """(sum over positions of KL(ref || got) in nats, top-1 agreements) between two
    [positions, vocab] log-probability tensors."""
    if ref.shape != got.shape:
        raise QualityError(f"question log-probs of shape {tuple(got.shape)} do not match the reference "
                           f"{tuple(ref.shape)}")
    p, q = ref.double(), got.double()
    kl = (p.exp() * (p - q)).sum(-1)
    hits = int((ref.argmax(-1) == got.argmax(-1)).sum())
    return float(kl.sum()), hits


def run_method(session: ModelSession, spec: MethodSpec, requests: Sequence[Request],
               reference: Optional[dict[str, torch.Tensor]] = None, keep_logprobs: bool = False,
               on_progress: Optional[Callable[[int, str], None]] = None) -> MethodRun:
    """Run `requests` in order under `spec` with one planner (module docstring).
    `reference`: question log-probs by request id (from a `full` run with keep_logprobs)."""
    runner, tok = session.runner, session.tokenizer
    loaded = session.loaded
    planner = make_planner(spec.pic_config(), loaded.model, loaded.fingerprint, tok)
    if spec.method == "pic" and planner.seam != spec.seam:
        raise QualityError(f"{spec.label}: the planner uses seam {planner.seam}, not {spec.seam}")
    stop_ids = set(tok.special_ids()) | set(tok.encode("\n"))
    run = MethodRun(spec)
    t_run, cpu_run = time.perf_counter(), time.process_time()
    for start in range(0, len(requests), session.batch_size):
        batch = list(requests[start:start + session.batch_size])
        live = []
        try:
            for r in batch:
                live.append(_prefill_one(session, planner, r, reference, keep_logprobs, run))
            gens, texts, decode_s = _greedy_decode(session, [x[1] for x in live], [x[2] for x in live],
                                                     [max_new_tokens(r.metric) for r in batch], stop_ids)
        finally:
            for out, res, _first in live:
                release(planner, runner, res.request)
        for (out, _res, _first), ids, text, r in zip(live, gens, texts, batch):
            out.text, out.points, out.output_tokens, out.token_ids = text, score(r, text), len(ids), ids
            out.decode_s = decode_s / len(batch)
            run.outcomes.append(out)
        if on_progress is not None:
            on_progress(len(batch), batch[-1].task)
    run.seconds = time.perf_counter() - t_run
    run.cpu_seconds = time.process_time() - cpu_run
    return run


def _prefill_one(session: ModelSession, planner, r: Request, reference, keep_logprobs: bool, run: MethodRun):
    req = build_request(session.tokenizer, [s.to_dict() for s in r.segments], request_id=r.id)
    session.synchronize()
    t0 = time.perf_counter()
    res = prefill_with_plan(planner, session.runner, req, chunk_size=session.chunk_size)
    session.synchronize()
    prefill_s = time.perf_counter() - t0
    q_start, q_end = req.segments[-1].token_start, req.segments[-1].token_end
    if res.logits_start > q_start or res.logits_start + res.logits.shape[0] != q_end:
        release(planner, session.runner, req)
        raise QualityError(f"{r.id}: the final compute step of method {run.spec.label!r} covers "
                           f"[{res.logits_start}, {res.logits_start + res.logits.shape[0]}), not the question "
                           f"[{q_start}, {q_end})")
    lp = question_logprobs(res.logits[q_start - res.logits_start:])
    if keep_logprobs:
        run.question_logprobs[r.id] = lp
    report = res.report
    out = RequestOutcome(r.id, r.task, "", 0.0, len(req.prompt_token_ids),
                         report.reused_tokens if report else 0,
                         report.recomputed_tokens if report else len(req.prompt_token_ids),
                         prefill_s, 0.0, 0, positions=q_end - q_start)
    if reference is not None:
        if r.id not in reference:
            release(planner, session.runner, req)
            raise QualityError(f"no reference log-probs for request {r.id!r}")
        out.kl_sum, out.top1_hits = fidelity(reference[r.id], lp)
    first = int(res.logits[-1].argmax())
    return out, res, first


def _greedy_decode(session: ModelSession, results, first_tokens: list[int], limits: list[int],
                   stop_ids: set[int]) -> tuple[list[list[int]], list[str], float]:
    """Greedy continuation of prefilled requests, decoded as one batch. Returns the
    generated ids, their texts (special tokens dropped) and the wall time."""
    session.synchronize()
    t0 = time.perf_counter()
    gens = [[t] for t in first_tokens]
    active = [i for i, g in enumerate(gens) if g[-1] not in stop_ids and len(g) < limits[i]]
    while active:
        logits = session.runner.decode([results[i].seq for i in active], [gens[i][-1] for i in active])
        nxt = logits.argmax(-1).tolist()
        for i, t in zip(active, nxt):
            gens[i].append(int(t))
        active = [i for i in active if gens[i][-1] not in stop_ids and len(gens[i]) < limits[i]]
    session.synchronize()
    seconds = time.perf_counter() - t0
    return gens, [session.tokenizer.decode(g) for g in gens], seconds
