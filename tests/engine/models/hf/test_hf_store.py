"""Segment signatures of Hugging Face checkpoints (Qwen3-Next, Qwen3.5 dense and MoE,
Gemma 3, Nemotron-H; tiny random weights) through a REAL kvstore daemon: a second engine
on the same checkpoint hits every segment the first one stored and generates what
in-process PIC generates (hf_testlib.check_signatures_round_trip)."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import hf_testlib as H  # noqa: E402


@pytest.mark.parametrize("arch", H.ARCHS)
def test_signatures_round_trip_through_a_real_daemon(checkpoint, arch, tmp_path):
    H.check_signatures_round_trip(checkpoint(arch), tmp_path)
