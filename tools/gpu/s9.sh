#!/usr/bin/env bash
# Session 9's GPU runs. A ran late in session 9 on ONE H200 instead (presets and signature
# sources one after another; docs/BENCHMARKS.md, calls s9A-s9C: context signatures lose
# there); B has not run. Context signatures
# (PicConfig.miss_signatures, engine/pic/capture.py) on the H200. Ask the device tool's
# `status` first. Needs the fla-core wheel and the project's pure-Python deps the GPU box
# lacks, carried as wheels (device README): here, in the repo root,
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl fla-core==0.6.0 lmdb msgpack grpcio aiofiles typer rich prometheus-client
# (check KINDS.md's package list first: take only what the box lacks), then
#   run(kind="nvidia-h200-x2", carry=[".whl"], command="bash tools/gpu/s9.sh A")   # ~8 min
#   run(kind="nvidia-h200",    carry=[".whl"], command="bash tools/gpu/s9.sh B")   # ~4 min
# A: stream QPS, PIC with context signatures (GPU 0) vs alone signatures (GPU 1), both
#    presets, against prefix caching in the same run; then merge into
#    docs/results/serving-<date>-s9.json.
# B: correctness on CUDA (the per-range attention's SDPA lower-right form against the
#    masked reference; context signatures with the real fla, Triton splicing and the seam
#    chain in tools/check_pic_gpu.py), the per-request work of a cold stream
#    (tools/bench_miss_signatures.py), and the quality table on the GPU with both
#    signature sources.
set -uo pipefail
part=${1:?usage: tools/gpu/s9.sh A|B}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L | tee "$OUT/gpus.txt"
case "$part" in
A)
  common="--n 5 --qps-trials 7 --qps-requests 16 --qps-cache stream --skip sharing,cold,breakdown --cpu-capacity 24GiB --cold-full-fraction 0"
  for preset in qwen3next-bench ring-bench; do
    CUDA_VISIBLE_DEVICES=0 python3 tools/bench_serving.py --presets $preset $common --miss-signatures context \
      --json "$OUT/serving-$preset-ctx.json" > "$OUT/serving-$preset-ctx.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 python3 tools/bench_serving.py --presets $preset $common --miss-signatures alone \
      --json "$OUT/serving-$preset-alone.json" > "$OUT/serving-$preset-alone.log" 2>&1 &
    wait
  done
  python3 tools/bench_serving.py --merge "$OUT/serving-qwen3next-bench-ctx.json" "$OUT/serving-ring-bench-ctx.json" \
    --json "$OUT/serving-s9-ctx.json"
  tail -n 40 "$OUT"/serving-*-ctx.log "$OUT"/serving-*-alone.log
  ;;
B)
  python3 -m pytest -q tests/engine/models/test_attention_ranges.py tests/engine/pic/test_capture.py tests/kernels \
    2>&1 | tail -n 5 | tee "$OUT/pytest.txt"
  timeout 200 python3 tools/check_pic_gpu.py --skip-timing --json-path "$OUT/check-pic-gpu.json" 2>&1 | tail -n 8 \
    | tee "$OUT/check-pic-gpu.log"   # ctx_splice_back_max_abs_logit_diff, ctx_first_capture_vs_alone_rel_err
  timeout 240 python3 tools/bench_miss_signatures.py --presets qwen3next-bench,ring-bench --n 24 \
    --json "$OUT/miss-signatures-gpu.json" 2>&1 | tee "$OUT/miss-signatures-gpu.log"
  timeout 200 python3 -m tools.quality --presets qwen3next-tiny,ring-tiny --methods full,pic --seams 16 \
    --miss-signatures alone,context --n 100 --device cuda --no-progress --markdown \
    --json --json-path "$OUT/quality-gpu-ctx.json" 2>&1 | tail -n 20 | tee "$OUT/quality-gpu.log"
  ;;
*) echo "unknown part $part (A or B)"; exit 2 ;;
esac
