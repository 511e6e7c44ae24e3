"""`kvengine index`: compute and store the signatures of segments a deployment knows will
recur (a RAG corpus's documents, system prompts, tool outputs) before any request names
them, so the first request that does hits them (LLMEngine.index_segments,
engine/pic/index.py).

    kvengine index --preset NAME|--model DIR --segments FILE.jsonl --store [SOCKET] [--json]

FILE holds one `{"text": "..."}` object per line (an `id` field is allowed and ignored;
blank lines are skipped). The whole file is checked before anything is computed: a bad
line exits 2 naming its line. `--store` is required (an index kept in this process would
end with it). Texts are stored in file order; when they outgrow the daemon's faster tiers
its LRU keeps the last ones there, so put the most read last. Prints one summary line
(`--json`: one JSON object: the IndexReport's fields and the connector's put counts); a
progress line on a terminal. Exit 1 when a put failed or was dropped (the segments it
names are not in the store).
"""
from __future__ import annotations

import json
import sys
import typer

from engine.cli_options import (PicArgs, attach_store, build, check_store_answers, connector_config, engine_config,
                                fail, model_source, pic_options, pic_settings)
from engine.errors import EngineError

#: connector counters the summary reports (their change over the call)
PUT_COUNTS = ("puts_stored", "puts_exists", "puts_dropped", "put_bytes")


def read_segments(path: str) -> list[str]:
    """The texts of FILE (module docstring); one-line errors name the line."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        fail(f"--segments: cannot read {path}: {exc.strerror or exc}")
    except UnicodeDecodeError as exc:
        fail(f"--segments: {path} is not UTF-8 ({exc.reason})")
    texts: list[str] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            fail(f"--segments: line {n}: not JSON ({exc.msg})")
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            fail(f"--segments: line {n}: needs an object with a string \"text\"")
        unknown = set(obj) - {"text", "id"}
        if unknown:
            fail(f"--segments: line {n}: unknown field {sorted(unknown)[0]!r} (allowed: text, id)")
        if not obj["text"]:
            fail(f"--segments: line {n}: \"text\" is empty")
        texts.append(obj["text"])
    if not texts:
        fail(f"--segments: {path} holds no segment")
    return texts


@pic_options
def index_cmd(
    segments: str = typer.Option(..., "--segments", help="JSONL file, one {\"text\": ...} per line."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object instead of a summary line."),
    *,
    opts: PicArgs,
) -> None:
    """Compute and store the signatures of the segments in FILE before any request names
    them, so the first request that does hits them (--store required)."""
    source = model_source(opts.preset, opts.model)
    settings = pic_settings(opts, None)
    if settings.pic.method not in ("pic", "naive"):
        fail(f"--pic-config: method {settings.pic.method!r} keeps no segment signatures; index needs pic or naive")
    connector = connector_config(settings, opts.store)
    if connector is None:
        fail("--store: index keeps signatures in the kvstore daemon; give --store [SOCKET]")
    texts = read_segments(segments)
    check_store_answers(connector, opts.start_without_store)
    engine = build(source, engine_config(opts.device, opts.dtype, 1, max(2048, opts.chunk_size), opts.chunk_size,
                                         None, None))
    planner = attach_store(engine, settings.pic, connector)
    before = planner.store.metrics.snapshot()
    progress = _Progress() if sys.stderr.isatty() else None
    try:
        report = engine.index_segments(texts, progress=progress)
    except EngineError as exc:
        fail(str(exc), 1)
    finally:
        if progress is not None:
            progress.close()
        planner.store.close()  # finishes the queued puts
    after = planner.store.metrics.snapshot()
    puts = {k: after.get(k, 0) - before.get(k, 0) for k in PUT_COUNTS}
    failed0 = before.get("puts_failed", {})
    failed = {k: v - failed0.get(k, 0) for k, v in after.get("puts_failed", {}).items() if v > failed0.get(k, 0)}
    out = {**report.to_dict(), **puts, "puts_failed": failed}
    if as_json:
        typer.echo(json.dumps(out))
    else:
        typer.echo(f"indexed {report.segments} segments ({report.tokens} tokens): {report.computed} computed, "
                   f"{report.present} already stored, {report.seconds:.1f} s; stored {puts['puts_stored']} "
                   f"({puts['put_bytes'] / 2**20:.1f} MiB), dropped {puts['puts_dropped']}, failed {sum(failed.values())}")
    if puts["puts_dropped"] or failed or not report.flushed:
        fail("some signatures were not stored (dropped, failed or still queued at the end): run index again", 1)


class _Progress:
    """`[done/total] segments` on one rewritten stderr line (a terminal only)."""

    def __call__(self, rep) -> None:
        sys.stderr.write(f"\r\033[K[{rep.computed + rep.present}/{rep.segments}] segments, {rep.seconds:.0f} s")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()
