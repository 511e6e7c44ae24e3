"""Regenerate docs/RELIABILITY.md: each fault of issue 18, the test that pins it, and
what that test counted.

    python -m tools.reliability_report            # run the registered tests, rewrite the file
    python -m tools.reliability_report --no-run   # rewrite from the registry only (results "not run")

The registry (`ROWS`) is the one list of reliability tests: a row names the fault, the
pytest node ids that pin it, and optionally the figures label the test reports under.
Adding a test to the report is adding its node id to a row. The script runs every
registered test that exists in this checkout in one pytest process (real daemons, real
sockets), reads each outcome from pytest's JUnit XML, and reads the figures the tests
recorded through `kvstore.testing.record_figures` (operations, objects verified, losses,
...) from the file it names in $KVSTORE_RELIABILITY_FIGURES. A node id whose file is not
in this checkout is listed as such (another branch adds it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kvstore.testing import FIGURES_ENV

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "RELIABILITY.md"
K = "tests/kvstore/"
E = "tests/engine/connector/"


@dataclass(frozen=True)
class Row:
    """One fault and the tests that pin it. `figures`: the label its test passes to
    record_figures (None: the test counts nothing beyond pass/fail)."""

    item: str
    fault: str
    tests: tuple[str, ...]
    figures: Optional[str] = None


ROWS: tuple[Row, ...] = (
    Row("1", "shared-memory arena pre-created or symlinked by another local user; a cache directory another user "
             "owns; a second daemon on the same arena name", (
        K + "test_local_isolation.py::test_files_and_symlinks_another_user_plants_under_the_arena_name_are_never_used",
        K + "test_local_isolation.py::test_arena_is_shared_with_the_group_only_when_asked",
        K + "test_local_isolation.py::test_a_second_daemon_with_the_same_shm_name_is_refused",
        K + "test_local_isolation.py::test_a_cache_directory_another_user_owns_is_refused"),
        figures="test_local_isolation_arena"),
    Row("2", "--tcp without a token: refuses to start", (
        K + "test_tcp_auth.py::test_serve_with_tcp_and_no_token_refuses_to_start_with_one_line",
        K + "test_tcp_auth.py::test_serve_refuses_a_token_file_open_to_other_users_or_too_short")),
    Row("2", "TCP requests without the right token: refused (UNAUTHENTICATED) and counted; nothing they asked for "
             "happens", (K + "test_tcp_auth.py::test_requests_without_the_right_token_are_refused_and_counted",
                         K + "test_tcp_auth.py::test_cli_over_tcp_needs_the_right_token",
                         K + "test_tcp_auth.py::test_fuzzed_authorization_values_are_all_refused"),
        figures="test_tcp_refused"),
    Row("2", "TCP clients never get regions nor commit bytes they never sent; bytes over the wire, verified", (
        K + "test_tcp_auth.py::test_no_region_and_no_commit_over_tcp_even_with_the_token",
        K + "test_tcp_auth.py::test_client_with_the_token_puts_and_gets_bytes_over_the_wire",
        K + "test_tcp_auth.py::test_tensors_round_trip_over_the_wire",
        K + "test_tcp_auth.py::test_get_bytes_over_the_message_limit_is_refused_naming_the_remedy",
        K + "test_tcp_auth.py::test_asyncio_client_over_tcp_authenticates_and_moves_bytes_over_the_wire"),
        figures="test_tcp_wire"),
    Row("2", "`--tcp :PORT` listened on every interface (now loopback); TLS as an option", (
        K + "test_tcp_auth.py::test_port_only_daemon_listens_on_loopback_alone",
        K + "test_tcp_auth.py::test_tls_listener_serves_clients_that_trust_its_certificate",
        K + "test_tcp_auth.py::test_half_configured_tls_refuses_to_start")),
    Row("3", "damaged LMDB index (truncated, removed, while running) destroyed the object files", (
        K + "test_index_recovery.py::test_index_truncated_while_stopped_to_0_then_to_half_is_rebuilt_from_the_files",
        K + "test_index_recovery.py::test_index_truncated_while_running_or_removed_after_a_kill_loses_nothing",
        K + "test_index_recovery.py::test_refuse_mode_names_kvstore_repair_which_rebuilds_the_index",
        K + "test_index_recovery.py::test_a_dropped_object_still_pinned_at_a_crash_does_not_come_back"),
        figures="test_index_recovery"),
    Row("4", "keys of 512-1024 bytes accepted but failing on the NVMe tier; write-back retried forever", (
        K + "test_nvme_faults.py::test_key_limit_agrees_across_tiers_and_config",
        K + "test_writeback.py::test_write_back_gives_up_on_an_object_after_repeated_failures_and_counts_each"),
        figures="test_nvme_faults_keys"),
    Row("5", "WaitFor held a server worker: 16+ waiters on one key stalled every other request", (
        K + "test_waitfor_workers.py::test_many_waiters_on_one_key_leave_every_other_request_prompt",
        K + "test_waitfor_workers.py::test_waiters_return_false_when_the_writer_aborts_and_time_out_on_their_own"),
        figures="test_waitfor"),
    Row("6", "no isolation between clients of one user (writable reader mappings, unbound leases, sequential ids)", (
        K + "test_local_isolation.py::test_readers_map_the_arena_read_only",
        K + "test_local_isolation.py::test_lease_and_reservation_ids_are_random_and_bound_to_their_client",
        K + "test_local_isolation.py::test_memory_bytes_changed_after_commit_are_caught_before_served_with_verify_memory_always"),
        figures="test_local_isolation_clients"),
    Row("7", "oversized integers / deeply nested JSON in meta.extra_json gave INTERNAL", (
        K + "test_fuzz.py::test_oversized_integers_and_deep_json_in_extra_are_invalid_argument",)),
    Row("7", "fuzzing (hypothesis): every RPC, raw bytes, the fast socket, the object header decoder: a kvstore "
             "error, never INTERNAL or a crash; no wrong bytes served afterwards", (
        K + "test_fuzz.py::test_fuzzed_requests_get_a_kvstore_error_never_internal",
        K + "test_fuzz.py::test_garbage_bytes_to_any_method_are_invalid_argument_or_a_valid_request",
        K + "test_fuzz.py::test_grpc_fuzzing_left_the_daemon_serving_the_right_bytes",
        K + "test_fuzz.py::test_fuzzed_fast_socket_frames_get_error_frames_never_a_crash",
        K + "test_fuzz.py::test_fast_socket_fuzzing_left_it_answering",
        K + "test_fuzz.py::test_mutated_blobs_decode_or_raise_a_kvstore_error",
        K + "test_fuzz.py::test_random_bytes_after_the_magic_raise_a_kvstore_error"), figures="test_fuzz"),
    Row("8", "removing objects/tmp broke the NVMe tier until restart", (
        K + "test_nvme_faults.py::test_removed_tmp_directory_is_recreated_and_puts_keep_working",),
        figures="test_nvme_faults_tmp"),
    Row("9", "full disk: raw OSError to clients, no eviction", (
        K + "test_nvme_faults.py::test_a_full_disk_evicts_nvme_objects_and_gives_kvstore_errors_not_oserror",),
        figures="test_nvme_faults_disk"),
    Row("load", "8 client processes, mixed operations, shared key space under eviction pressure, every byte "
                "read verified", (K + "test_load.py::test_eight_processes_of_mixed_operations_under_eviction_pressure"
                                      "_lose_and_corrupt_nothing",), figures="test_load"),
    Row("engine", "daemon killed, frozen (SIGSTOP) or restarted mid-request: recomputation, never a failed or "
                  "wrong request", (
        E + "test_store_faults.py::test_frozen_daemon_costs_recompute_within_the_store_timeout",
        E + "test_store_faults.py::test_daemon_killed_mid_request_costs_recompute_then_hits_after_restart",
        E + "test_store_faults.py::test_daemon_restarted_mid_request_never_fails_or_corrupts_it",
        E + "test_engine_store.py::test_a_killed_daemon_costs_recomputation_and_a_restarted_one_is_found_with_its_nvme_tier",
        E + "test_engine_store.py::test_a_frozen_daemon_is_bypassed_within_the_timeouts_then_used_again"),
        figures="test_store_faults"),
)


def _exists(nodeid: str) -> bool:
    return (ROOT / nodeid.split("::")[0]).is_file()


def _junit_outcomes(xml_path: Path) -> dict[str, str]:
    """node id -> "passed" / "failed" / "skipped: reason" (parametrized cases merged:
    failed if any failed)."""
    out: dict[str, str] = {}
    if not xml_path.exists():
        return out
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/") + ".py"
        name = case.get("name", "").split("[")[0]
        nodeid = f"{module}::{name}"
        if case.find("failure") is not None or case.find("error") is not None:
            state = "failed"
        elif (skip := case.find("skipped")) is not None:
            state = "skipped: " + (skip.get("message") or "")[:120]
        else:
            state = "passed"
        if out.get(nodeid) != "failed":
            out[nodeid] = state
    return out


def run_tests(nodeids: list[str]) -> tuple[dict[str, str], dict[str, dict], float]:
    """Run `nodeids` in one pytest process; (outcomes, figures by label, seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        xml, figures = Path(tmp) / "junit.xml", Path(tmp) / "figures.jsonl"
        env = dict(os.environ, **{FIGURES_ENV: str(figures)})
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                        *nodeids], cwd=ROOT, env=env, check=False)
        seconds = time.monotonic() - t0
        by_label: dict[str, dict] = {}
        if figures.exists():
            for line in figures.read_text().splitlines():
                rec = json.loads(line)
                by_label.setdefault(rec.pop("test"), {}).update(rec)
        return _junit_outcomes(xml), by_label, seconds


def _result(row: Row, outcomes: Optional[dict[str, str]]) -> str:
    if not row.tests:
        return "no test registered in this checkout"
    present = [t for t in row.tests if _exists(t)]
    if not present:
        return "tests not in this checkout"
    if outcomes is None:
        return "not run"
    states = [outcomes.get(t, "not collected") for t in present]
    passed = sum(s == "passed" for s in states)
    worst = next((s for s in states if s != "passed"), "")
    text = f"{passed}/{len(present)} passed" + (f" ({worst})" if worst else "")
    missing = len(row.tests) - len(present)
    return text + (f"; {missing} not in this checkout" if missing else "")


def _figure(figs: dict, name: str) -> str:
    v = figs.get(name)
    return "-" if v is None else f"{v:,}" if isinstance(v, int) else str(v)


def render(outcomes: Optional[dict[str, str]], figures: dict[str, dict], seconds: Optional[float],
           commit: str) -> str:
    lines = [
        "# Reliability",
        "",
        "Each fault issue 18 found, the test that pins it (real daemons as processes, real sockets, files, LMDB "
        "and shared memory), its result and what it counted. Regenerated by `python -m tools.reliability_report` "
        "(registry: `ROWS` in tools/reliability_report.py; figures from `kvstore.testing.record_figures`); do not "
        "edit by hand.",
        "",
        f"Last run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}"
        + (f", {seconds:.0f} s on this machine." if seconds is not None else " (tests not run)."),
        "",
        "| item | fault | tests | result | operations | objects verified | losses | other figures |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in ROWS:
        figs = figures.get(row.figures or "", {})
        other = ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in sorted(figs.items())
                          if k not in ("operations", "objects_verified", "losses"))
        tests = "<br>".join(f"`{t.split('/')[-1]}`" for t in row.tests) or "-"
        lines.append(f"| {row.item} | {row.fault} | {tests} | {_result(row, outcomes)} | "
                     f"{_figure(figs, 'operations')} | {_figure(figs, 'objects_verified')} | "
                     f"{_figure(figs, 'losses')} | {other or '-'} |")
    lines += [
        "",
        "Losses are objects whose bytes came back wrong or went missing although the store had acknowledged them "
        "and nothing evicted or deleted them; a row's figures are those its tests recorded in the run above (the "
        "CI-short versions; `KVSTORE_FUZZ_EXAMPLES=N` and `KVSTORE_LOAD_SECONDS=S` scale the fuzz and load tests).",
        "",
    ]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Regenerate docs/RELIABILITY.md from the reliability tests.")
    ap.add_argument("--no-run", action="store_true", help="do not run the tests (results 'not run')")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    outcomes: Optional[dict[str, str]] = None
    figures: dict[str, dict] = {}
    seconds: Optional[float] = None
    if not a.no_run:
        nodeids = sorted({t for row in ROWS for t in row.tests if _exists(t)})
        outcomes, figures, seconds = run_tests(nodeids)
    a.out.write_text(render(outcomes, figures, seconds, commit))
    print(f"wrote {a.out}")
    failed = [t for t, s in (outcomes or {}).items() if s == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
