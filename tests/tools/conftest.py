"""Fixtures of the tools' tests."""
from __future__ import annotations

import pytest


@pytest.fixture
def harness(tmp_path):
    """The serve phase's harness (tools.servebench.tiered_phases.make_harness: prefix
    caching and PIC through one daemon, exact prefixes on) on qwen3next-tiny."""
    import argparse

    import torch

    from engine.builder import EngineConfig, build_engine
    from kvstore.testing import DaemonProcess
    from tools.bench_serving import engine_options
    from tools.servebench.tiered_phases import make_harness

    engine = build_engine("qwen3next-tiny", EngineConfig(**engine_options(None, torch.device("cpu"))))
    with DaemonProcess(tmp_path / "d", cpu_capacity="256MiB", nvme_capacity="256MiB", entry="kvstore.server") as d:
        h, _ = make_harness(argparse.Namespace(device_cache_fraction=None, pic_kernel="auto"), engine, str(d.socket),
                            sweep=False)
        h.pids["kvstore-daemon"] = d.proc.pid
        try:
            yield h
        finally:
            h.close()
