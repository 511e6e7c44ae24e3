"""`kvengine run`: segmented requests from a JSONL file, in file order, with one prefill
method (position-independent caching or a baseline); reuse and timing per request.

`run` checks every request of the file (JSON, fields, a non-empty prompt that fits the
model) before it computes anything; in table mode it prints each request's row as it
finishes, a progress line on a terminal, and a summary whose mean TTFT leaves out the
first request (it carries the warm-up; reported apart). Its PIC settings are
engine.connector.settings.PicSettings: defaults, `--pic-config FILE`, then `--method`
and `--seam` (engine.cli_options.pic_settings).
"""
from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from engine.cli_options import (PicArgs, attach_store, build, check_store_answers, connector_config, engine_config,
                                fail, hisparse_settings, model_source, option, pic_for_hisparse, pic_options,
                                pic_settings)
from engine.errors import EngineError, InvalidRequestError


@pic_options
def run_cmd(
    requests: str = typer.Option(..., "--requests", help="JSONL file, one {id, segments: [{text, cache}]} per line."),
    method: Optional[str] = typer.Option(None, "--method", metavar="full|prefix|naive|pic",
                                         help="Prefill method: full, prefix, naive or pic (default pic)."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", min=0),
    as_json: bool = typer.Option(False, "--json", help="One JSON line per request instead of a table."),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    *,
    opts: PicArgs,
) -> None:
    """Run segmented requests in file order with one prefill method (position-independent
    caching or a baseline); print reuse and timing per request. With --store, signatures
    come from and go to the kvstore daemon, so a later run (another process) reuses what
    an earlier one computed."""
    from engine.pic.run import attach_planner, read_requests

    source = model_source(opts.preset, opts.model)
    settings = pic_settings(opts, method)
    config = settings.pic
    hs = hisparse_settings(opts.hisparse)
    if hs is not None:
        config = pic_for_hisparse(config)
    try:
        reqs = read_requests(requests)
    except InvalidRequestError as exc:
        fail(f"--requests: {exc.message}" if exc.field == "requests" else f"--requests: {exc}")
    connector = connector_config(settings, opts.store)
    if connector is not None and config.method not in ("pic", "naive", "prefix"):
        fail(f"--store: method {config.method!r} keeps nothing in the store; use --method pic, naive or prefix")
    if connector is not None:
        check_store_answers(connector, opts.start_without_store)
    engine = build(source, engine_config(opts.device, opts.dtype, 1, max(2048, opts.chunk_size), opts.chunk_size,
                                         None, None, hisparse=hs))
    check_requests(engine, reqs, max_new_tokens, stop)  # every request, before any runs
    planner = attach_planner(engine, config) if connector is None else attach_store(engine, config, connector)
    try:
        run_and_print(engine, planner, reqs, max_new_tokens, stop, as_json, source, config.method,
                      connector is not None, config.fused)
    finally:
        if connector is not None:
            planner.store.close()  # finishes the queued puts: the next process finds them
        if engine.kv_offload is not None:
            engine.kv_offload.close()


def check_requests(engine, reqs, max_new_tokens: int, stop: Optional[list[str]]) -> None:
    """Refuse the run (exit 2) at the first request the engine would refuse, naming its
    line and id, before computing anything."""
    from engine.runtime.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_strings=tuple(stop or ()))
    for r in reqs:
        try:
            engine.check_prompt(r.segments, params)
        except InvalidRequestError as exc:
            field = option(exc.field) if exc.field == "max_new_tokens" else exc.field
            fail(f"--requests: {r.where} (id {r.id}): {field}: {exc.message}")


def run_and_print(engine, planner, reqs, max_new_tokens, stop, as_json, preset, method, with_store,
                  fused: bool = True) -> None:
    from engine.pic.run import RunTable, run_requests

    table = None
    if not as_json:
        title = f"{preset} method={method}" + (f" seam={planner.seam}" if hasattr(planner, "seam") else "")
        table = RunTable(title, fused=fused and method in ("pic", "naive", "prefix"))
    progress = Progress(len(reqs)) if sys.stderr.isatty() else None
    try:
        for i, rec in enumerate(run_requests(engine, planner, reqs, max_new_tokens, tuple(stop or ()),
                                             idle_between=True)):
            if with_store:
                sr = planner.take_store_report(rec["id"])
                if sr is not None:
                    rec.update(sr.as_dict())
            if progress is not None:
                progress.done(i + 1, rec["id"])
            if as_json:
                typer.echo(json.dumps(rec))
            else:
                table.add(rec)
    except InvalidRequestError as exc:
        fail(f"{exc.field}: {exc.message}", 1)
    except EngineError as exc:
        fail(str(exc), 1)
    finally:
        if progress is not None:
            progress.close()
    while engine.help_idle():  # cold fallback, context signatures, exact prefixes: finish the queued work
        pass
    if with_store:
        planner.store.flush()
    if table is not None:
        stats = planner.cache.stats().as_dict() if hasattr(planner, "cache") else (
            planner.tree.stats() if hasattr(planner, "tree") else None)
        table.finish(stats)
        if with_store:
            typer.echo(f"store connector: {json.dumps(planner.store.metrics.snapshot())}")


class Progress:
    """`[i/N] done: ID` on one rewritten stderr line while requests run (a terminal only)."""

    def __init__(self, total: int) -> None:
        self.total = total
        sys.stderr.write(f"\r[0/{total}] running...")
        sys.stderr.flush()

    def done(self, i: int, request_id: str) -> None:
        sys.stderr.write(f"\r\033[K[{i}/{self.total}] done: {request_id}")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()
