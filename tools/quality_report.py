"""The quality harness's report (tools/quality.py): table rows from each method's outcomes,
deltas to full recomputation, the best PIC seam per model, and the printed table (rich,
or markdown with `--markdown`). See docs/quality.md for what each column means."""
from __future__ import annotations

from typing import Optional, Sequence

from tools.quality_measure import MethodRun

# ------------------------------------------------------------------------ aggregation
def make_row(model: str, weights: str, run: MethodRun, tasks: Sequence[str]) -> dict:
    """One table row from a method's outcomes (deltas are filled by `add_deltas`)."""
    spec = run.spec
    per_task = {}
    for task in tasks:
        outs = [o for o in run.outcomes if o.task == task]
        if not outs:
            continue
        positions = sum(o.positions for o in outs)
        kl = None if outs[0].kl_sum is None else sum(o.kl_sum for o in outs) / positions
        top1 = None if outs[0].top1_hits is None else 100.0 * sum(o.top1_hits for o in outs) / positions
        per_task[task] = {"n": len(outs), "score": sum(o.points for o in outs) / len(outs), "delta": None,
                          "kl": kl, "top1": top1, "positions": positions}
    outs = run.outcomes
    prompt = sum(o.prompt_tokens for o in outs)
    recomputed = sum(o.recomputed_tokens for o in outs)
    prefill_ms = 1e3 * sum(o.prefill_s for o in outs) / len(outs)
    decode_ms = 1e3 * sum(o.decode_s for o in outs) / len(outs)
    kls = [t["kl"] for t in per_task.values()]
    top1s = [t["top1"] for t in per_task.values()]
    return {
        "model": model, "weights": weights, "method": spec.method, "seam": spec.seam, "swa_seam": spec.swa_seam,
        "miss_signatures": spec.miss_signatures,
        "label": spec.label, "tasks": per_task,
        "avg": sum(t["score"] for t in per_task.values()) / len(per_task), "avg_delta": None,
        "kl": None if None in kls else sum(kls) / len(kls),
        "top1": None if None in top1s else sum(top1s) / len(top1s),
        "requests": len(outs), "prompt_tokens": prompt, "reused_tokens": sum(o.reused_tokens for o in outs),
        "recomputed_tokens": recomputed, "recompute_fraction": recomputed / prompt if prompt else 0.0,
        "output_tokens": sum(o.output_tokens for o in outs),
        "prefill_ms_per_request": prefill_ms, "decode_ms_per_request": decode_ms,
        "ms_per_request": prefill_ms + decode_ms, "seconds": run.seconds, "cpu_seconds": run.cpu_seconds,
    }


def add_deltas(rows: list[dict], full: dict) -> None:
    """Fill each row's per-task and average deltas to the `full` row of its model."""
    for row in rows:
        for task, t in row["tasks"].items():
            t["delta"] = t["score"] - full["tasks"][task]["score"]
        row["avg_delta"] = row["avg"] - full["avg"]


def best_pic(rows: list[dict], tolerance: float) -> Optional[dict]:
    """The PIC row with the fewest recomputed tokens among those whose average delta is
    >= -tolerance; if none, the one with the best average delta (ties: fewer recomputed)."""
    pic = [r for r in rows if r["method"] == "pic"]
    if not pic:
        return None
    ok = [r for r in pic if r["avg_delta"] >= -tolerance]
    if ok:
        return min(ok, key=lambda r: (r["recompute_fraction"], -r["avg_delta"]))
    return max(pic, key=lambda r: (r["avg_delta"], -r["recompute_fraction"]))


def summarize(rows: list[dict], tolerance: float) -> dict:
    """Per model: full average, best PIC seam and its average delta, naive's and prefix's."""
    out = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        by_method = {r["method"]: r for r in mine if r["method"] != "pic"}
        best = best_pic(mine, tolerance)
        out[model] = {
            "weights": mine[0]["weights"],
            "full_avg": by_method["full"]["avg"],
            "best_pic_seam": None if best is None else best["seam"],
            "best_pic_swa_seam": None if best is None else best["swa_seam"],
            "best_pic_avg_delta": None if best is None else best["avg_delta"],
            "best_pic_recompute_fraction": None if best is None else best["recompute_fraction"],
            "best_pic_within_tolerance": None if best is None else best["avg_delta"] >= -tolerance,
            "naive_avg_delta": by_method["naive"]["avg_delta"] if "naive" in by_method else None,
            "prefix_avg_delta": by_method["prefix"]["avg_delta"] if "prefix" in by_method else None,
            "pic_seams": [{"seam": r["seam"], "swa_seam": r["swa_seam"], "avg_delta": r["avg_delta"], "kl": r["kl"],
                           "top1": r["top1"], "recompute_fraction": r["recompute_fraction"]}
                          for r in mine if r["method"] == "pic"],
        }
    return out


# --------------------------------------------------------------------------- output
def _signed(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:+.1f}"


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table_cells(row: dict, tasks: Sequence[str]) -> list[str]:
    cells = [row["model"], row["label"]]
    for task in tasks:
        t = row["tasks"].get(task)
        cells.append("-" if t is None else f"{t['score']:.1f} ({_signed(t['delta'])})")
    cells += [f"{row['avg']:.1f} ({_signed(row['avg_delta'])})", _fmt(row["kl"], ".2e"), _fmt(row["top1"], ".1f"),
              f"{100 * row['recompute_fraction']:.0f}",
              f"{row['prefill_ms_per_request']:.0f}+{row['decode_ms_per_request']:.0f}"]
    return cells


def table_header(tasks: Sequence[str]) -> list[str]:
    return ["model", "method", *tasks, "avg", "KL", "top-1 %", "recomp %", "ms/req"]


def summary_lines(summary: dict, tolerance: float) -> list[str]:
    lines = []
    for model, s in summary.items():
        parts = [f"{model} ({s['weights']}): full avg {s['full_avg']:.1f}"]
        if s["best_pic_seam"] is not None:
            rule = {"window": ", window rule", "seam": ", plain seam"}.get(s["best_pic_swa_seam"] or "", "")
            why = (f"fewest recomputed tokens within {tolerance:g} points" if s["best_pic_within_tolerance"]
                   else f"closest to full; none within {tolerance:g} points")
            parts.append(f"best PIC seam {s['best_pic_seam']}{rule} ({why}): avg delta "
                         f"{_signed(s['best_pic_avg_delta'])}, {100 * s['best_pic_recompute_fraction']:.0f}% "
                         "of prompt tokens recomputed")
        if s["naive_avg_delta"] is not None:
            parts.append(f"naive avg delta {_signed(s['naive_avg_delta'])}")
        if s["prefix_avg_delta"] is not None:
            parts.append(f"prefix avg delta {_signed(s['prefix_avg_delta'])}")
        lines.append("; ".join(parts))
    return lines


def print_report(rows: list[dict], summary: dict, tasks: Sequence[str], tolerance: float, markdown: bool,
                 title: str) -> None:
    if markdown:
        print(f"**{title}**\n")
        print("| " + " | ".join(table_header(tasks)) + " |")
        print("|" + "---|" * len(table_header(tasks)))
        for row in rows:
            print("| " + " | ".join(table_cells(row, tasks)) + " |")
        print()
        for line in summary_lines(summary, tolerance):
            print(f"- {line}")
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=220)
    table = Table(title=title)
    for col in table_header(tasks):
        table.add_column(col, justify="left" if col in ("model", "method") else "right")
    prev = None
    for row in rows:
        if prev is not None and row["model"] != prev:
            table.add_section()
        prev = row["model"]
        table.add_row(*table_cells(row, tasks))
    console.print(table)
    for line in summary_lines(summary, tolerance):
        console.print(line, highlight=False)
