"""Fixtures of the store connector tests: a REAL kvstore daemon (`python -m kvstore.cli
serve` in a subprocess, via kvstore.testing.DaemonProcess) on a temporary socket, cache
directory and shared-memory arena; engines on tiny presets (CPU, fp32) attached to it;
and small segmented prompts."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from connector_testlib import new_engine
from engine.connector.attach import attach_store
from engine.connector.config import StoreConnectorConfig
from engine.pic.config import PicConfig
from engine.pic.run import attach_planner
from kvstore.testing import DaemonProcess


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Every test of this module on one torch thread (tests/conftest.py)."""


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """start_daemon(name="d", **DaemonProcess kwargs) -> a started daemon, cleaned up after the test."""
    made: list[DaemonProcess] = []

    def start(name: str = "d", **kwargs: Any) -> DaemonProcess:
        d = DaemonProcess(tmp_path / name, entry="kvstore.server", **kwargs)  # no typer/rich needed
        made.append(d)
        return d.start()

    yield start
    for d in made:
        d.cleanup()


@pytest.fixture
def store_engine() -> Iterator[Callable[..., Any]]:
    """store_engine(daemon, preset=..., **StoreConnectorConfig overrides) -> (engine, planner)
    with PIC through the daemon; every cache is closed after the test."""
    planners = []

    def make(daemon: DaemonProcess, preset: str = "qwen3next-tiny", pic: PicConfig = PicConfig(miss_path="alone"), **overrides):
        engine = new_engine(preset)
        cfg = dict(socket=str(daemon.socket), rpc_timeout_s=5.0, reconnect_min_s=0.05, reconnect_max_s=0.2)
        cfg.update(overrides)
        planner = attach_store(engine, pic, StoreConnectorConfig(**cfg))
        planners.append(planner)
        return engine, planner

    yield make
    for p in planners:
        p.store.close(timeout=10.0)


@pytest.fixture
def memory_engine() -> Callable[..., Any]:
    """memory_engine(preset) -> (engine, planner) with PIC over the in-process cache."""
    def make(preset: str = "qwen3next-tiny", pic: PicConfig = PicConfig(miss_path="alone")):
        engine = new_engine(preset)
        return engine, attach_planner(engine, pic)
    return make
