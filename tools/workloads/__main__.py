"""CLI: write request streams as JSONL and print their statistics.

    python -m tools.workloads TASK|all --n N --seed S [--scale tiny|bench]
        [-o FILE.jsonl | --out-dir DIR] [--stats]
        [--pool-size P] [--zipf S] [--docs MIN-MAX] [--doc-tokens T] [--facts-per-doc F]
        [--max-tokens M]

Each output line is one request: {"id", "task", "segments": [{"text", "cache"}],
"answer", "metric"} (the `kvengine run --requests` format; the engine ignores task,
answer and metric). Without -o / --out-dir and without --stats, JSONL goes to stdout.
`all` writes the five tasks one after the other (or one file per task with --out-dir).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence, TextIO

from .common import TASKS
from .config import SCALES, make_config
from .errors import WorkloadError
from .generate import iter_requests
from .stats import WorkloadStats, format_table, workload_stats


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.workloads",
                                description="Generate synthetic segmented-prompt workloads.")
    p.add_argument("task", choices=[*TASKS, "all"], help="workload name, or 'all' for the five")
    p.add_argument("--n", type=int, default=100, help="requests per task (default 100)")
    p.add_argument("--seed", type=int, default=0, help="seed of pool and requests (default 0)")
    p.add_argument("--scale", choices=SCALES, default="tiny", help="tiny (training/quality) or bench (serving)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("-o", "--output", help="JSONL file to write (all tasks into one file for 'all')")
    out.add_argument("--out-dir", help="directory to write TASK.jsonl per task")
    p.add_argument("--stats", action="store_true", help="print a statistics table")
    p.add_argument("--pool-size", type=int, help="documents (example blocks) in the pool")
    p.add_argument("--zipf", type=float, help="Zipf popularity exponent (0 = uniform)")
    p.add_argument("--docs", help="documents per request: N or MIN-MAX")
    p.add_argument("--doc-tokens", type=int, help="mean document length in tokens (bytes)")
    p.add_argument("--facts-per-doc", type=int, help="mean facts (examples) per document")
    p.add_argument("--max-tokens", type=int, help="redraw requests whose prompt + answer exceed this (0: no bound)")
    return p


def _write(lines_to: TextIO | None, task: str, args: argparse.Namespace) -> WorkloadStats:
    cfg = make_config(task, args.scale, pool_size=args.pool_size, zipf=args.zipf, docs=args.docs,
                      doc_tokens=args.doc_tokens, facts_per_doc=args.facts_per_doc,
                      max_tokens=args.max_tokens)
    reqs = []
    for req in iter_requests(task, args.n, args.seed, config=cfg):
        if lines_to is not None:
            lines_to.write(req.to_json() + "\n")
        reqs.append(req)
    return workload_stats(reqs, task)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tasks = list(TASKS) if args.task == "all" else [args.task]
    rows: list[WorkloadStats] = []
    try:
        if args.out_dir:
            os.makedirs(args.out_dir, exist_ok=True)
            for task in tasks:
                with open(os.path.join(args.out_dir, f"{task}.jsonl"), "w", encoding="ascii", newline="\n") as f:
                    rows.append(_write(f, task, args))
        elif args.output:
            with open(args.output, "w", encoding="ascii", newline="\n") as f:
                rows = [_write(f, task, args) for task in tasks]
        else:
            sink = None if args.stats else sys.stdout
            rows = [_write(sink, task, args) for task in tasks]
    except WorkloadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # stdout closed early (e.g. piped into head): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    if args.stats:
        print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
