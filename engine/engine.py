"""`LLMEngine`: requests in, tokens out, one scheduler step at a time.

The engine owns the model runner, the cache pool, the scheduler and the prefill
planner, and runs each step the scheduler builds:

    add_request(prompt | segments, SamplingParams) -> request id
    step() -> [RequestOutput]      # new tokens and finished flags of this step
    abort(request id)
    generate([...]) -> [RequestOutput]   # offline convenience: run until done

A step runs the batched decode of every decoding request (one `ModelRunner.decode`
call over sequences of different lengths), then each granted prefill chunk through the
request's `PrefillPlan` (engine.runtime.planner: `ApplyStep`s fill cache positions
without compute, `ComputeStep`s go through `ModelRunner.prefill`), sampling the first
token when a plan completes. A prefill that raises fails only its own request (its
final output carries `error`); a failing decode batch propagates (the caller, e.g. the
server's engine loop, stops). Every request keeps its `RequestTimeline` (arrival,
scheduled, first token, each token, finish), so TTFT and throughput come from real runs.

Position-independent caching plugs in as the `planner` argument; the prompt's segments
(text, cache flag, token range) stay on the `Request` for it. Not thread-safe: one
thread drives an engine (engine.server.worker runs it for the HTTP server).
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch

from engine.errors import InvalidRequestError, PlanError, RequestNotFoundError
from engine.hisparse.errors import BlocksLost
from engine.runtime.detokenizer import OutputText
from engine.runtime.planner import ApplyStep, ComputeStep, FusedStep, PrefillPlanner
from engine.runtime.request import FinishReason, PromptSegment, Request, RequestTimeline
from engine.runtime.sampling import FINISH_STOP, SamplingParams, check_stop, make_generator, sample
from engine.runtime.scheduler import CachePool, Scheduler, SchedulerConfig

log = logging.getLogger(__name__)

SegmentInput = Union[PromptSegment, dict]
PromptInput = Union[str, Sequence[SegmentInput]]


@dataclass
class RequestOutput:
    """What one step produced for one request. `text`/`token_ids` are the whole output so
    far; `new_text`/`new_token_ids` what this step added (text withheld while it might
    still become a stop string is released later)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: Optional[str]
    num_prompt_tokens: int
    timeline: RequestTimeline
    error: Optional[str] = None
    num_reused_tokens: int = 0


@dataclass
class EngineStats:
    """Counters since the engine started (for /metrics and the bench)."""

    num_steps: int = 0
    num_prompt_tokens_computed: int = 0
    num_prompt_tokens_reused: int = 0
    num_generated_tokens: int = 0
    num_finished: int = 0
    num_preemptions: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)


def external_kv_planner(planner: PrefillPlanner) -> bool:
    """Whether `planner` can fill full-attention caches kept outside the paged pool
    (HiSparse): the engine's own chunked prefill, or a planner that says so
    (`supports_external_kv`, engine.pic.planner.PicPlanner without exact prefixes)."""
    return type(planner) is PrefillPlanner or bool(getattr(planner, "supports_external_kv", False))


def _pending(warmup: Any) -> bool:
    """Whether an engine.runtime.prefill_graphs.BucketWarmup (or None) has work left."""
    return warmup is not None and bool(warmup.pending)


class LLMEngine:
    """Continuous-batching generation over one model (see the module docstring)."""

    def __init__(
        self,
        runner: Any,
        tokenizer: Any,
        pool: CachePool,
        scheduler_config: SchedulerConfig = SchedulerConfig(),
        planner: Optional[PrefillPlanner] = None,
        model_name: str = "model",
        loaded_model: Any = None,
        max_model_len: Optional[int] = None,
        kv_offload: Any = None,
        prefill_graphs: Any = None,
        decode_graphs: Any = None,
        recurrence_kernels: Any = None,
    ) -> None:
        self.runner = runner
        # engine.runtime.prefill_graphs.PrefillGraphWarmup: the prefill-stage graphs still to
        # capture while idle (`capture_idle_graphs`) and whether they are ready; None: none
        self.prefill_graphs = prefill_graphs
        # engine.runtime.prefill_graphs.DecodeGraphWarmup: the decode graph buckets still to
        # capture while idle, after the prefill-stage graphs; None: none
        self.decode_graphs = decode_graphs
        # engine.pic.kernel_warmup.RecurrenceKernelWarmup: fla's chunk-kernel patterns still
        # to warm while idle, before any graph; None: none
        self.recurrence_kernels = recurrence_kernels
        # engine.hisparse.HiSparseOffload when full-attention KV is offloaded (HiSparse):
        # its metrics go to --json output and /metrics; lost blocks fail over to recompute
        self.kv_offload = kv_offload
        # engine.models.weights.LoadedModel when built from a preset or directory:
        # its `fingerprint` keys cached segments, its `source` says where weights came from.
        self.loaded_model = loaded_model
        # longest prompt + output of one request (the model's context); None: unchecked
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.pool = pool
        self.scheduler = Scheduler(scheduler_config, pool, planner)
        self.model_name = model_name
        self.stats = EngineStats()
        self._requests: dict[str, Request] = {}
        self._texts: dict[str, OutputText] = {}
        self._generators: dict[str, torch.Generator] = {}
        self._pending: list[RequestOutput] = []  # outputs of aborts, sent with the next step
        self._ids = itertools.count()
        self.eos_token_id: Optional[int] = tokenizer.eos_id
        # every id that ends generation like EOS (a checkpoint's generation_config may list several)
        self.eos_token_ids: tuple[int, ...] = tuple(getattr(tokenizer, "stop_ids", ()) or
                                                    (() if tokenizer.eos_id is None else (tokenizer.eos_id,)))
        # Synchronize the device after each prefill-plan step so `prefill_split` times are
        # exact on CUDA (costs a little overlap; off by default).
        self.sync_timings = False

    @property
    def planner(self) -> PrefillPlanner:
        return self.scheduler.planner

    def set_planner(self, planner: PrefillPlanner) -> None:
        """Replace the prefill planner (e.g. a PIC planner built on this engine's runner and
        model fingerprint). Only while no request is in the engine."""
        if self.has_unfinished():
            raise InvalidRequestError("planner", "cannot be replaced while requests are in the engine")
        if self.kv_offload is not None and not external_kv_planner(planner):
            raise InvalidRequestError(
                "hisparse", f"HiSparse runs with the engine's own chunked prefill or PIC (pic or naive, without exact "
                            f"prefixes), not with {type(planner).__name__}: it fills the paged KV cache directly")
        self.scheduler.planner = planner

    @property
    def device(self) -> torch.device:
        return self.runner.device

    # ---- requests -------------------------------------------------------------------

    def add_request(
        self,
        prompt: Optional[PromptInput] = None,
        params: Optional[SamplingParams] = None,
        request_id: Optional[str] = None,
        prompt_token_ids: Optional[Sequence[int]] = None,
        arrival_time: Optional[float] = None,
    ) -> str:
        """Queue a request; returns its id. `prompt` is a string (one uncached segment)
        or a list of segments `{"text": str, "cache": bool}`; or pass `prompt_token_ids`
        instead. Raises `InvalidRequestError` (naming the field) for bad input and
        `CapacityError` for a request that can never fit the cache."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params", f"must be a SamplingParams, got {type(params).__name__}")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id", f"must be a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        token_ids, segments = self.check_prompt(prompt, params, prompt_token_ids)
        timeline = RequestTimeline(arrival_time if arrival_time is not None else time.perf_counter())
        req = Request(request_id, token_ids, segments, params, timeline=timeline)
        self.scheduler.add_request(req)  # may raise CapacityError
        self._requests[request_id] = req
        self._texts[request_id] = OutputText(self.tokenizer, params.stop_strings)
        gen = make_generator(params, self.device)
        if gen is not None:
            self._generators[request_id] = gen
        return request_id

    def max_new_tokens_for(self, num_prompt_tokens: int) -> int:
        """The most new tokens a request of `num_prompt_tokens` prompt tokens may ask for:
        up to the model's context and what the cache holds for one sequence alone (0: the
        prompt leaves no room)."""
        limits = [n for n in (self.max_model_len, self.scheduler.pool.max_tokens_per_sequence()) if n is not None]
        if not limits:
            raise InvalidRequestError("max_new_tokens", "no context limit is known; give max_new_tokens")
        return max(0, min(limits) - num_prompt_tokens)

    def check_prompt(
        self,
        prompt: Optional[PromptInput],
        params: SamplingParams,
        prompt_token_ids: Optional[Sequence[int]] = None,
    ) -> tuple[list[int], list[PromptSegment]]:
        """What `add_request` checks of a prompt, without queueing anything: its token ids
        and segments, or `InvalidRequestError` naming the field (callers with many
        requests check them all before running any)."""
        token_ids, segments = self._tokenize(prompt, prompt_token_ids)
        vocab = self.runner.model.config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError("prompt_token_ids", f"token id {bad} outside the vocabulary [0, {vocab})")
        if self.max_model_len is not None:
            if len(token_ids) >= self.max_model_len:
                field = "prompt_token_ids" if prompt_token_ids is not None else "prompt"
                raise InvalidRequestError(
                    field, f"{len(token_ids)} tokens leave no room in the model's context of {self.max_model_len}"
                )
            if len(token_ids) + params.max_new_tokens > self.max_model_len:
                raise InvalidRequestError(
                    "max_new_tokens",
                    f"{params.max_new_tokens} new tokens after a {len(token_ids)}-token prompt exceed the "
                    f"model's context of {self.max_model_len}",
                )
        return token_ids, segments

    def _tokenize(
        self, prompt: Optional[PromptInput], prompt_token_ids: Optional[Sequence[int]]
    ) -> tuple[list[int], list[PromptSegment]]:
        if (prompt is None) == (prompt_token_ids is None):
            raise InvalidRequestError("prompt", "give exactly one of prompt or prompt_token_ids")
        if prompt_token_ids is not None:
            ids = [int(t) for t in prompt_token_ids]
            if not ids:
                raise InvalidRequestError("prompt_token_ids", "must not be empty")
            return ids, [PromptSegment(text="", cache=False, token_start=0, token_end=len(ids))]
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            prompt = [{"text": prompt, "cache": False}]
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise InvalidRequestError("prompt", "must be a string or a non-empty list of segments")
        # The prompt is [BOS] + each segment's tokens. A segment is tokenized alone and
        # without BOS, so its token ids are the same wherever it appears (the PIC cache
        # key is the segment's own tokens); the BOS at position 0 belongs to no segment.
        bos = self.tokenizer.bos_id
        ids: list[int] = [] if bos is None else [bos]
        segments: list[PromptSegment] = []
        for i, seg in enumerate(prompt):
            if isinstance(seg, PromptSegment):
                text, cache = seg.text, seg.cache
            elif isinstance(seg, dict):
                unknown = set(seg) - {"text", "cache"}
                if unknown:
                    raise InvalidRequestError(f"segments[{i}].{sorted(unknown)[0]}", "unknown segment field (allowed: text, cache)")
                text, cache = seg.get("text"), seg.get("cache", False)
            else:
                raise InvalidRequestError(f"segments[{i}]", f"must be a {{text, cache}} object, got {type(seg).__name__}")
            if not isinstance(text, str):
                raise InvalidRequestError(f"segments[{i}].text", f"must be a string, got {type(text).__name__}")
            if not isinstance(cache, bool):
                raise InvalidRequestError(f"segments[{i}].cache", f"must be true or false, got {cache!r}")
            seg_ids = self.tokenizer.encode(text, add_bos=False)
            segments.append(PromptSegment(text, cache, len(ids), len(ids) + len(seg_ids)))
            ids.extend(seg_ids)
        if not any(s.num_tokens for s in segments):
            raise InvalidRequestError("segments", "the prompt has no tokens")
        return ids, segments

    def abort(self, request_id: str) -> None:
        """Cancel a request; its final output (finish_reason "abort") comes with the next
        `step()`. Raises `RequestNotFoundError` for an unknown or finished id."""
        req = self._requests.get(request_id)
        if req is None:
            raise RequestNotFoundError(request_id)
        self.scheduler.finish(req, FinishReason.ABORT)
        self._pending.append(self._finalize(req, [], ""))

    def get_request(self, request_id: str) -> Request:
        req = self._requests.get(request_id)
        if req is None:
            raise RequestNotFoundError(request_id)
        return req

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def cache_usage(self) -> float:
        return self.pool.usage()

    # ---- idle work ------------------------------------------------------------------

    @property
    def idle_poll_s(self) -> Optional[float]:
        """How often the loop driving this engine should call `help_idle` while no
        request is in it (None: the planner has no idle work)."""
        return getattr(self.scheduler.planner, "idle_poll_s", None)

    def help_idle(self, should_stop: Optional[Callable[[], bool]] = None) -> int:
        """Work the planner does while this engine is idle (its cold-fallback segments,
        cold segments another engine offered through the store: engine.connector.coldshare);
        how many units it did. Only while no request is in the engine. `should_stop`
        (e.g. "a request is waiting"): asked between the layers of the idle pass, which
        gives way (is dropped and redone later) when it says so."""
        fn = getattr(self.scheduler.planner, "help_idle", None)
        if fn is None or self.has_unfinished():
            return 0
        return int(fn(self.runner, should_stop=should_stop))

    def index_segments(self, texts: Sequence[str], progress: Optional[Callable[[Any], None]] = None):
        """Compute and store the signatures of `texts` (segments a deployment knows will
        recur: a RAG corpus's documents) before any request names them, so the first
        request that does hits them (engine.pic.index; an IndexReport). Each text is
        tokenized as a prompt segment is. Only while no request is in the engine; runs to
        the end on the calling thread. `progress(report so far)` after each alone pass.
        The texts are stored in order: when they outgrow the store's faster tiers, the
        daemon's LRU keeps the last ones there, so give the most read last."""
        if isinstance(texts, str) or not isinstance(texts, (list, tuple)):
            raise InvalidRequestError("segments", f"must be a list of strings, got {type(texts).__name__}")
        for i, text in enumerate(texts):
            if not isinstance(text, str) or not text:
                raise InvalidRequestError(f"segments[{i}]", "must be a non-empty string")
        index = getattr(self.scheduler.planner, "index", None)
        if index is None:
            raise PlanError(f"index_segments: the {self.scheduler.planner.name!r} planner keeps no segment "
                            "signatures (index needs method pic or naive)")
        if self.has_unfinished():
            raise PlanError("index_segments: requests are in the engine; index while it is idle")
        return index(self.runner, [self.tokenizer.encode(t, add_bos=False) for t in texts], progress)

    @property
    def prefill_graphs_pending(self) -> bool:
        """Prefill-stage graphs are left for `capture_idle_graphs` (EngineConfig.prefill_graphs "idle")."""
        return self.prefill_graphs is not None and bool(self.prefill_graphs.pending)

    @property
    def idle_graphs_pending(self) -> bool:
        """Warm-ups are left for `capture_idle_graphs`: recurrence-kernel patterns,
        prefill-stage graphs, or decode buckets."""
        return (self.prefill_graphs_pending or _pending(self.decode_graphs) or _pending(self.recurrence_kernels))

    def capture_idle_graphs(self) -> bool:
        """Warm one pending recurrence-kernel pattern, else capture one bucket of the
        pending prefill-stage graphs, else one decode graph bucket; only while no request is in the engine (so a capture
        never shares the device with a request). True when a bucket was captured."""
        if self.has_unfinished():
            return False
        if _pending(self.recurrence_kernels):
            return self.recurrence_kernels.step()
        if self.prefill_graphs_pending:
            return self.prefill_graphs.step()
        return self.decode_graphs is not None and self.decode_graphs.step()

    # ---- the step -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return the outputs of every request it touched."""
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        self.stats.num_steps += 1
        self.stats.num_preemptions += len(sched.preempted)
        for req in sched.refused:
            outputs.append(self._finalize(req, [], ""))
        if sched.decodes:
            seqs = [r.seq for r in sched.decodes]
            last = [r.output_token_ids[-1] for r in sched.decodes]
            try:
                logits = self.runner.decode(seqs, last)
            except BlocksLost as exc:
                self._recompute(list(sched.decodes), exc)
            else:
                tokens = self._sample(logits, sched.decodes)
                for req, tok in zip(sched.decodes, tokens):
                    outputs.append(self._append_token(req, tok))
        for chunk in sched.prefills:
            req = chunk.request
            if req.seq is None:  # requeued by a failed decode of this step
                continue
            try:
                logits = self._run_prefill(req, chunk.num_tokens)
            except BlocksLost as exc:
                self._recompute([req], exc)
                continue
            except Exception as exc:  # one request's prefill (or its planner's apply step) failed
                log.exception("prefill of request %s failed", req.request_id)
                req.error = f"prefill failed: {type(exc).__name__}: {exc}"
                self.scheduler.finish(req, FinishReason.ABORT)
                outputs.append(self._finalize(req, [], ""))
                continue
            if req.progress.done:
                req.num_reused_tokens = req.plan.num_reused_tokens
                self.scheduler.mark_prefilled(req)
                self.planner.on_prefill_done(req)  # may correct num_reused_tokens (what its lookups found)
                self.stats.num_prompt_tokens_reused += req.num_reused_tokens
                if req.sampling.max_new_tokens == 0:  # prefill only (e.g. to warm a cache)
                    self.scheduler.finish(req, FinishReason.LENGTH)
                    outputs.append(self._finalize(req, [], ""))
                    continue
                tok = self._sample(logits.reshape(1, -1), [req])[0]
                outputs.append(self._append_token(req, tok))
        return outputs

    def _recompute(self, reqs: list[Request], exc: BlocksLost) -> None:
        """Offloaded KV blocks of a step could not be read back (HiSparse; the kvstore daemon
        restarted or went away): the step's caches are incomplete, so its requests go back
        to the head of the queue and are recomputed from their tokens (prompt + output so
        far), never served from a block that is missing."""
        log.warning("hisparse: %s; recomputing request(s) %s from their tokens", exc,
                    ", ".join(r.request_id for r in reqs))
        for req in reversed(reqs):
            self.scheduler.requeue(req)
        if self.kv_offload is not None:
            self.kv_offload.metrics.recomputes += len(reqs)

    def _run_prefill(self, req: Request, grant: int) -> Optional[torch.Tensor]:
        """Advance `req`'s plan by up to `grant` compute tokens (apply steps run as they
        are reached). Returns the logits of the last computed token."""
        progress = req.progress
        tokens = req.prefill_token_ids()
        logits = None
        split = req.timeline.prefill_split
        while not progress.done:
            step = progress.current
            if isinstance(step, (ComputeStep, FusedStep)) and grant <= 0:
                break
            t0 = time.perf_counter()
            if isinstance(step, FusedStep):
                logits = step.run(self.runner, req)
                held = req.seq.num_computed_tokens
                if held != step.end:
                    raise PlanError(f"fused step {step.label!r} left the caches at {held} tokens, not {step.end}")
                progress.finish_fused()
                grant -= step.compute_tokens
                self.stats.num_prompt_tokens_computed += step.compute_tokens
            elif isinstance(step, ApplyStep):
                step.apply(self.runner, req)
                held = req.seq.num_computed_tokens
                if held != step.end:
                    raise PlanError(f"apply step {step.label!r} left the caches at {held} tokens, not {step.end}")
                progress.skip_apply()
            else:
                start = step.start + progress.offset
                n = min(grant, step.end - start)
                logits = self.runner.prefill(req.seq, tokens[start : start + n], start_pos=start)
                progress.advance(n)
                grant -= n
                self.stats.num_prompt_tokens_computed += n
            if self.sync_timings and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            split[step.label] = split.get(step.label, 0.0) + time.perf_counter() - t0
        return logits

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        params = [r.sampling for r in reqs]
        gens = [self._generators.get(r.request_id) for r in reqs]
        return sample(logits, params, gens).tolist()

    def _append_token(self, req: Request, token: int) -> RequestOutput:
        now = time.perf_counter()
        req.output_token_ids.append(token)
        req.timeline.token_times.append(now)
        if req.timeline.first_token is None:
            req.timeline.first_token = now
        self.stats.num_generated_tokens += 1
        text = self._texts[req.request_id]
        # EOS / stop ids / max_new_tokens by the sampling module's rule; stop strings by
        # the incremental text (they may span tokens); a stop string beats the length limit.
        verdict = check_stop(req.sampling, token, req.num_output_tokens, self.eos_token_ids)
        reason: Optional[FinishReason] = None
        if verdict == FINISH_STOP:
            reason = FinishReason.STOP
        elif text.append([token]):
            reason = FinishReason.STOP
        elif verdict is not None:
            reason = FinishReason.LENGTH
        if reason is None:
            return self._output(req, [token], text.take_delta())
        self.scheduler.finish(req, reason)
        return self._finalize(req, [token], "")

    def _finalize(self, req: Request, new_ids: list[int], new_text: str) -> RequestOutput:
        req.timeline.finished = time.perf_counter()
        text = self._texts.pop(req.request_id)
        self._requests.pop(req.request_id, None)
        self._generators.pop(req.request_id, None)
        self.stats.num_finished += 1
        reason = req.finish_reason.value if req.finish_reason else "abort"
        self.stats.finished_by_reason[reason] = self.stats.finished_by_reason.get(reason, 0) + 1
        out = self._output(req, new_ids, new_text + text.flush(), text_obj=text)
        return out

    def _output(self, req: Request, new_ids: list[int], new_text: str, text_obj: Optional[OutputText] = None) -> RequestOutput:
        text = text_obj if text_obj is not None else self._texts[req.request_id]
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            new_text=new_text,
            token_ids=list(req.output_token_ids),
            text=text.text,
            finished=req.is_finished,
            finish_reason=req.finish_reason.value if req.finish_reason else None,
            num_prompt_tokens=req.num_prompt_tokens,
            timeline=req.timeline,
            error=req.error,
            num_reused_tokens=req.num_reused_tokens,
        )

    # ---- offline convenience ----------------------------------------------------------

    def generate(
        self,
        prompts: Iterable[PromptInput],
        params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
    ) -> list[RequestOutput]:
        """Run the given prompts to completion (together, continuously batched) and
        return their final outputs in input order. If one prompt is refused, none runs.
        Other requests already in the engine run too, but their outputs are not returned."""
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params] * len(prompts)
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError("params", f"{len(params_list)} sampling params for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params_list):
                ids.append(self.add_request(p, sp))
        except BaseException:  # all or nothing: withdraw the ones already queued
            for rid in ids:
                self.abort(rid)
            self._pending = [o for o in self._pending if o.request_id not in ids]
            raise
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        while wanted - final.keys():
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    final[out.request_id] = out
        return [final[i] for i in ids]
