"""Weights: safetensors round trip keeps the fingerprint and the outputs; the fingerprint
moves when any weight moves, and is the same in another process; load_model prefers
trained weights and says which source it used."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from engine.errors import ConfigError, PresetNotFoundError, WeightsError
from engine.models.config import ModelConfig
from engine.models.presets import get_preset
from engine.models.weights import (WEIGHTS_FILE, build_model, fingerprint, load_model, load_weights,
                                   save_model)


def test_save_load_round_trip_keeps_fingerprint_and_logits(tmp_path):
    model = build_model(get_preset("qwen3next-tiny"))
    fp = save_model(model, tmp_path / "m")
    assert (tmp_path / "m" / "config.json").is_file() and (tmp_path / "m" / WEIGHTS_FILE).is_file()
    loaded, fp2 = load_weights(tmp_path / "m")
    assert fp == fp2 == fingerprint(model) == fingerprint(loaded)
    assert loaded.config == model.config
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), rtol=0, atol=0)


def test_fingerprint_changes_when_one_weight_element_changes():
    model = build_model(get_preset("gla-tiny"))
    before = fingerprint(model)
    with torch.no_grad():
        model.blocks[3].mlp.down.weight[0, 0] += 1e-3
    assert fingerprint(model) != before


def test_fingerprint_changes_with_the_config_and_the_seed():
    cfg = get_preset("ring-tiny")
    a = fingerprint(build_model(cfg))
    assert fingerprint(build_model(cfg, seed=1)) != a
    assert fingerprint(build_model(cfg.replace(rms_norm_eps=1e-5))) != a


def test_fingerprint_is_identical_in_a_fresh_process():
    code = ("from engine.models.presets import get_preset; from engine.models.weights import build_model, "
            "fingerprint; print(fingerprint(build_model(get_preset('gemma3-tiny'))))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])),
           "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == fingerprint(build_model(get_preset("gemma3-tiny")))


def test_tiny_checkpoint_is_under_16_mib(tmp_path):
    save_model(build_model(get_preset("gemma3-tiny")), tmp_path)
    assert (tmp_path / WEIGHTS_FILE).stat().st_size < 16 * 2**20


def test_load_model_uses_trained_weights_when_present_else_seeded_init(tmp_path):
    init = load_model("nemotronh-tiny", models_root=tmp_path)
    assert init.source == "init:seed=0" and not init.trained
    trained = build_model(get_preset("nemotronh-tiny"), seed=7)
    fp = save_model(trained, tmp_path / "nemotronh-tiny")
    got = load_model("nemotronh-tiny", models_root=tmp_path)
    assert got.trained and got.source == f"weights:{tmp_path / 'nemotronh-tiny'}"
    assert got.fingerprint == fp != init.fingerprint
    by_dir = load_model(tmp_path / "nemotronh-tiny")
    assert by_dir.fingerprint == fp
    with pytest.raises(PresetNotFoundError, match="no preset named 'nope'"):
        load_model("nope", models_root=tmp_path)


def test_corrupted_weights_are_detected_by_fingerprint(tmp_path):
    save_model(build_model(get_preset("ring-tiny")), tmp_path)
    path = tmp_path / WEIGHTS_FILE
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # flip bits inside the last tensor's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="stored fingerprint"):
        load_weights(tmp_path)


def test_weights_that_do_not_match_the_config_are_rejected(tmp_path):
    save_model(build_model(get_preset("ring-tiny")), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_size"] = 64
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError):
        load_weights(tmp_path, verify=False)


def test_config_json_round_trip_and_bad_fields():
    cfg = get_preset("qwen3next-tiny")
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ConfigError, match="bad model config field"):
        ModelConfig.from_dict({**cfg.to_dict(), "colour": "red"})
    with pytest.raises(ConfigError, match=r"layers\[1\]='mlp'"):
        cfg.replace(layers=("full", "mlp"))
    with pytest.raises(ConfigError, match="num_v_heads=3"):
        ModelConfig.from_dict({**cfg.to_dict(), "linear": {**cfg.to_dict()["linear"], "num_v_heads": 3}})
