"""`kvengine index --store` end to end: a `kvengine index` PROCESS stores a corpus's
signatures in a REAL daemon, then a `kvengine run` process's first requests over those
documents hit every one from the daemon and compute none; indexing again stores nothing
new; bad input and a missing --store exit 2 with one line naming what was wrong."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from connector_testlib import DOCS
from engine.cli import app
from test_cli_store import REPO, kvengine_run, segments_only, write_requests


def kvengine_index(segments: Path, store_args: list[str], *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", KVSTORE_CONFIG=os.devnull)
    cmd = [sys.executable, "-m", "engine.cli", "index", "--preset", "qwen3next-tiny", "--segments", str(segments),
           *store_args, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(REPO), timeout=300)


def test_a_run_after_kvengine_index_hits_every_indexed_document_from_the_daemon(start_daemon, tmp_path):
    d = start_daemon()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"doc{i}", "text": t}) + "\n" for i, t in enumerate(DOCS)) + "\n")
    cfg = segments_only(tmp_path)
    p = kvengine_index(corpus, ["--store", str(d.socket), "--pic-config", cfg], "--json")
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert (rep["segments"], rep["computed"], rep["present"], rep["puts_stored"]) == (3, 3, 0, 3)
    assert rep["puts_dropped"] == 0 and rep["puts_failed"] == {} and rep["flushed"] and rep["put_bytes"] > 0
    recs = kvengine_run(write_requests(tmp_path / "requests.jsonl"), ["--store", str(d.socket), "--pic-config", cfg],
                        {})
    assert [r["store_computed"] for r in recs] == [0, 0]
    assert [r["store_hits_by_tier"]["cpu"] for r in recs] == [2, 2] and all(r["reused_tokens"] > 0 for r in recs)
    again = kvengine_index(corpus, ["--store", str(d.socket), "--pic-config", cfg])
    assert again.returncode == 0, again.stderr[-3000:]
    assert "3 segments" in again.stdout and "0 computed, 3 already stored" in again.stdout


@pytest.mark.parametrize("content, message", [
    ('{"text": "a"}\nnot json\n', "--segments: line 2: not JSON"),
    ('{"txt": "a"}\n', "--segments: line 1: needs an object with a string \"text\""),
    ('{"text": "a", "cache": true}\n', "--segments: line 1: unknown field 'cache'"),
    ('{"text": ""}\n', "--segments: line 1: \"text\" is empty"),
    ("\n\n", "holds no segment"),
])
def test_bad_segment_files_exit_2_naming_the_line(tmp_path, content, message):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    res = CliRunner().invoke(app, ["index", "--preset", "qwen3next-tiny", "--segments", str(f), "--store",
                                   str(tmp_path / "no.sock")])
    assert res.exit_code == 2 and message in res.output and len(res.output.strip().splitlines()) == 1


def test_index_without_a_store_or_file_exits_2(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "a"}\n')
    res = CliRunner().invoke(app, ["index", "--preset", "qwen3next-tiny", "--segments", str(f)])
    assert res.exit_code == 2 and "--store: index keeps signatures in the kvstore daemon" in res.output
    res = CliRunner().invoke(app, ["index", "--preset", "qwen3next-tiny", "--segments", str(tmp_path / "none"),
                                   "--store", str(tmp_path / "no.sock")])
    assert res.exit_code == 2 and "--segments: cannot read" in res.output
