"""The tiered serving benchmark's summary (tools/bench_tiered.py): `summarize` turns a
run's presets into issue 23's summary fields; `merge_runs` / `merge_docs` join runs
(`--merge RUN...`) and recompute it, and `serve_runs` takes the serve phase's headline
fields as the median over the joined runs that measured them (bench_tiered's docstring
says what each field means)."""
from __future__ import annotations

import statistics
from typing import Optional

from tools.results import merge_presets, read_runs


def summarize(presets: dict, pcie: dict) -> dict:
    from tools.servebench import report, tiered

    # report.summarize reads bench_serving's qps layout; this run's qps is summarized here
    base = report.summarize({n: {k: v for k, v in p.items() if k not in ("qps", "qps_indexed")}
                             for n, p in presets.items()})
    gains, repeats, sweep, be = [], [], [], {}
    gains_ix, repeats_ix = [], []
    snaps = []
    for name, p in presets.items():
        for key, g, rows in (("qps", gains, repeats), ("qps_indexed", gains_ix, repeats_ix)):
            q = p.get(key) or {}
            if q.get("gain_vs_prefix"):
                g.append(q["gain_vs_prefix"]["median"])
            rows += [{"preset": name, "repeat": j, "prefix_qps": r["prefix"]["sustainable_qps"],
                      "pic_qps": r["pic"]["sustainable_qps"], "gain": r["gain_vs_prefix"],
                      "converged": r["prefix"]["converged"] and r["pic"]["converged"]}
                     for j, r in enumerate(q.get("repeats") or [])]
        for pt in (p.get("sweep") or {}).get("points") or []:
            sweep.append({"preset": name, **pt})
        if p.get("break_even"):
            be[name] = p["break_even"]["break_even_read_gb_per_s"]
        snaps += [(f"{name}:{phase}", p[k]) for phase, k in (("serve", "connector_pic"), ("sweep", "connector_sweep"))
                  if p.get(k)]
        if (p.get("cpu_tier_step") or {}).get("connector"):
            snaps.append((f"{name}:cpu_tier_step", p["cpu_tier_step"]["connector"]))
    serving = tiered.serving_cpu_to_gpu([s for _, s in snaps])
    # which phases' CPU-tier copies the figure is made of (bench_tiered's docstring)
    serving["by_phase"] = {n: {"copy_bytes": s.get("h2d_copy_bytes", 0), "copy_ms": s.get("h2d_copy_ms_total", 0.0),
                               "issue_ms": s.get("h2d_issue_ms_total", 0.0),
                               "gb_per_s": tiered.serving_cpu_to_gpu([s])["gb_per_s"]} for n, s in snaps}
    serving["source"] = [n for n, s in snaps if s.get("h2d_copy_bytes")]
    h2d = pcie.get("pinned_h2d_gbps")
    frac = serving["gb_per_s"] / h2d if serving["gb_per_s"] and h2d else None
    return {"ttft_vs_best_baseline_avg": base["ttft_vs_best_baseline_avg"],
            "ttft_vs_best_baseline_min": base["ttft_vs_best_baseline_min"],
            "exact_repeat_pic_over_prefix_ttft": base["exact_repeat_pic_over_prefix_ttft"],
            "qps_gain_vs_prefix_at_slo_median": statistics.median(gains) if gains else None,
            "qps_repeats": repeats, "cpu_to_gpu_fraction_of_pcie_serving": frac,
            "qps_gain_vs_prefix_at_slo_median_indexed_corpus": statistics.median(gains_ix) if gains_ix else None,
            "qps_repeats_indexed_corpus": repeats_ix,
            "cpu_to_gpu_serving": {**serving, "pinned_h2d_gbps": h2d},
            "working_set_sweep": sweep, "break_even_read_gb_per_s": be,
            "ttft_vs_full_avg": base["ttft_reduction_vs_full_avg"],
            "ttft_vs_prefix_avg": base["ttft_reduction_vs_prefix_avg"],
            "prefix_reuse_by_workload": base["prefix_reuse_by_workload"]}


def merge_runs(paths: list[str]) -> dict:
    runs = read_runs(paths, "bench_tiered")
    doc = merge_docs(runs)
    doc["merged_from"] = [str(p) for p in paths]
    per_run = serve_runs(runs, [str(p) for p in paths])
    if per_run:
        doc["summary"]["serve_runs"] = per_run
        for key, rec in per_run.items():  # the headline: the median over the runs
            doc["summary"][key] = rec["median"]
    return doc


#: the serve phase's headline fields, taken as the median over runs when runs are joined
SERVE_HEADLINE = ("ttft_vs_best_baseline_avg", "ttft_vs_best_baseline_min", "exact_repeat_pic_over_prefix_ttft")


def serve_runs(runs: list[dict], paths: list[str]) -> dict:
    """The serve phase's headline fields run by run, over joined runs (`--merge RUN...`)
    of which two or more measured one: per field each run's value (`values`, `runs`:
    their files, `n`: timed requests per workload), the median, min and max. The
    averages over workloads come only from the runs that served the most workloads (a
    run of `repeat` alone says nothing of the mean over eight); the exact-repeat ratio
    from every run that served `repeat`. Empty when no field has two runs."""
    def workloads(r: dict) -> int:
        return max((len(p.get("workloads") or {}) for p in r["presets"].values()), default=0)

    def n_of(r: dict) -> Optional[int]:
        for p in r["presets"].values():
            for w in (p.get("workloads") or {}).values():
                n = ((w.get("pic") or {}).get("warm") or {}).get("n")
                if n:
                    return n
        return None

    most = max((workloads(r) for r in runs), default=0)
    out: dict = {}
    for key in SERVE_HEADLINE:
        picked = [(r, path) for r, path in zip(runs, paths) if (r.get("summary") or {}).get(key) is not None
                  and (key == "exact_repeat_pic_over_prefix_ttft" or workloads(r) == most)]
        if len(picked) < 2:
            continue
        values = [r["summary"][key] for r, _ in picked]
        out[key] = {"values": values, "runs": [p for _, p in picked], "n": [n_of(r) for r, _ in picked],
                    "median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def merge_docs(runs: list[dict]) -> dict:
    """Runs (each a run JSON, maybe itself merged) joined into one: per preset, each key
    from the first run that has it (tools.results.merge_presets; workloads one by one)
    but the engine's connector snapshot (`connector_pic`, the summary's serve-phase
    copies), which comes from the first run that served workloads when one did,
    the phases' records one by one, the pinned PCIe figure from the first run that
    measured one; the summary recomputed from the joined presets."""
    presets = merge_presets(runs)
    for name, pre in presets.items():
        # the engine's connector snapshot stands for the serve phase: from a run that served workloads
        served = [r["presets"][name]["connector_pic"] for r in runs
                  if (r["presets"].get(name) or {}).get("workloads") and r["presets"][name].get("connector_pic")]
        if served:
            pre["connector_pic"] = served[0]
        phases: dict = {}
        for r in runs:
            for ph, rec in ((r["presets"].get(name) or {}).get("phases") or {}).items():
                phases.setdefault(ph, rec)
        pre["phases"] = phases
    pcie = next((r["pcie"] for r in runs if (r.get("pcie") or {}).get("pinned_h2d_gbps")), runs[0].get("pcie") or {})
    configs = []
    for r in runs:
        configs += r["config"] if isinstance(r.get("config"), list) else [r.get("config")]
    return {"date": runs[0].get("date"), "command": " && ".join(r.get("command", "?") for r in reversed(runs)),
            "machine": runs[0].get("machine"), "quick": any(r.get("quick") for r in runs),
            "config": configs, "complete": all(r.get("complete") for r in runs), "pcie": pcie, "presets": presets,
            "summary": summarize(presets, pcie), "wall_s": sum(r.get("wall_s") or 0.0 for r in runs)}
