"""Tests of tools/bench_kernels.py that run without a GPU: the table it prints and its
refusal to run on a machine without CUDA. (The timings themselves run on the GPU box.)"""
import pytest
import torch

from tools.bench_kernels import BenchRow, format_table, main


def test_table_reports_bandwidth_and_speedup_from_measured_times():
    rows = [BenchRow("state_compose", "dense m=8", triton_ms=0.5, torch_ms=2.0,
                     bytes_moved=1_000_000_000, max_abs_diff=3e-6)]
    lines = format_table(rows).splitlines()
    assert lines[0].split()[:3] == ["kernel", "case", "triton"]
    cells = lines[2].split("  ")
    cells = [c.strip() for c in cells if c.strip()]
    assert cells == ["state_compose", "dense m=8", "0.5000", "2000", "2.0000", "500", "4.0x", "3.00e-06"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit path")
def test_exits_with_status_2_without_cuda(capsys):
    assert main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err
