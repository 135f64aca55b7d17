#!/usr/bin/env bash
# One device call: the NVFP4 / W4A4 path on the GPU. GPU pytest of the NVFP4 kernels and formats, the W4A4 decode
# arms (benchmarks/probes/w4a4_decode.py: eager vs jitted activation pass, Triton vs Mosaic), the NVFP4 prefill GEMMs
# (bench_prefill.py --nvfp4: transposed and plain-layout Mosaic arms vs XLA BF16) and the whole model with NVFP4
# weights (bench_runtime.py --weights nvfp4: decode and prefill). Everything lands in $OUT/nvfp4.tgz (one file).
#   OUT=$OUT tools/gpu_check_nvfp4.sh            (~6 min on the H200; PREFILL_ARGS=--sweep adds the launch sweep)
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/nvfp4_out}
W=$(mktemp -d)
mkdir -p "$OUT" "$W/w4a4" "$W/prefill" "$W/runtime"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 | tee "$W/gpu.txt"
METRALE_TEST_GPU=1 timeout "${PYTEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -rs \
    tests/kernels/test_mgpu_gemm_nvfp4.py tests/kernels/test_quant_kernels.py tests/weights/test_quant_formats.py \
    2>&1 | tee "$W/pytest.txt" | tail -4
timeout 120 python3 benchmarks/probes/w4a4_decode.py --out "$W/w4a4" > "$W/w4a4/log.txt" 2>&1; tail -3 "$W/w4a4/log.txt"
timeout 240 python3 benchmarks/bench_prefill.py --nvfp4 --no-triton --out "$W/prefill" \
    --deadline "${PREFILL_DEADLINE:-110}" ${PREFILL_ARGS:-} > "$W/prefill/log.txt" 2>&1; grep " us x" "$W/prefill/log.txt" | cut -c1-160
XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 timeout 240 python3 benchmarks/bench_runtime.py --out "$W/runtime" \
    --weights nvfp4 --sections "${RUNTIME_SECTIONS:-prefill}" --deadline 170 > "$W/runtime/log.txt" 2>&1
XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 timeout 240 python3 benchmarks/bench_e2e_decode.py --weights nvfp4 \
    --states float32 --batches 1,32,256 --out "$W/runtime/e2e_decode.json" >> "$W/runtime/log.txt" 2>&1
grep "B=\|prefill T=\|Error" "$W/runtime/log.txt" | head
tar czf "$OUT/nvfp4.tgz" -C "$W" .
