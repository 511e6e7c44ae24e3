"""Fixtures of the checkpoint tests (helpers in hf_testlib.py): one tiny checkpoint per
architecture per module, built on first use."""
from __future__ import annotations

import pytest
import torch

import hf_testlib as H


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls run fastest on one thread, and the test machine is shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
