"""`kvengine serve --store` end to end, as a user runs it: a REAL daemon and the REAL
`kvengine serve` PROCESS over HTTP. Reuse is what the lookups found (a segment never seen
before reuses nothing, in `usage`, `timings` and /metrics); `--store` at a socket where no
daemon answers is an error at start-up unless --start-without-store; `serve` without
--store says that it caches nothing."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

from connector_testlib import DOCS

REPO = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "KVSTORE_CONFIG": os.devnull}
SERVE = [sys.executable, "-m", "engine.cli", "serve", "--preset", "qwen3next-tiny", "--port", "0", "--device", "cpu",
         "--max-batch", "2", "--kv-cache-tokens", "2048"]


def start_serve(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([*SERVE, *args], cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    line = proc.stdout.readline()
    m = re.search(r"on (http://[\d.]+:\d+)", line)
    if not m:
        proc.kill()
        raise AssertionError((line, proc.stderr.read()))
    return proc, m.group(1)


def stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return err


def complete(url: str, segments: list[dict]) -> dict:
    req = urllib.request.Request(url + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"segments": segments, "max_tokens": 2, "temperature": 0}).encode())
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def reused_metric(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    m = re.search(r"^kvengine_prompt_tokens_reused_total ([0-9.e+-]+)$", text, re.M)
    assert m, text[:2000]
    return float(m.group(1))


def test_serve_store_reports_no_reuse_for_new_segments_and_reuse_once_stored(start_daemon):
    d = start_daemon()
    proc, url = start_serve("--store", str(d.socket))
    try:
        fresh = f"## fresh {uuid.uuid4().hex}\nkey: value\n"
        segments = [{"text": fresh, "cache": True}, {"text": DOCS[0], "cache": True},
                    {"text": "Q: value of k1bb?\nA: ", "cache": False}]
        cold = complete(url, segments)
        assert cold["usage"]["prompt_tokens"] > 0
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing was ever stored
        assert cold["timings"]["reused_prompt_tokens"] == 0
        assert reused_metric(url) == 0
        deadline = time.monotonic() + 60  # the misses are stored while the engine is idle
        warm = complete(url, segments)
        while warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
            warm = complete(url, segments)
        cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert 0 < cached < warm["usage"]["prompt_tokens"]
        assert warm["timings"]["reused_prompt_tokens"] == cached
        assert reused_metric(url) == cached
    finally:
        stop(proc)


def test_serve_store_with_no_daemon_fails_at_start_unless_asked_to_start_without(tmp_path):
    sock = tmp_path / "none.sock"
    done = subprocess.run([*SERVE, "--store", str(sock)], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 3, done.stderr
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvengine: error: --store:") and str(sock) in err[0]
    assert "--start-without-store" in err[0] and "Traceback" not in done.stderr
    proc, url = start_serve("--store", str(sock), "--start-without-store")
    try:
        assert complete(url, [{"text": "hello", "cache": True}])["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        err = stop(proc)
    assert "starting without it" in err


def test_serve_without_store_says_it_caches_nothing():
    proc, url = start_serve()
    try:
        assert complete(url, [{"text": "hello", "cache": True}])["usage"]["completion_tokens"] == 2
    finally:
        err = stop(proc)
    assert "no --store" in err and "nothing is cached" in err
    # --kv-cache-tokens 2048 with --max-batch 2: whole blocks of 16, plus a partial block per request
    assert "--kv-cache-tokens 2048: the cache holds 2080 positions" in err
