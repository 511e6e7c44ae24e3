"""`kvengine run`: segmented requests from a JSONL file, through one engine, in file order,
with one prefill method; one result record per request.

Input, one request per line (extra fields are ignored):
    {"id": "...", "segments": [{"text": "...", "cache": true}, ..., {"text": "Q...", "cache": false}]}

Requests run one at a time in one process, so the signature cache (or the prefix tree)
lives across them: a later request hits segments an earlier one computed, in any order
and at any offset. Each record (`--json` prints one JSON line per request) has `id`,
`text` (greedy output), `prompt_tokens`, `reused_tokens`, `recomputed_tokens`,
`ttft_ms`, the token parts (`seam_tokens`, `suffix_tokens`, `miss_tokens`,
`hit_segments`, `miss_segments`), the time split (`lookup_ms`, `miss_ms`,
`load_compose_ms`, `seam_ms`, `suffix_ms`, `checkpoint_ms`, `decode_ms`),
`output_tokens`, `finish_reason`, `method` and `seam`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

from engine.errors import InvalidRequestError
from engine.pic.config import PicConfig
from engine.pic.planner import make_planner
from engine.runtime.sampling import SamplingParams


@dataclass(frozen=True)
class RunRequest:
    id: str
    segments: list[dict]


def parse_request(line: str, where: str) -> RunRequest:
    """One JSONL line -> RunRequest; `InvalidRequestError` naming `where` and the field."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(where, f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise InvalidRequestError(where, f"must be a JSON object, got {type(obj).__name__}")
    rid = obj.get("id")
    if not isinstance(rid, str) or not rid:
        raise InvalidRequestError(f"{where}.id", f"must be a non-empty string, got {rid!r}")
    segs = obj.get("segments")
    if not isinstance(segs, list) or not segs:
        raise InvalidRequestError(f"{where}.segments", "must be a non-empty list")
    out = []
    for j, s in enumerate(segs):
        field_name = f"{where}.segments[{j}]"
        if not isinstance(s, dict):
            raise InvalidRequestError(field_name, f"must be an object, got {type(s).__name__}")
        if not isinstance(s.get("text"), str):
            raise InvalidRequestError(f"{field_name}.text", f"must be a string, got {s.get('text')!r}")
        cache = s.get("cache", False)
        if not isinstance(cache, bool):
            raise InvalidRequestError(f"{field_name}.cache", f"must be true or false, got {cache!r}")
        out.append({"text": s["text"], "cache": cache})
    return RunRequest(rid, out)


def read_requests(path: str | Path) -> list[RunRequest]:
    """Every non-blank line of a JSONL file."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InvalidRequestError("requests", f"cannot read {str(p)!r}: {exc.strerror}") from None
    reqs = [parse_request(line, f"{p.name}:{i + 1}") for i, line in enumerate(lines) if line.strip()]
    if not reqs:
        raise InvalidRequestError("requests", f"{str(p)!r} holds no requests")
    return reqs


def attach_planner(engine, config: PicConfig, signature_cache=None, prefix_tree=None):
    """Install the planner of `config` in a built engine; returns it."""
    planner = make_planner(config, engine.runner.model, engine.loaded_model.fingerprint, engine.tokenizer,
                           signature_cache=signature_cache, prefix_tree=prefix_tree)
    engine.set_planner(planner)
    engine.sync_timings = config.sync_timing
    return planner


def run_requests(engine, planner, requests: Iterable[RunRequest], max_new_tokens: int,
                 stop_strings: tuple[str, ...] = ()) -> Iterator[dict]:
    """Run each request alone to completion (greedy); yield its record."""
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_strings=stop_strings)
    for r in requests:
        engine.add_request(r.segments, params, request_id=r.id)
        final = None
        while final is None:
            for out in engine.step():
                if out.request_id == r.id and out.finished:
                    final = out
        yield make_record(r.id, final, planner.take_report(r.id), planner)


def make_record(request_id: str, out, report, planner) -> dict:
    tl = out.timeline
    rec = {"id": request_id, "text": out.text, "prompt_tokens": out.num_prompt_tokens}
    if report is None:  # refused or aborted before its prefill completed
        rec.update(reused_tokens=0, recomputed_tokens=0, ttft_ms=None, error=out.error)
        return rec
    d = report.as_dict()
    rec["reused_tokens"] = d.pop("reused_tokens")
    rec["recomputed_tokens"] = d.pop("recomputed_tokens")
    rec["ttft_ms"] = None if tl.ttft is None else round(tl.ttft * 1e3, 3)
    d.pop("prompt_tokens")
    rec.update(d)
    rec["decode_ms"] = None if (tl.finished is None or tl.first_token is None) else round(
        (tl.finished - tl.first_token) * 1e3, 3)
    rec["output_tokens"] = len(out.token_ids)
    rec["finish_reason"] = out.finish_reason
    rec["seam"] = getattr(planner, "seam", None)
    if out.error:
        rec["error"] = out.error
    return rec


def summarize(records: list[dict]) -> dict:
    """Totals over a run: tokens reused/recomputed, reuse fraction, mean TTFT."""
    prompt = sum(r["prompt_tokens"] for r in records)
    reused = sum(r.get("reused_tokens") or 0 for r in records)
    recomputed = sum(r.get("recomputed_tokens") or 0 for r in records)
    ttfts = [r["ttft_ms"] for r in records if r.get("ttft_ms") is not None]
    return {"requests": len(records), "prompt_tokens": prompt, "reused_tokens": reused,
            "recomputed_tokens": recomputed, "reuse_fraction": reused / prompt if prompt else 0.0,
            "ttft_ms_mean": sum(ttfts) / len(ttfts) if ttfts else None}


def print_table(records: list[dict], title: str, stats: Optional[dict] = None) -> None:
    """A rich table of the records and a summary line."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("id", "prompt", "reused", "recomputed", "seam", "miss", "TTFT ms", "load ms", "seam ms",
                "suffix ms", "output"):
        table.add_column(col, justify="left" if col in ("id", "output") else "right")
    for r in records:
        table.add_row(r["id"], str(r["prompt_tokens"]), str(r.get("reused_tokens", 0)),
                      str(r.get("recomputed_tokens", 0)), str(r.get("seam_tokens", 0)), str(r.get("miss_tokens", 0)),
                      _ms(r.get("ttft_ms")), _ms(r.get("load_compose_ms")), _ms(r.get("seam_ms")),
                      _ms(r.get("suffix_ms")), repr(r["text"][:40]))
    console = Console()
    console.print(table)
    s = summarize(records)
    line = (f"{s['requests']} requests: {s['reused_tokens']} of {s['prompt_tokens']} prompt tokens reused "
            f"({100 * s['reuse_fraction']:.1f}%), {s['recomputed_tokens']} recomputed")
    if s["ttft_ms_mean"] is not None:
        line += f", mean TTFT {s['ttft_ms_mean']:.1f} ms"
    if stats:
        line += f"; cache {json.dumps(stats)}"
    console.print(line)


def _ms(v) -> str:
    return "-" if v is None else f"{v:.1f}"
