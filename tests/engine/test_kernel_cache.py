"""engine/kernel_cache.py and `kvengine serve --kernel-cache`: the directory is the
option, else $TRITON_CACHE_DIR, else <user cache dir>/hypercache/triton; using it points
Triton's compile and autotuning caches there; a directory that cannot be made is refused
naming --kernel-cache (the default directory falling back to Triton's own with a warning)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import ConfigError
from engine.kernel_cache import default_kernel_cache_dir, kernel_cache_dir, use_kernel_cache

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return monkeypatch


def test_the_option_wins_then_the_environment_then_the_user_cache_dir(clean_env, tmp_path):
    assert kernel_cache_dir(None) == default_kernel_cache_dir() == tmp_path / "xdg" / "hypercache" / "triton"
    clean_env.setenv("TRITON_CACHE_DIR", str(tmp_path / "env"))
    assert kernel_cache_dir(None) == tmp_path / "env"
    assert kernel_cache_dir(str(tmp_path / "opt")) == tmp_path / "opt"
    with pytest.raises(ConfigError, match="--kernel-cache"):
        kernel_cache_dir(" ")


def test_using_a_directory_creates_it_and_turns_on_persistent_autotuning(clean_env, tmp_path):
    got = use_kernel_cache(tmp_path / "k" / "triton")
    assert got.is_dir() and os.environ["TRITON_CACHE_DIR"] == str(got)
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    clean_env.setenv("TRITON_CACHE_AUTOTUNING", "0")  # an explicit choice is kept
    use_kernel_cache(tmp_path / "k2")
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "0"


def test_serve_refuses_a_kernel_cache_it_cannot_create(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--preset", "ring-tiny", "--device", "cpu",
                          "--port", "0", "--kernel-cache", str(blocker / "sub")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "--kernel-cache" in res.stderr and "cannot create" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1



def test_serve_goes_on_with_a_warning_when_the_default_directory_cannot_be_made(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_CACHE")}
    env.update(PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(blocker))
    res = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--preset", "no-such-preset", "--device",
                          "cpu", "--port", "0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert "kernel cache directory" in res.stderr and "Triton's own default is used" in res.stderr
    assert "no preset named 'no-such-preset'" in res.stderr  # it went on to build the engine
