"""Fixtures of the checkpoint tests (helpers in hf_testlib.py): one tiny checkpoint per
architecture per module, built on first use."""
from __future__ import annotations

import pytest

import hf_testlib as H


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread):
    """Every test of this module on one torch thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(arch) -> the directory of a tiny `arch` checkpoint (hf_testlib.build)."""
    made = {}

    def get(arch: str):
        if arch not in made:
            d = tmp_path_factory.mktemp(arch)
            H.build(arch, d)
            made[arch] = d
        return made[arch]
    return get
