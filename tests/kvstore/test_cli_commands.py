"""The `kvstore` command line (kvstore/cli.py), run as `python -m kvstore.cli` against a
real daemon: data commands, JSON output contracts, one-line failures, no-daemon message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvstore.testing import REPO_ROOT


def _ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


def _one_line_failure(done: subprocess.CompletedProcess) -> str:
    err = done.stderr.decode()
    assert done.returncode != 0
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("kvstore: error: ")
    return err


def test_put_then_get_round_trips_a_file_to_a_file_and_to_stdout(daemon, tmp_path):
    src = tmp_path / "in.bin"
    src.write_bytes(os.urandom(200_000))
    for tier in ("cpu", "nvme"):
        out = json.loads(_ok(daemon.cli("put", f"cli/{tier}", str(src), "--tier", tier, "--json")))
        assert out == {"key": f"cli/{tier}", "tier": tier, "size": 200_000, "status": "stored"}
        dst = tmp_path / f"out-{tier}.bin"
        _ok(daemon.cli("get", f"cli/{tier}", "-o", str(dst)))
        assert dst.read_bytes() == src.read_bytes()
        assert daemon.cli("get", f"cli/{tier}").stdout == src.read_bytes()
    assert "already present" in _ok(daemon.cli("put", "cli/cpu", str(src)))


def test_inspect_json_has_the_documented_fields(daemon, tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 5000)
    _ok(daemon.cli("put", "inspect/a", str(tmp_path / "f")))
    _ok(daemon.cli("get", "inspect/a", "-o", str(tmp_path / "g")))
    stats = json.loads(_ok(daemon.cli("inspect", "--json")))
    for field in ("tiers", "hits", "misses", "evictions"):
        assert field in stats
    assert [t["name"] for t in stats["tiers"]] == ["cpu", "nvme"]
    for t in stats["tiers"]:
        assert set(t) >= {"name", "capacity_bytes", "used_bytes", "objects"}
        assert isinstance(t["capacity_bytes"], int) and isinstance(t["objects"], int)
    assert stats["tiers"][0]["capacity_bytes"] == 32 << 20
    assert stats["hits"] >= 1 and any(o["key"] == "inspect/a" for o in stats["top_objects"])
    table = _ok(daemon.cli("inspect"))
    assert "hit rate" in table and "cpu" in table and "top" in table and "write-backs" in table


def test_evict_moves_unleased_objects_one_tier_down(daemon, tmp_path):
    (tmp_path / "f").write_bytes(b"e" * 3000)
    _ok(daemon.cli("put", "evict/a", str(tmp_path / "f"), "--tier", "cpu"))
    moved = json.loads(_ok(daemon.cli("evict", "--tier", "cpu", "--json")))
    assert moved["tier"] == "cpu" and moved["moved"] >= 1
    listed = json.loads(_ok(daemon.cli("ls", "--prefix", "evict/", "--json")))
    assert [(o["key"], o["tier"]) for o in listed] == [("evict/a", "nvme")]


def test_ls_filters_and_rm(daemon, tmp_path):
    (tmp_path / "f").write_bytes(b"l" * 100)
    for name, tier in (("ls/a", "cpu"), ("ls/b", "nvme"), ("other/c", "cpu")):
        _ok(daemon.cli("put", name, str(tmp_path / "f"), "--tier", tier, "--fingerprint", "fp-ls"))
    keys = lambda *a: sorted(o["key"] for o in json.loads(_ok(daemon.cli("ls", "--json", *a))))  # noqa: E731
    assert keys("--prefix", "ls/") == ["ls/a", "ls/b"]
    assert keys("--prefix", "ls/", "--tier", "nvme") == ["ls/b"]
    assert keys("--fingerprint", "fp-ls") == ["ls/a", "ls/b", "other/c"]
    done = daemon.cli("rm", "ls/a", "ls/b", "ls/none", "--json")  # a missing key: named, exit 1
    assert done.returncode == 1 and "not in the store: ls/none" in _one_line_failure(done)
    assert json.loads(done.stdout) == {"requested": 3, "deleted": 2, "missing": ["ls/none"], "leased": []}
    assert keys("--prefix", "ls/") == []
    assert "ls/a" not in _ok(daemon.cli("ls"))


def test_show_prints_the_record_and_for_a_blob_its_header_and_parts(daemon, tmp_path):
    from kvstore.format import encode_tensors

    blob = encode_tensors({"k": torch.zeros(2, 8), "v": torch.ones(2, 8, dtype=torch.float16)},
                          fingerprint="fp-show", token_count=2, layers={"k": 3, "v": 3})
    (tmp_path / "blob").write_bytes(bytes(blob))
    (tmp_path / "raw").write_bytes(b"not a blob")
    _ok(daemon.cli("put", "show/blob", str(tmp_path / "blob")))
    _ok(daemon.cli("put", "show/raw", str(tmp_path / "raw")))
    shown = json.loads(_ok(daemon.cli("show", "show/blob", "--json")))
    assert shown["is_blob"] and shown["header"]["fingerprint"] == "fp-show"
    assert [(p["name"], p["layer"], p["dtype"], p["shape"]) for p in shown["parts"]] == [
        ("k", 3, "float32", [2, 8]), ("v", 3, "float16", [2, 8])]
    assert shown["object"]["size"] == len(blob)
    raw = json.loads(_ok(daemon.cli("show", "show/raw", "--json")))
    assert raw["is_blob"] is False and raw["parts"] == []
    assert "float16" in _ok(daemon.cli("show", "show/blob"))


def test_binary_keys_use_the_hex_prefix(daemon, tmp_path):
    (tmp_path / "f").write_bytes(b"bin")
    _ok(daemon.cli("put", "hex:00ff10", str(tmp_path / "f")))
    listed = json.loads(_ok(daemon.cli("ls", "--json", "--prefix", "hex:00ff")))
    assert [o["key"] for o in listed] == ["hex:00ff10"]
    with daemon.client() as kv:
        assert kv.lookup([b"\x00\xff\x10"])[0].hit


def test_failures_are_one_line_with_a_reason_and_non_zero_exit(daemon, tmp_path):
    assert "not in the store" in _one_line_failure(daemon.cli("get", "no/such/key"))
    assert "unknown tier 'tape'" in _one_line_failure(daemon.cli("evict", "--tier", "tape"))
    assert "is not a file" in _one_line_failure(daemon.cli("put", "k", str(tmp_path / "missing")))
    (tmp_path / "empty").write_bytes(b"")
    assert "empty" in _one_line_failure(daemon.cli("put", "k", str(tmp_path / "empty")))
    big = tmp_path / "big"
    with open(big, "wb") as fh:
        fh.truncate(64 << 20)
    assert "capacity" in _one_line_failure(daemon.cli("put", "big", str(big), "--tier", "cpu"))


def test_client_commands_say_plainly_that_no_daemon_runs_and_how_to_start_one(tmp_path):
    sock = tmp_path / "no.sock"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "KVSTORE_CONFIG": os.devnull}
    for args in (["inspect", "--json"], ["ls"], ["get", "k"], ["put", "k", __file__], ["rm", "k"],
                 ["evict", "--tier", "cpu"], ["show", "k"]):
        done = subprocess.run([sys.executable, "-m", "kvstore.cli", *args, "--socket", str(sock)],
                              capture_output=True, env=env, cwd=REPO_ROOT, timeout=60)
        assert done.returncode == 3, args
        err = _one_line_failure(done)
        assert "no kvstore daemon is running" in err and f"kvstore serve --socket {sock}" in err


def test_config_prints_effective_values_and_their_sources(tmp_path):
    toml = tmp_path / "kv.toml"
    toml.write_text('nvme_capacity = "3GiB"\n')
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "KVSTORE_CPU_CAPACITY": "768MiB", "KVSTORE_CONFIG": str(toml)}
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "config", "--json"], capture_output=True, env=env,
                          cwd=REPO_ROOT, timeout=60)
    out = json.loads(_ok(done))
    assert out["config"]["cpu_capacity"] == 768 << 20 and out["sources"]["cpu_capacity"] == "env:KVSTORE_CPU_CAPACITY"
    assert out["config"]["nvme_capacity"] == 3 << 30 and out["sources"]["nvme_capacity"] == f"file:{toml}"
    assert out["sources"]["eviction"] == "default"
    env["KVSTORE_CPU_CAPACITY"] = "lots"
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "config"], capture_output=True, env=env,
                          cwd=REPO_ROOT, timeout=60)
    assert "cpu_capacity (from KVSTORE_CPU_CAPACITY)" in _one_line_failure(done)


def test_serve_rejects_a_bad_flag_value_in_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "KVSTORE_CONFIG": os.devnull}
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--socket", str(tmp_path / "s.sock"),
                           "--cpu-capacity", "12 parsecs"], capture_output=True, env=env, cwd=REPO_ROOT, timeout=60)
    assert "cpu_capacity (from --cpu-capacity): invalid size '12 parsecs'" in _one_line_failure(done)


def test_bench_reports_put_and_get_throughput_per_tier(daemon):
    rows = json.loads(_ok(daemon.cli("bench", "--size", "256KiB", "--count", "2", "--json")))
    assert [r["tier"] for r in rows] == ["cpu", "nvme"]
    for r in rows:
        assert r["put_GBps"] > 0 and r["get_GBps"] > 0 and r["objects"] == 2
    with daemon.client() as kv:
        assert not kv.list(prefix=b"bench-"), "bench must delete its objects"


# ---------------------------------------------------------------- issue 22: what a new user trips on


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "KVSTORE_CONFIG": os.devnull, **extra}


def _kvstore(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, env=env or _env(),
                          cwd=REPO_ROOT, timeout=timeout)


def test_inspect_counts_lookups_so_a_cold_engine_run_is_not_a_100_percent_hit_rate(daemon):
    """An engine looks every segment up and gets only the hits: the hit rate must come
    from the lookups (misses included), not from the gets alone."""
    before = json.loads(_ok(daemon.cli("inspect", "--json")))
    with daemon.client() as kv:
        kv.put(b"lk/present", b"p" * 100)
        found = kv.lookup([b"lk/present", b"lk/absent-1", b"lk/absent-2", b"lk/absent-3"])
        assert [e.hit for e in found] == [True, False, False, False]
        with kv.get(b"lk/present"):
            pass
    stats = json.loads(_ok(daemon.cli("inspect", "--json")))
    assert stats["lookup_hits"] - before["lookup_hits"] == 1
    assert stats["lookup_misses"] - before["lookup_misses"] == 3
    assert stats["hit_rate"] == stats["lookup_hit_rate"] < 1.0
    assert stats["get_hit_rate"] is not None
    text = _ok(daemon.cli("inspect"))
    assert f"misses {stats['lookup_misses']}" in text and "lookups:" in text and "gets:" in text
    assert f"kvstore daemon pid {daemon.pid} at unix:{daemon.socket}\n" in text  # the title is not wrapped


def test_put_of_an_existing_key_says_what_is_stored_and_replace_overwrites(daemon, tmp_path):
    small, big = tmp_path / "small", tmp_path / "big"
    small.write_bytes(b"twelve bytes")
    big.write_bytes(os.urandom(3 << 20))
    _ok(daemon.cli("put", "rep/k1", str(small)))
    same = _ok(daemon.cli("put", "rep/k1", str(small)))
    assert "already present: rep/k1 (12B)" in same and "same bytes" in same
    err = _one_line_failure(daemon.cli("put", "rep/k1", str(big)))
    assert "already holds other bytes (12B" in err and "--replace" in err
    assert daemon.cli("get", "rep/k1").stdout == b"twelve bytes"  # kept
    out = json.loads(_ok(daemon.cli("put", "rep/k1", str(big), "--replace", "--json")))
    assert out["status"] == "stored" and out["size"] == 3 << 20 and out["replaced"] is True
    assert daemon.cli("get", "rep/k1").stdout == big.read_bytes()


def test_ls_accepts_the_short_fingerprint_that_inspect_prints(daemon, tmp_path):
    (tmp_path / "f").write_bytes(b"fp")
    full = "0123456789abcdef" * 4
    _ok(daemon.cli("put", "fpshort/a", str(tmp_path / "f"), "--fingerprint", full))
    listed = lambda fp: [o["key"] for o in json.loads(_ok(daemon.cli("ls", "--json", "--fingerprint", fp)))]  # noqa: E731
    assert listed(full) == ["fpshort/a"]
    assert listed(full[:16]) == ["fpshort/a"]
    assert listed("0123") == []  # too short to stand for a fingerprint
    with daemon.client() as kv:  # a short form is shown where inspect shows fingerprints
        assert any(o.meta.fingerprint[:16] == full[:16] for o in kv.list(limit=100))


def test_evict_says_dropped_for_the_last_tier_and_rm_of_a_missing_key_fails(daemon, tmp_path):
    (tmp_path / "f").write_bytes(b"d" * 10)
    _ok(daemon.cli("put", "drop/a", str(tmp_path / "f"), "--tier", "nvme"))
    out = _ok(daemon.cli("evict", "--tier", "nvme"))
    assert out.startswith("dropped ") and "moved" not in out
    assert json.loads(_ok(daemon.cli("evict", "--tier", "cpu", "--json")))["to"] == "nvme"
    done = daemon.cli("rm", "drop/never-stored")
    assert done.returncode == 1 and "not in the store: drop/never-stored" in _one_line_failure(done)


def test_config_socket_shows_the_running_daemons_settings(daemon):
    out = json.loads(_ok(_kvstore("config", "--json", "--socket", str(daemon.socket))))
    assert out["config"]["cpu_capacity"] == 32 << 20 and out["sources"]["cpu_capacity"] == "flag:--cpu-capacity"
    assert out["config"]["socket"] == str(daemon.socket)
    table = _ok(_kvstore("config", "--socket", str(daemon.socket)))
    assert "cpu_capacity" in table and "32MiB" in table and "daemon configuration at" in table


def test_show_prints_bytes_in_a_blob_header_as_hex_not_a_python_repr(daemon, tmp_path):
    from kvstore.format import encode_tensors

    blob = encode_tensors({"k": torch.zeros(2)}, fingerprint="fp", token_count=1, meta={"anchor": b"\x01\xab"})
    (tmp_path / "blob").write_bytes(bytes(blob))
    _ok(daemon.cli("put", "show/bytes-meta", str(tmp_path / "blob")))
    shown = json.loads(_ok(daemon.cli("show", "show/bytes-meta", "--json")))
    assert shown["header"]["meta"]["anchor"] == "hex:01ab"
    assert "b'" not in _ok(daemon.cli("show", "show/bytes-meta"))


def test_config_socket_with_no_daemon_is_the_usual_one_line(tmp_path):
    done = _kvstore("config", "--socket", str(tmp_path / "none.sock"))
    assert done.returncode == 3 and "no kvstore daemon is running" in _one_line_failure(done)


def test_serve_on_an_unusable_dir_fails_in_one_line_naming_it(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for bad in (a_file, a_file / "sub", Path("/proc/kvstore-i22-no-such")):
        done = _kvstore("serve", "--socket", str(tmp_path / "s.sock"), "--dir", str(bad), "--cpu-capacity", "4MiB")
        err = _one_line_failure(done)
        assert "cannot start the daemon" in err and str(bad) in err and "--dir" in err, err


def test_a_second_daemon_on_the_same_dir_fails_fast_naming_the_holder(daemon, tmp_path):
    t0 = time.monotonic()
    done = _kvstore("serve", "--socket", str(tmp_path / "other.sock"), "--dir", str(daemon.dir),
                    "--cpu-capacity", "4MiB", "--nvme-capacity", "16MiB")
    err = _one_line_failure(done)
    assert f"pid {daemon.pid}" in err and "in use by another daemon" in err
    assert time.monotonic() - t0 < 9.0  # it took 10 s (issue 22); a fresh process starts in about 3


def test_help_is_plain_and_whole(tmp_path):
    """Help is not cut at 80 columns, shows no <bool>/<str> metavars or {key} usage, and
    --writeback-watermark is a fraction, not seconds."""
    serve_help = _ok(_kvstore("serve", "--help", env=_env(COLUMNS="80")))
    assert "--writeback-watermark FRACTION" in serve_help and "--lease-ttl SECONDS" in serve_help
    assert "<bool>" not in serve_help and "│" not in serve_help  # no rich box
    assert "env KVSTORE_WRITEBACK_WATERMARK]" in " ".join(serve_help.split())  # defaults complete
    put_help = _ok(_kvstore("put", "--help"))
    assert "put [OPTIONS] KEY FILE" in put_help and "{key}" not in put_help and "<str>" not in put_help
    assert "--replace" in put_help
    assert "rm [OPTIONS] KEY..." in _ok(_kvstore("rm", "--help"))


def test_piped_tables_are_not_cut_at_80_columns(tmp_path):
    out = _ok(_kvstore("config", env=_env(COLUMNS="80")))
    assert "KVSTORE_WRITEBACK_WATERMARK / --writeback-watermark" in out
    assert "…" not in out  # no ellipsis


def test_the_example_config_file_loads_and_sets_what_it_says():
    example = REPO_ROOT / "docs" / "examples" / "kvstore.toml"
    out = json.loads(_ok(_kvstore("config", "--config", str(example), "--json")))
    assert out["config_file"] == str(example)
    assert out["config"]["cpu_capacity"] == 2 << 30 and out["config"]["nvme_capacity"] == 64 << 30
    set_keys = {line.split("=")[0].strip() for line in example.read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#") and "=" in line}
    assert set_keys and all(out["sources"][k] == f"file:{example}" for k in set_keys)
