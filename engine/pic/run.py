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
`load_compose_ms`, `seam_ms`, `suffix_ms`, `checkpoint_ms`, `fused_ms`: the one-pass
prefill where splices, seams and suffix run together, `decode_ms`), `output_tokens`,
`finish_reason`, `method` and `seam`. A request whose segments hold no text is refused
when the file is read (nothing runs).
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
    where: str = ""  # FILE:LINE it was read from


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
    if not any(s["text"] for s in out):
        raise InvalidRequestError(f"{where}.segments", f"request {rid} has no tokens (every segment's text is empty)")
    return RunRequest(rid, out, where)


def read_requests(path: str | Path) -> list[RunRequest]:
    """Every non-blank line of a JSONL file."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InvalidRequestError("requests", f"cannot read {p}: {exc.strerror}") from None
    reqs = [parse_request(line, f"{p.name}:{i + 1}") for i, line in enumerate(lines) if line.strip()]
    if not reqs:
        raise InvalidRequestError("requests", f"{p} holds no requests")
    return reqs


def attach_planner(engine, config: PicConfig, signature_cache=None, prefix_tree=None):
    """Install the planner of `config` in a built engine; returns it."""
    planner = make_planner(config, engine.runner.model, engine.loaded_model.fingerprint, engine.tokenizer,
                           signature_cache=signature_cache, prefix_tree=prefix_tree)
    engine.set_planner(planner)
    engine.sync_timings = config.sync_timing
    return planner


def run_requests(engine, planner, requests: Iterable[RunRequest], max_new_tokens: int,
                 stop_strings: tuple[str, ...] = (), idle_between: bool = False) -> Iterator[dict]:
    """Run each request alone to completion (greedy); yield its record. `idle_between`:
    the engine does its idle work (`LLMEngine.help_idle`: queued alone passes, exact
    prefixes) before each request after the first, as a serving engine does between
    requests."""
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_strings=stop_strings)
    for i, r in enumerate(requests):
        if idle_between and i:
            while engine.help_idle():
                pass
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
    """Totals over a run: tokens reused/recomputed, reuse fraction, TTFT: the mean over
    every request, the first request's (it carries the warm-up: kernel compilation,
    allocator growth) and the mean over the rest."""
    prompt = sum(r["prompt_tokens"] for r in records)
    reused = sum(r.get("reused_tokens") or 0 for r in records)
    recomputed = sum(r.get("recomputed_tokens") or 0 for r in records)
    ttfts = [r["ttft_ms"] for r in records if r.get("ttft_ms") is not None]
    rest = ttfts[1:]
    return {"requests": len(records), "prompt_tokens": prompt, "reused_tokens": reused,
            "recomputed_tokens": recomputed, "reuse_fraction": reused / prompt if prompt else 0.0,
            "ttft_ms_mean": sum(ttfts) / len(ttfts) if ttfts else None,
            "ttft_ms_first": ttfts[0] if ttfts else None,
            "ttft_ms_mean_after_first": sum(rest) / len(rest) if rest else None}


class RunTable:
    """`kvengine run`'s table, printed a row at a time as each request finishes (so the
    results of finished requests are on screen even if a later one fails), then a summary
    line. Time columns: `fused ms` for a fused (one-pass) prefill, else `load ms`, `seam
    ms`, `suffix ms` (the other layout's columns would read 0)."""

    def __init__(self, title: str, fused: bool, out=None) -> None:
        import sys

        self.out = out if out is not None else sys.stdout
        self.fused = fused
        self.records: list[dict] = []
        times = [("fused ms", "fused_ms")] if fused else [("load ms", "load_compose_ms"), ("seam ms", "seam_ms"),
                                                          ("suffix ms", "suffix_ms")]
        self.columns = [("id", None, 16), ("prompt", "prompt_tokens", 7), ("reused", "reused_tokens", 7),
                        ("recomputed", "recomputed_tokens", 10), ("seam", "seam_tokens", 6),
                        ("miss", "miss_tokens", 6), ("TTFT ms", "ttft_ms", 9)]
        self.columns += [(name, key, max(9, len(name))) for name, key in times] + [("output", "text", 0)]
        self._write(title)
        self._write(self._line([c[0] for c in self.columns]))

    def _line(self, cells: list[str]) -> str:
        parts = []
        for (name, _key, width), cell in zip(self.columns, cells):
            parts.append(cell.ljust(width) if name in ("id", "output") else cell.rjust(width))
        return "  ".join(parts).rstrip()

    def _write(self, line: str) -> None:
        self.out.write(line + "\n")
        self.out.flush()

    def add(self, r: dict) -> None:
        self.records.append(r)
        cells = []
        for name, key, _w in self.columns:
            if key is None:
                cells.append(r["id"])
            elif key == "text":
                cells.append(json.dumps(r["text"][:40]) if "error" not in r else f"error: {r['error']}")
            elif key.endswith("_ms"):
                cells.append(_ms(r.get(key)))
            else:
                cells.append(str(r.get(key, 0)))
        self._write(self._line(cells))

    def finish(self, stats: Optional[dict] = None) -> dict:
        s = summarize(self.records)
        line = (f"{s['requests']} requests: {s['reused_tokens']} of {s['prompt_tokens']} prompt tokens reused "
                f"({100 * s['reuse_fraction']:.1f}%), {s['recomputed_tokens']} recomputed")
        if s["ttft_ms_mean_after_first"] is not None:
            rest = "request 2" if s["requests"] == 2 else f"requests 2-{s['requests']}"
            line += (f", mean TTFT {s['ttft_ms_mean_after_first']:.1f} ms over {rest} "
                     f"(the first, with warm-up: {s['ttft_ms_first']:.1f} ms)")
        elif s["ttft_ms_first"] is not None:
            line += f", TTFT {s['ttft_ms_first']:.1f} ms (one request: includes warm-up)"
        if stats:
            line += f"; cache {json.dumps(stats)}"
        self._write(line)
        return s


def _ms(v) -> str:
    return "-" if v is None else f"{v:.1f}"
