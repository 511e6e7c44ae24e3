"""`kvengine run --store [SOCKET]` end to end: two `kvengine run` PROCESSES one after the
other against one REAL daemon, the second reusing what the first computed (and finding
the daemon through the default socket when `--store` has no value); the option's
parsing and its refusal of methods that keep nothing in the store."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from connector_testlib import prompt
from engine.cli import app, expand_bare_store

REPO = Path(__file__).resolve().parents[3]


def write_requests(path: Path) -> Path:
    reqs = [{"id": "a", "segments": prompt((0, 1))}, {"id": "b", "segments": prompt((1, 2), "Q: value of k3cc?\nA: ")}]
    path.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    return path


def kvengine_run(requests: Path, store_args: list[str], env_extra: dict[str, str]) -> list[dict]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", KVSTORE_CONFIG=os.devnull, **env_extra)
    cmd = [sys.executable, "-m", "engine.cli", "run", "--preset", "qwen3next-tiny", "--requests", str(requests),
           "--max-new-tokens", "2", "--json", *store_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def segments_only(tmp_path: Path) -> str:
    """A --pic-config file for segment reuse alone: no exact prefixes (test_prefix_store.py;
    they would restore request a whole), misses computed alone in the request (so each
    request's record counts what it computed through the store)."""
    path = tmp_path / "segments-only.toml"
    path.write_text('[pic]\nexact_prefix = false\nmiss_path = "alone"\n')
    return str(path)


def test_a_second_kvengine_run_process_reuses_segments_the_first_computed(start_daemon, tmp_path):
    d = start_daemon()
    requests = write_requests(tmp_path / "requests.jsonl")
    first = kvengine_run(requests, ["--store", str(d.socket), "--pic-config", segments_only(tmp_path)], {})
    assert [r["id"] for r in first] == ["a", "b"]
    assert first[0]["reused_tokens"] == 0 and first[0]["store_computed"] == 2
    assert first[1]["store_hits"] == 1  # doc 1 was computed by request a
    # bare --store: the daemon's default socket, here named by KVSTORE_SOCKET
    second = kvengine_run(requests, ["--store", "--pic-config", segments_only(tmp_path)],
                          {"KVSTORE_SOCKET": str(d.socket)})
    assert all(r["reused_tokens"] > 0 and r["store_computed"] == 0 for r in second)
    assert [r["store_hits_by_tier"]["cpu"] for r in second] == [2, 2]
    assert [r["text"] for r in second] == [r["text"] for r in first]


def test_bare_store_becomes_the_default_socket_and_a_value_is_kept():
    assert expand_bare_store(["run", "--store"]) == ["run", "--store="]
    assert expand_bare_store(["run", "--store", "--json"]) == ["run", "--store=", "--json"]
    assert expand_bare_store(["run", "--store", "/tmp/s.sock", "--json"]) == ["run", "--store", "/tmp/s.sock", "--json"]


def test_store_refuses_methods_that_keep_nothing_in_the_store(tmp_path):
    requests = write_requests(tmp_path / "requests.jsonl")
    res = CliRunner().invoke(app, ["run", "--preset", "qwen3next-tiny", "--requests", str(requests),
                                   "--method", "full", "--store", "/nonexistent.sock"])
    assert res.exit_code == 2
    assert "--store" in res.output and "full" in res.output
