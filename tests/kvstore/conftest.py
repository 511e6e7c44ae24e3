"""Fixtures starting the REAL kvstore daemon (`python -m kvstore.cli serve`) as a
subprocess on a temporary socket, cache directory and shared-memory arena."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from kvstore.testing import DaemonProcess


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    """start_daemon(name="d", **DaemonProcess kwargs) -> a started daemon, cleaned up after the test."""
    made: list[DaemonProcess] = []

    def start(name: str = "d", **kwargs: Any) -> DaemonProcess:
        d = DaemonProcess(tmp_path / name, **kwargs)
        made.append(d)
        return d.start()

    yield start
    for d in made:
        d.cleanup()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon shared by a test module (CPU 32MiB, NVMe 128MiB): for tests that use
    their own keys and need no particular capacity."""
    d = DaemonProcess(tmp_path_factory.mktemp("daemon"), cpu_capacity="32MiB", nvme_capacity="128MiB")
    d.start()
    yield d
    d.cleanup()
