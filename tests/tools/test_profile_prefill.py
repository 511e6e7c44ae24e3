"""tools/profile_prefill.py: kernel families and the utilisation it derives from them."""
from __future__ import annotations

import pytest

from tools.profile_prefill import family, main, utilisation

FLASH = ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<256, 64, 64, 4, false, false, "
         "cutlass::bfloat16_t, Flash_kernel_traits<256, 64, 64, 4, cutlass::bfl")
GROUPED = ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13Gemm"
           "UniversalINS5_17GroupProblemShapeIN4cute5tupleIJiiiEEEEENS5_10collec")


@pytest.mark.parametrize("name, fam", [
    (FLASH, "softmax_attention"),            # carries cutlass types: not a GEMM
    (GROUPED, "grouped_gemm"),               # torch's grouped_mm through cutlass
    ("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT", "dense_gemm"),
    ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "linear_attention"),
    ("_causal_conv_kernel", "conv"),
    ("void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long)", "routing"),
])
def test_family(name, fam):
    assert family(name) == fam


def test_utilisation_splits_dense_parts():
    flops = {"dense": 80e12, "attention": 22e12, "linear": 2e12, "total": 104e12}
    fams = {"dense_gemm": {"ms": 63.0}, "grouped_gemm": {"ms": 64.0}, "softmax_attention": {"ms": 76.0},
            "elementwise": {"ms": 48.0}}
    u = utilisation(flops, fams, prefill_s=0.365, peak_tflops=1000.0)
    assert u["gemm"]["tflops"] == pytest.approx(80e12 / 0.127 / 1e12, rel=1e-3)
    assert u["attention"]["mfu"] == pytest.approx(22e12 / 0.076 / 1e15, rel=1e-3)
    assert u["dense_parts"]["ms"] == pytest.approx(203.0)
    assert u["dense_parts"]["mfu"] == pytest.approx(102e12 / 0.203 / 1e15, rel=1e-3)
    assert u["whole"]["mfu"] == pytest.approx(104e12 / 0.365 / 1e15, rel=1e-3)
    # a part whose kernels did not run has no utilisation, not a division by zero
    assert utilisation(flops, {}, 0.3)["attention"] == {"tflops": None, "mfu": None, "ms": 0.0}


def test_quick_run_writes_json(tmp_path):
    out = tmp_path / "p.json"
    assert main(["--quick", "--presets", "qwen3.5-35b-a3b-real", "--out", str(out)]) == 0
    import json
    res = json.loads(out.read_text())["presets"]["qwen3.5-35b-a3b-real"]
    assert res["tokens_per_s"] > 0 and res["flops"]["total"] > 0
    assert "utilisation" not in res      # CPU: no kernel times to divide by
