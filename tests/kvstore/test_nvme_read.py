"""NVMe read backends (kvstore.tiers.nvme_read): the setting's resolution (posix and
kvikio as asked, kvikio refused with its reason where it cannot run, auto = kvikio only
with GPUDirect Storage), the POSIX reader on real files (O_DIRECT where aligned, any
offset), calibration, and the connector's setting; the kvikio reader itself runs only
where kvikio imports (skipped elsewhere)."""
from __future__ import annotations

import os

import pytest
import torch

from engine.connector.config import StoreConnectorConfig
from engine.connector.errors import ConnectorConfigError
from kvstore.errors import InvalidRequest
from kvstore.tiers.nvme_read import KvikioStatus, NvmeReader, calibrate, kvikio_status, resolve_backend

ABSENT = KvikioStatus(False, False, None, "kvikio is not importable (ModuleNotFoundError: no kvikio)")
COMPAT = KvikioStatus(True, True, False)
GDS = KvikioStatus(True, True, True)
NO_CUDA = KvikioStatus(True, False, False, "no CUDA device for kvikio to read into")


@pytest.mark.parametrize("status, auto", [(ABSENT, "posix"), (NO_CUDA, "posix"), (COMPAT, "posix"), (GDS, "kvikio")])
def test_auto_takes_kvikio_only_with_gds(status, auto):
    assert resolve_backend("auto", status) == auto
    assert resolve_backend("posix", status) == "posix"


@pytest.mark.parametrize("status", [COMPAT, GDS])
def test_kvikio_as_asked_where_it_runs(status):
    assert resolve_backend("kvikio", status) == "kvikio"


@pytest.mark.parametrize("status, why", [(ABSENT, "not importable"), (NO_CUDA, "no CUDA device")])
def test_kvikio_where_it_cannot_run_is_refused_with_its_reason(status, why):
    with pytest.raises(InvalidRequest, match=f"nvme_read_backend=kvikio: .*{why}"):
        resolve_backend("kvikio", status)


def test_an_unknown_backend_is_one_clear_error():
    with pytest.raises(InvalidRequest, match=r"nvme_read_backend='gds' must be one of auto, posix, kvikio"):
        resolve_backend("gds", ABSENT)
    with pytest.raises(ConnectorConfigError, match="nvme_read_backend='gds'"):
        StoreConnectorConfig(nvme_read_backend="gds")
    assert StoreConnectorConfig().nvme_read_backend == "auto"


def _file(tmp_path, n: int) -> tuple[str, bytes]:
    data = os.urandom(n)
    path = tmp_path / "object.bin"
    path.write_bytes(data)
    return str(path), data


@pytest.mark.parametrize("offset, length", [(0, 1 << 20), (4096, 3 << 20), (123, 70_001)])
def test_the_posix_reader_reads_the_exact_region(tmp_path, offset, length):
    path, data = _file(tmp_path, 4 << 20)
    dst = torch.zeros(length + 17, dtype=torch.uint8)
    assert NvmeReader("posix").read(path, offset, length, dst) is None  # host memory: complete on return
    assert bytes(dst[:length].numpy()) == data[offset:offset + length]
    assert int(dst[length:].sum()) == 0  # nothing past the region


def test_the_posix_reader_refuses_a_bad_destination(tmp_path):
    path, _ = _file(tmp_path, 8192)
    with pytest.raises(InvalidRequest, match="contiguous 1-D uint8 tensor"):
        NvmeReader("posix").read(path, 0, 8192, torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(InvalidRequest, match="posix or kvikio"):
        NvmeReader("auto")


def test_calibration_times_the_usable_backends_and_names_the_fastest(tmp_path):
    path, _ = _file(tmp_path, 2 << 20)
    got = calibrate(path, 0, 2 << 20, "cpu")
    assert got["gb_per_s"]["posix"] > 0 and got["best"] in got["gb_per_s"]
    if not kvikio_status().usable:
        assert "kvikio" in got["skipped"] and got["best"] == "posix"


def test_the_kvikio_reader_reads_the_exact_region(tmp_path):
    status = kvikio_status()
    if not status.usable:
        pytest.skip(status.reason)
    path, data = _file(tmp_path, 4 << 20)  # pragma: no cover - kvikio + CUDA only
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    NvmeReader("kvikio").read(path, 4096, 1 << 20, dst).synchronize()
    assert bytes(dst.cpu().numpy()) == data[4096:4096 + (1 << 20)]


def test_the_segment_loader_refuses_kvikio_where_it_cannot_run():
    status = kvikio_status()
    if status.usable:
        pytest.skip("kvikio runs here")
    from engine.connector.loader import SegmentLoader

    with pytest.raises(ConnectorConfigError, match="nvme_read_backend=kvikio: "):
        SegmentLoader(None, None, "fp", torch.device("cpu"), nvme_read_backend="kvikio")
    loader = SegmentLoader(None, None, "fp", torch.device("cpu"))  # auto: posix on the CPU
    assert loader.nvme_backend == "posix"
    loader.close()
