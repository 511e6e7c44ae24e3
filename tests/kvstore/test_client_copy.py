"""The client's copy-out path (`ObjectView.copy_to`) and the pinning of the shared-memory
arena it relies on: where cudaHostRegister cannot run (this CPU machine), the client
logs the failure, keeps the mapping unpinned and still serves and copies the bytes."""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest
import torch

from kvstore import format as fmt
from kvstore.client.regions import RegionMapper
from kvstore.errors import BadObject, InvalidRequest


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning runs where CUDA is present; this pins the "
                    "fallback of a machine without it (the GPU box checks the pinned copy in its own tests)")
def test_pinning_that_cannot_run_falls_back_to_an_unpinned_mapping(daemon, caplog):
    data = os.urandom(3 << 20)
    with daemon.client() as kv:
        kv._core.regions = RegionMapper(pin=True)  # ask for pinning on a machine without CUDA
        with caplog.at_level(logging.WARNING, logger="kvstore.client"):
            kv.put(b"copy/pin", data, tier="cpu")
            with kv.get(b"copy/pin") as view:
                assert view.tensor().numpy().tobytes() == data
                arenas = list(kv._core.regions._table.arenas.values())
        assert arenas and not any(a.pinned for a in arenas)
        assert "cudaHostRegister" in caplog.text
        kv.delete([b"copy/pin"])


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_copy_to_a_host_tensor_in_chunks_with_verification_gives_the_bytes(daemon, tier):
    data = os.urandom((1 << 20) + 4097)
    key = f"copy/{tier}".encode()
    with daemon.client() as kv:
        kv.put(key, data, tier=tier)
        dst = torch.empty(len(data) + 10, dtype=torch.uint8)
        with kv.get(key) as view:
            assert view.copy_to(dst, chunk=64 << 10, verify=True) is None
        assert dst[: len(data)].numpy().tobytes() == data
        kv.delete([key])


def test_copy_to_verifies_a_kvsum_blob_with_its_own_algorithm(daemon):
    t = {"x": torch.randn(1000)}
    plan = fmt.plan_blob(t, fingerprint="f", token_count=1)
    blob = bytearray(plan.total_size)
    fmt.write_blob(blob, plan, t, algorithm=1)  # kvsum64, as put_tensors from GPU memory writes
    with daemon.client() as kv:
        kv.put(b"copy/kvsum", bytes(blob), tier="cpu")
        dst = torch.empty(len(blob), dtype=torch.uint8)
        with kv.get(b"copy/kvsum") as view:
            view.copy_to(dst, chunk=1000, verify=True)
        assert bytes(dst.numpy()) == bytes(blob)
        kv.delete([b"copy/kvsum"])


def test_copy_to_reports_a_checksum_mismatch_and_bad_destinations(daemon):
    data = os.urandom(50_000)
    with daemon.client() as kv:
        kv.put(b"copy/bad", data, tier="cpu")
        with kv.get(b"copy/bad") as view:
            with pytest.raises(InvalidRequest, match="uint8 tensor of >= 50000 bytes"):
                view.copy_to(torch.empty(10, dtype=torch.uint8))
            with pytest.raises(InvalidRequest, match="uint8"):
                view.copy_to(torch.empty(50_000, dtype=torch.float32))
            view.lease = dataclasses.replace(view.lease, checksum=view.checksum ^ 1)  # as if the bytes changed
            with pytest.raises(BadObject, match="hash to"):
                view.copy_to(torch.empty(50_000, dtype=torch.uint8), verify=True)
        kv.delete([b"copy/bad"])


def test_clients_of_one_process_share_one_arena_mapping_until_the_last_closes(daemon):
    """kvstore.client.regions._ArenaTable: an arena is mapped (and, with CUDA, pinned)
    once per process; `map_arenas` does it ahead of the first read."""
    from kvstore.client.regions import _TABLE

    a, b = daemon.client(), daemon.client()
    (path,) = a.map_arenas()
    assert path.endswith(".arena") and path in _TABLE.arenas
    arena = _TABLE.arenas[path]
    b.put(b"copy/shared", b"x" * 8192, tier="cpu")
    with b.get(b"copy/shared") as view:  # b reads through the mapping a made
        assert bytes(view.tensor().numpy()[:4]) == b"xxxx" and _TABLE.arenas[path] is arena
    b.delete([b"copy/shared"])
    a.close()
    assert _TABLE.arenas.get(path) is arena  # b still uses it
    b.close()
    assert path not in _TABLE.arenas and path not in _TABLE.users  # the last user dropped it
