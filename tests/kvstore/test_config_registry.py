"""kvstore/config.py: the option registry, SIZE parsing, source layering, default paths."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvstore import config as cfg
from kvstore.errors import InvalidRequest


@pytest.mark.parametrize(
    "text, expected",
    [("512MiB", 512 << 20), ("4GiB", 4 << 30), ("1.5GiB", 3 << 29), ("100MB", 100_000_000), ("4096", 4096),
     ("64k", 64 << 10), ("2 TiB", 2 << 40), (0, 0), (12345, 12345)],
)
def test_parse_size_accepts_binary_decimal_and_plain_units(text, expected):
    assert cfg.parse_size(text) == expected


@pytest.mark.parametrize("bad", ["4GB2", "GiB", "-1GiB", "1 parsec", "", True, -5, [1]])
def test_parse_size_rejects_garbage_naming_the_option_and_value(bad):
    with pytest.raises(cfg.ConfigError) as exc:
        cfg.parse_size(bad, "cpu_capacity")
    assert "cpu_capacity" in str(exc.value)
    assert isinstance(exc.value, InvalidRequest)


def test_format_size_round_trips_through_parse_size():
    for n in (1, 4096, 1536, 512 << 20, 3 << 29, 7 << 40):
        assert cfg.parse_size(cfg.format_size(n)) == n


def test_every_option_has_help_and_a_parsable_default():
    c = cfg.load_config(env={}, config_file=os.devnull)
    for o in cfg.OPTIONS:
        assert o.help, o.name
        assert c.sources[o.name] == "default"
        assert o.env == "KVSTORE_" + o.name.upper()
        assert o.flag == "--" + o.name.replace("_", "-")


def test_sources_layer_defaults_then_file_then_env_then_flags(tmp_path):
    toml = tmp_path / "kv.toml"
    toml.write_text('cpu_capacity = "2GiB"\nnvme_capacity = "8GiB"\neviction = "lru"\nlease_ttl = 5\n')
    env = {"KVSTORE_NVME_CAPACITY": "3GiB", "KVSTORE_EVICTION": "cost"}
    c = cfg.load_config(cli={"eviction": "lru", "tcp": None}, config_file=toml, env=env)
    assert c.cpu_capacity == 2 << 30 and c.sources["cpu_capacity"] == f"file:{toml}"
    assert c.nvme_capacity == 3 << 30 and c.sources["nvme_capacity"] == "env:KVSTORE_NVME_CAPACITY"
    assert c.eviction == "lru" and c.sources["eviction"] == "flag:--eviction"
    assert c.lease_ttl == 5.0
    assert c.tcp == "" and c.sources["tcp"] == "default"  # a None flag is "not given"


def test_config_file_comes_from_kvstore_config_env(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text("[kvstore]\nworkers = 3\n")
    c = cfg.load_config(env={"KVSTORE_CONFIG": str(toml)})
    assert c.workers == 3 and c.config_file == toml


def test_unknown_toml_key_is_an_error_with_a_suggestion(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('cpu_capacty = "1GiB"\n')
    with pytest.raises(cfg.ConfigError, match="unknown option 'cpu_capacty'.*did you mean 'cpu_capacity'"):
        cfg.load_config(config_file=toml, env={})


def test_invalid_toml_and_missing_file_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("cpu_capacity = = 1\n")
    with pytest.raises(cfg.ConfigError, match="not valid TOML"):
        cfg.load_config(config_file=bad, env={})
    with pytest.raises(cfg.ConfigError, match="does not exist"):
        cfg.load_config(config_file=tmp_path / "nope.toml", env={})


@pytest.mark.parametrize(
    "env, fragment",
    [({"KVSTORE_CPU_CAPACITY": "lots"}, "cpu_capacity (from KVSTORE_CPU_CAPACITY)"),
     ({"KVSTORE_EVICTION": "random"}, "'random' is not one of cost, lru"),
     ({"KVSTORE_TCP": "localhost"}, "expected HOST:PORT"),
     ({"KVSTORE_TCP": "localhost:99999"}, "port must be 1..65535"),
     ({"KVSTORE_WORKERS": "0"}, "workers (from KVSTORE_WORKERS): must be >= 1"),
     ({"KVSTORE_WRITEBACK_ON_CLOSE": "maybe"}, "expected true or false"),
     ({"KVSTORE_LEASE_TTL": "nan"}, "finite"),
     ({"KVSTORE_SHM_NAME": "a/b"}, "shm_name")],
)
def test_bad_env_values_name_the_option_the_value_and_the_source(env, fragment):
    with pytest.raises(cfg.ConfigError) as exc:
        cfg.load_config(env=env, config_file=os.devnull)
    assert fragment in str(exc.value)


def test_bool_and_gpu_auto_values_parse():
    c = cfg.load_config(env={"KVSTORE_WRITEBACK_ON_CLOSE": "yes", "KVSTORE_GPU_CAPACITY": "auto"},
                        config_file=os.devnull)
    assert c.writeback_on_close is True and c.gpu_capacity is None
    assert cfg.resolve_gpu_capacity(c, lambda: True) == cfg.GPU_AUTO_BYTES
    assert cfg.resolve_gpu_capacity(c, lambda: False) == 0


def test_explicit_gpu_capacity_without_cuda_is_an_error_naming_its_source():
    c = cfg.load_config(env={"KVSTORE_GPU_CAPACITY": "2GiB"}, config_file=os.devnull)
    with pytest.raises(cfg.ConfigError, match="env:KVSTORE_GPU_CAPACITY.*CUDA is not available"):
        cfg.resolve_gpu_capacity(c, lambda: False)


def test_default_socket_is_per_user_under_xdg_runtime_dir_or_tmp(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert cfg.default_socket() == tmp_path / "kvstore" / "kvstore.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert cfg.default_socket() == Path(f"/tmp/kvstore-{os.getuid()}/kvstore.sock")


def test_default_cache_dir_is_under_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cfg.default_cache_dir() == tmp_path / "kvstore"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cfg.default_cache_dir() == Path.home() / ".cache" / "kvstore"


def test_socket_dir_is_created_private(tmp_path):
    sock = tmp_path / "run" / "kv.sock"
    cfg.ensure_socket_dir(sock)
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700


def test_overlong_socket_path_is_rejected_before_bind(tmp_path):
    with pytest.raises(cfg.ConfigError, match="unix-socket limit"):
        cfg.load_config(cli={"socket": "/tmp/" + "x" * 120}, env={}, config_file=os.devnull)


def test_shm_name_is_derived_from_the_socket_so_two_daemons_never_share_an_arena():
    a = cfg.load_config(cli={"socket": "/tmp/a.sock"}, env={}, config_file=os.devnull)
    b = cfg.load_config(cli={"socket": "/tmp/b.sock"}, env={}, config_file=os.devnull)
    assert a.shm_name != b.shm_name and a.shm_name.startswith("kvstore-")
