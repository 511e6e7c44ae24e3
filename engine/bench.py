"""Synthetic load against an `LLMEngine` in this process (`kvengine bench`).

N requests of a fixed prompt length arrive all at once or as a Poisson process; the
engine runs them with continuous batching, and the report comes from each request's
own timeline: TTFT p50/p99, time per output token, end-to-end latency and throughput.
Prompts are random printable text (seeded), so every request misses any cache; later
issues add workloads with shared segments. Outputs ignore EOS so every request
generates exactly `max_new_tokens`.
"""
from __future__ import annotations

import math
import random
import string
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

from engine.engine import LLMEngine, RequestOutput
from engine.errors import InvalidRequestError
from engine.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class LoadSpec:
    """The synthetic workload. `request_rate` is requests per second (Poisson
    arrivals); None sends every request at t=0."""

    num_requests: int = 16
    prompt_len: int = 256
    max_new_tokens: int = 32
    request_rate: Optional[float] = None
    temperature: float = 0.0
    seed: int = 0

    def validate(self) -> None:
        for name in ("num_requests", "prompt_len", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise InvalidRequestError("request_rate", f"must be > 0 (or unset for all at once), got {self.request_rate}")


@dataclass(frozen=True)
class LoadReport:
    """Measured results; times in milliseconds, rates per second."""

    num_requests: int
    prompt_tokens: int
    output_tokens: int
    duration_s: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    ttft_ms_mean: float
    tpot_ms_p50: float  # time per output token after the first
    e2e_ms_p50: float
    e2e_ms_p99: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    num_preemptions: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], q: float) -> float:
    """q-th percentile with linear interpolation between order statistics (numpy's
    default method); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def make_prompt_token_ids(engine: LLMEngine, length: int, rng: random.Random) -> list[int]:
    """`length` token ids of random printable text, through the engine's tokenizer."""
    alphabet = string.ascii_letters + string.digits + " .,;:-"
    ids: list[int] = []
    while len(ids) < length:
        text = "".join(rng.choice(alphabet) for _ in range(2 * (length - len(ids)) + 8))
        ids.extend(engine.tokenizer.encode(text, add_bos=not ids))
    return ids[:length]


def run_load(engine: LLMEngine, spec: LoadSpec) -> LoadReport:
    """Run the workload to completion on `engine` (which should be idle)."""
    spec.validate()
    rng = random.Random(spec.seed)
    prompts = [make_prompt_token_ids(engine, spec.prompt_len, rng) for _ in range(spec.num_requests)]
    offsets = [0.0] * spec.num_requests
    if spec.request_rate is not None:
        t = 0.0
        for i in range(spec.num_requests):
            t += rng.expovariate(spec.request_rate)
            offsets[i] = t
    params = SamplingParams(
        max_new_tokens=spec.max_new_tokens, temperature=spec.temperature, ignore_eos=True, seed=spec.seed
    )
    preempt0 = engine.stats.num_preemptions
    finals: dict[str, RequestOutput] = {}
    ids: list[str] = []
    start = time.perf_counter()
    next_i = 0
    while len(finals) < spec.num_requests:
        now = time.perf_counter()
        while next_i < spec.num_requests and start + offsets[next_i] <= now:
            rid = engine.add_request(
                prompt_token_ids=prompts[next_i], params=params, arrival_time=start + offsets[next_i]
            )
            ids.append(rid)
            next_i += 1
        if not engine.has_unfinished():
            if next_i >= spec.num_requests:
                raise RuntimeError("the engine went idle before every bench request finished")
            time.sleep(max(0.0, min(0.01, start + offsets[next_i] - time.perf_counter())))
            continue
        for out in engine.step():
            if out.finished and out.request_id in ids:
                finals[out.request_id] = out
    duration = time.perf_counter() - start
    outs = [finals[i] for i in ids]
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} bench requests failed, first: {errors[0]}")
    ttft = [o.timeline.ttft * 1e3 for o in outs]
    e2e = [o.timeline.e2e * 1e3 for o in outs]
    tpot = [
        (o.timeline.token_times[-1] - o.timeline.token_times[0]) * 1e3 / (len(o.timeline.token_times) - 1)
        for o in outs
        if len(o.timeline.token_times) > 1
    ]
    prompt_tokens = sum(o.num_prompt_tokens for o in outs)
    output_tokens = sum(len(o.token_ids) for o in outs)
    return LoadReport(
        num_requests=spec.num_requests,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        duration_s=duration,
        ttft_ms_p50=percentile(ttft, 50),
        ttft_ms_p99=percentile(ttft, 99),
        ttft_ms_mean=sum(ttft) / len(ttft),
        tpot_ms_p50=percentile(tpot, 50),
        e2e_ms_p50=percentile(e2e, 50),
        e2e_ms_p99=percentile(e2e, 99),
        requests_per_s=spec.num_requests / duration,
        output_tokens_per_s=output_tokens / duration,
        total_tokens_per_s=(prompt_tokens + output_tokens) / duration,
        num_preemptions=engine.stats.num_preemptions - preempt0,
    )
