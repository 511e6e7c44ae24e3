"""The quality harness: task scores and fidelity of every prefill method against full
recomputation, per model and workload (issue 5). See docs/quality.md.

    python -m tools.quality [--quick] [--json] [--json-path FILE] [--markdown]
        [--presets a,b] [--model DIR ...] [--no-chat] [--tasks fact,twohop,aggregate,fewshot,rag] [--methods full,prefix,naive,pic]
        [--seams 0,8,16,32,64] [--swa-seam window,seam] [--state-dtypes float32,bfloat16] [--miss-signatures alone,context]
        [--n N] [--seed S] [--device cpu|cuda]
        [--batch-size B] [--threads T] [--jobs J] [--tolerance POINTS] [--docs MIN-MAX]
        [--facts-per-doc F] [--init-seed S] [--no-progress]

For each model, the requests of every task (`tools.workloads.iter_requests(task, n, seed)`,
tiny scale) run under each method, in one process per model (`--jobs` runs several
models at once in worker processes), one planner per (model, method) whose
signature cache / prefix tree lives across all of them (tools/quality_measure.py says
how). Full recomputation runs first: it is the reference of every delta, and of the
fidelity columns (its own row is the reference itself: KL 0, top-1 100% by construction).

One table, rows model x method: per task the score (points 0-100) and its delta to full
recomputation, their average over the tasks, mean KL(full || method) in nats and top-1
agreement (%) over the question positions (per task token-weighted, then averaged over
tasks), the share of prompt tokens recomputed (misses' alone passes included), and
measured milliseconds per request (prefill + batched decode share). Then, per model, the
best PIC seam: the one that recomputes the fewest tokens among those whose average delta
is no worse than `--tolerance` points (default 1.0); when none is, the one closest to full.
`--json` also writes the rows and that summary to docs/results/quality-<date>.json.

`--model DIR` (repeatable) measures a Hugging Face checkpoint directory the engine loads
(kvengine --model, docs/models.md) with its own tokenizer; instead of the default presets
(with `--presets`, beside them). Its requests go through its chat template, as the chat
endpoint renders them (engine.server.chat): the request's segments become the content
parts of one user message, documents cacheable, and the template's text around them
uncached segments; the last segment (question plus the template's generation prompt)
is where fidelity is measured. `--no-chat`: the raw segments, as for the presets.

`--quick`: qwen3next-tiny, tasks fact and twohop, 3 requests each over short prompts (2-3
documents of 4 facts), methods full, naive and pic with seam 16, on the CPU (under a
minute on a 2-core machine). Any option given explicitly overrides the quick default.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

if __package__ in (None, ""):  # run as `python tools/quality.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.connector.settings import PicSettings  # noqa: E402
from engine.errors import EngineError  # noqa: E402
from tools.quality_measure import (METHODS, QualityError, expand_specs, open_session,  # noqa: E402
                                   run_method)
from tools.quality_report import add_deltas, make_row, print_report, summarize  # noqa: E402
from tools.train.evaluate import max_new_tokens  # noqa: E402
from tools.workloads import TASKS, WorkloadError, iter_requests  # noqa: E402
from tools.results import write_json as write_json_file  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PRESETS = ("qwen3next-tiny", "ring-tiny", "gemma3-tiny", "nemotronh-tiny", "gla-tiny")
DEFAULT_SEAMS = (0, 8, 16, 32, 64)
DEFAULTS = dict(presets=",".join(DEFAULT_PRESETS), tasks=",".join(TASKS), methods=",".join(METHODS),
                seams=",".join(map(str, DEFAULT_SEAMS)), swa_seam="window,seam", state_dtypes="float32",
                miss_signatures=PicSettings().pic.miss_signatures,  # the entry points' one default
                n=50, seed=0,
                device="auto",
                batch_size=16, docs=None, facts_per_doc=None)
QUICK = dict(presets="qwen3next-tiny", tasks="fact,twohop", methods="full,naive,pic", seams="16", n=3,
             device="cpu", batch_size=8, docs="2-3", facts_per_doc=4)
SCHEMA = "quality/v1"


# ---------------------------------------------------------------------------- options
def _csv(value: str, what: str) -> list[str]:
    items = [x.strip() for x in value.split(",") if x.strip()]
    if not items:
        raise QualityError(f"--{what} is empty")
    return items


def _ints(value: str, what: str) -> list[int]:
    out = []
    for x in _csv(value, what):
        try:
            out.append(int(x))
        except ValueError:
            raise QualityError(f"--{what}: {x!r} is not an integer") from None
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small CPU configuration (module docstring)")
    p.add_argument("--json", action="store_true", help="write rows and summary to --json-path")
    p.add_argument("--json-path", default=None, help="default docs/results/quality-<date>.json")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown (for docs/BENCHMARKS.md)")
    p.add_argument("--presets", help=f"models (preset names or weight dirs); default {DEFAULTS['presets']}")
    p.add_argument("--model", action="append", default=[], metavar="DIR",
                   help="a Hugging Face checkpoint directory (repeatable); replaces the default presets")
    p.add_argument("--no-chat", action="store_true",
                   help="--model: the workloads' raw segments, not rendered through the checkpoint's chat template")
    p.add_argument("--tasks", help=f"workloads; default {DEFAULTS['tasks']}")
    p.add_argument("--methods", help=f"default {DEFAULTS['methods']} (full always runs: it is the reference)")
    p.add_argument("--seams", help=f"PIC seams; default {DEFAULTS['seams']}")
    p.add_argument("--swa-seam", help="SWA seam policies for models with sliding-window layers: window "
                                      "(seam = max(seam, window)), seam (as given); default window,seam")
    p.add_argument("--state-dtypes", help="dtypes of the cached linear states and T for the pic and naive rows "
                                          "(float32, bfloat16, float16; a row per dtype); default float32")
    p.add_argument("--miss-signatures", help="where the pic rows' miss signatures come from: alone (an alone "
                   "pass in the request), context (misses computed in context, signatures from that pass: "
                   f"engine.pic.capture), or both as alone,context; default {DEFAULTS['miss_signatures']}")
    p.add_argument("--n", type=int, help=f"requests per task; default {DEFAULTS['n']}")
    p.add_argument("--seed", type=int, help="workload seed; default 0")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), help="default auto (cuda when available)")
    p.add_argument("--batch-size", type=int, help="requests decoded together; default 16")
    p.add_argument("--docs", help="workload override: documents per request, MIN-MAX")
    p.add_argument("--facts-per-doc", type=int, help="workload override: items per document")
    p.add_argument("--tolerance", type=float, default=1.0,
                   help="points of average delta within which a PIC seam counts as matching full (default 1.0)")
    p.add_argument("--init-seed", type=int, default=None,
                   help="ignore trained weights: seeded random init (for harness checks)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: tiny models gain nothing from intra-op threads, and on a "
                        "busy machine 2 spinning threads ran 10-20x slower than 1)")
    p.add_argument("--jobs", type=int, default=1,
                   help="models measured at once in worker processes (2 on an idle 2-core CPU; tiny models "
                        "are launch-bound on a GPU, so 5 processes can share one)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    base = dict(DEFAULTS, **QUICK) if a.quick else DEFAULTS
    if a.model and a.presets is None:
        a.presets = ""  # --model alone: only the checkpoints
    for key, value in base.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    return a


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise QualityError("--device cuda asked for, but CUDA is not available here")
    return name


def model_config_of(preset: str):
    """The ModelConfig of a preset name or a saved weights directory (no weights loaded);
    None for a Hugging Face checkpoint (its config is known once it is loaded)."""
    from engine.models.hf import is_hf_checkpoint
    from engine.models.presets import get_preset
    from engine.models.weights import read_config

    path = Path(preset)
    if is_hf_checkpoint(path):
        return None
    if path.is_dir():
        return read_config(path)
    return get_preset(preset)


def chat_requests(tokenizer, requests: Sequence) -> tuple:
    """`requests` rendered through the tokenizer's chat template as the chat endpoint
    renders a conversation (engine.server.chat): the segments are the content parts of one
    user message; the template's text becomes uncached segments around the cached ones."""
    from dataclasses import replace

    from engine.server.chat import ChatMessage, ChatPart, render_segments
    from tools.workloads.common import Segment

    out = []
    for r in requests:
        message = ChatMessage("user", tuple(ChatPart(s.text, s.cache) for s in r.segments))
        try:
            segs = render_segments(tokenizer, (message,))
        except EngineError as exc:
            raise QualityError(f"{r.id}: {exc}") from exc
        if segs[-1]["cache"]:
            raise QualityError(f"{r.id}: the chat template renders nothing after the last document")
        out.append(replace(r, segments=tuple(Segment(s["text"], s["cache"]) for s in segs)))
    return tuple(out)


def prompt_tokens(tokenizer, request) -> int:
    """Positions of `request`'s prompt as the engine tokenizes it (BOS, each segment alone)."""
    bos = 0 if tokenizer.bos_id is None else 1
    return bos + sum(len(tokenizer.encode(s.text)) for s in request.segments)


def default_json_path(today: Optional[_dt.date] = None) -> Path:
    day = (today or _dt.date.today()).isoformat()
    return REPO_ROOT / "docs" / "results" / f"quality-{day}.json"


def environment(device: str) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": device,
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "machine": platform.machine()}
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


# ------------------------------------------------------------------------------ run
class Reporter:
    """Where a run reports progress: `advance(k)` requests done, `describe(text)` what
    runs now, `log(line)` a finished row. The base prints log lines to stderr."""

    def advance(self, k: int) -> None:
        return None

    def describe(self, text: str) -> None:
        return None

    def log(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)


class BarReporter(Reporter):
    """A rich progress bar; log lines print above it."""

    def __init__(self, progress, total: int) -> None:
        self.progress = progress
        self.bar = progress.add_task("quality", total=total)

    def advance(self, k: int) -> None:
        self.progress.advance(self.bar, k)

    def describe(self, text: str) -> None:
        self.progress.update(self.bar, description=text)

    def log(self, line: str) -> None:
        self.progress.console.print(line, highlight=False)


class QueueReporter(Reporter):
    """Forwards events from a worker process to the parent's reporter."""

    def __init__(self, queue) -> None:
        self.queue = queue

    def advance(self, k: int) -> None:
        self.queue.put(("advance", k))

    def describe(self, text: str) -> None:
        self.queue.put(("describe", text))

    def log(self, line: str) -> None:
        self.queue.put(("log", line))


@dataclass(frozen=True)
class ModelJob:
    """Everything one model's rows need (picklable: it is sent to worker processes)."""

    preset: str
    specs: tuple
    requests: tuple
    tasks: tuple
    device: str
    max_tokens: int
    batch_size: int
    threads: int
    init_seed: Optional[int]
    #: expand_specs options, to expand `specs` again once the model's config is loaded
    #: (a Hugging Face checkpoint: a sliding window is known only then); None: `specs` as is
    spec_options: Optional[tuple] = None


def measure_model(job: ModelJob, reporter: Reporter) -> list[dict]:
    """The rows of one model, `full` first (the reference of the others)."""
    torch.set_num_threads(job.threads)
    session = open_session(job.preset, job.device, job.max_tokens, job.batch_size, init_seed=job.init_seed)
    weights = session.loaded.source
    specs = job.specs if job.spec_options is None else expand_specs(session.loaded.config, *job.spec_options)
    ref = None
    rows = []
    for spec in specs:
        reporter.describe(f"{job.preset} {spec.label}")
        advance = lambda k, task: reporter.advance(k)  # noqa: E731
        if spec.method == "full":
            run = run_method(session, spec, job.requests, keep_logprobs=True, on_progress=advance)
            ref = run.question_logprobs
            for o in run.outcomes:  # the reference itself: KL 0 and top-1 100% by construction
                o.kl_sum, o.top1_hits = 0.0, o.positions
        else:
            run = run_method(session, spec, job.requests, reference=ref, on_progress=advance)
        rows.append(make_row(job.preset, weights, run, job.tasks))
        reporter.log(f"{job.preset} {spec.label}: {len(job.requests)} requests in {run.seconds:.1f} s "
                     f"(process CPU {run.cpu_seconds:.1f} s)")
    add_deltas(rows, rows[0])
    return rows


def _worker(job: ModelJob, queue) -> list[dict]:
    return measure_model(job, QueueReporter(queue))


def plan_jobs(args: argparse.Namespace) -> tuple[list[ModelJob], dict]:
    """Validate the options; one job per model, and the run's config record."""
    presets, tasks = (_csv(args.presets, "presets") if args.presets else []), _csv(args.tasks, "tasks")
    from engine.models.hf import is_hf_checkpoint

    for d in args.model:
        if not is_hf_checkpoint(d):
            raise QualityError(f"--model {d}: not a Hugging Face checkpoint directory (no config.json with a "
                               "model_type)")
    methods, seams = _csv(args.methods, "methods"), _ints(args.seams, "seams")
    policies = _csv(args.swa_seam, "swa-seam")
    state_dtypes = _csv(args.state_dtypes, "state-dtypes")
    sources = _csv(args.miss_signatures, "miss-signatures")
    for t in tasks:
        if t not in TASKS:
            raise QualityError(f"unknown task {t!r}; expected some of {', '.join(TASKS)}")
    for name, low in (("n", 1), ("threads", 1), ("jobs", 1), ("batch_size", 1)):
        if getattr(args, name) < low:
            raise QualityError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= {low}")
    device = resolve_device(args.device)
    overrides = {"docs": args.docs, "facts_per_doc": args.facts_per_doc}
    requests = tuple(r for t in tasks for r in iter_requests(t, args.n, args.seed, scale="tiny", **overrides))
    options = (methods, seams, policies, state_dtypes, sources)
    jobs = []
    for p in presets + args.model:
        cfg = model_config_of(p)
        reqs, tok = requests, _tokenizer_of(p)
        if cfg is None and not args.no_chat and getattr(tok, "chat_template_source", None):
            reqs = chat_requests(tok, requests)
        max_tokens = max(prompt_tokens(tok, r) + 1 + max_new_tokens(r.metric) for r in reqs)
        jobs.append(ModelJob(p, tuple(expand_specs(cfg, *options)), reqs, tuple(tasks), device, max_tokens,
                             args.batch_size, args.threads, args.init_seed,
                             spec_options=options if cfg is None else None))
    if not jobs:
        raise QualityError("no model to measure: give --presets or --model")
    config = {"presets": presets, "models": list(args.model), "chat": not args.no_chat,
              "tasks": tasks, "methods": methods, "seams": seams, "swa_seam": policies,
              "state_dtypes": state_dtypes, "miss_signatures": sources,
              "n": args.n, "seed": args.seed, "scale": "tiny",
              "workload_overrides": {k: v for k, v in overrides.items() if v is not None},
              "device": device, "threads": args.threads, "jobs": args.jobs, "batch_size": args.batch_size,
              "tolerance": args.tolerance, "init_seed": args.init_seed, "quick": args.quick}
    return jobs, config


def _tokenizer_of(model: str):
    from engine.builder import model_tokenizer

    try:
        return model_tokenizer(model)
    except EngineError as exc:
        raise QualityError(f"{model}: {exc}") from exc


def run_jobs(jobs: list[ModelJob], reporter: Reporter, parallel: int,
             on_model: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """Every model's rows, in the order of `jobs`; `parallel` > 1 measures that many models
    at once in worker processes (spawned, so CUDA is safe; each with its own `threads`).
    `on_model(rows)` gets each model's rows as soon as that model is done."""
    if parallel <= 1 or len(jobs) <= 1:
        out = []
        for job in jobs:
            rows = measure_model(job, reporter)
            on_model(rows)
            out += rows
        return out
    import concurrent.futures as cf
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager, cf.ProcessPoolExecutor(min(parallel, len(jobs)), mp_context=ctx) as pool:
        events = manager.Queue()
        futures = [pool.submit(_worker, job, events) for job in jobs]
        pending = set(futures)
        while pending:
            done, pending = cf.wait(pending, timeout=0.2)
            for f in done:
                on_model(f.result())  # a worker's error surfaces here
            while True:
                try:
                    kind, value = events.get_nowait()
                except queue_mod.Empty:
                    break
                getattr(reporter, kind)(value)
        return [row for f in futures for row in f.result()]


def _have_rich() -> bool:
    """rich draws the progress bar and the table; without it (a bare install) the
    harness prints plain progress lines and a markdown table."""
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    t0 = time.perf_counter()
    have_rich = _have_rich()
    finished: list[dict] = []

    def save_partial(model_rows: list[dict]) -> None:  # a run cut short keeps its finished models
        finished.extend(model_rows)
        if args.json:
            write_json(args, argv, config, finished, time.perf_counter() - t0, complete=False)

    try:
        jobs, config = plan_jobs(args)
        parallel = args.jobs
        if args.no_progress or not have_rich:
            rows = run_jobs(jobs, Reporter(), parallel, save_partial)
        else:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            total = sum(len(j.specs) * len(j.requests) for j in jobs)
            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          TimeRemainingColumn(), console=Console(stderr=True)) as progress:
                rows = run_jobs(jobs, BarReporter(progress, total), parallel, save_partial)
    except (QualityError, WorkloadError, EngineError) as exc:
        msg = exc.args[0] if exc.args else str(exc)
        print(f"error: {msg}", file=sys.stderr)
        return 2
    summary = summarize(rows, args.tolerance)
    seconds = time.perf_counter() - t0
    title = (f"quality vs full recompute: {config['n']} requests per task, seed {config['seed']}, "
             f"{config['device']}, {seconds:.0f} s")
    print_report(rows, summary, config["tasks"], args.tolerance, args.markdown or not have_rich, title)
    if args.json:
        print(f"wrote {write_json(args, argv, config, rows, seconds, complete=True)}")
    return 0


def write_json(args: argparse.Namespace, argv: list[str], config: dict, rows: list[dict], seconds: float,
               complete: bool) -> Path:
    """The run's rows and summary as JSON, written atomically; `complete` is False while
    models are still being measured."""
    path = Path(args.json_path) if args.json_path else default_json_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"schema": SCHEMA, "date": _dt.date.today().isoformat(),
           "command": "python -m tools.quality " + shlex.join(argv), "config": config,
           "environment": environment(config["device"]), "seconds": seconds, "complete": complete, "rows": rows,
           "summary": summarize(rows, args.tolerance)}
    return write_json_file(path, doc)


if __name__ == "__main__":
    sys.exit(main())
