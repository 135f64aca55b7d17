#!/usr/bin/env bash
# One device call: the GPU tests of the decode-path, MoE and Mosaic GPU kernels, the serving runtime benchmark on
# Nemotron-H-8B shapes with block-FP8 weights (end-to-end decode, then RUNTIME_SECTIONS, default prefill and
# speculation on the built-in model), then the grouped-expert benchmark. Logs and JSON go to $OUT (the device tool's folder) or
# ./gpu_out. Most important first: a call cut short keeps what finished.
#   tools/gpu_check_runtime.sh
set -o pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv 2>&1 | tee "$OUT/env.txt"
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1 | tee -a "$OUT/env.txt"

METRALE_TEST_GPU=1 timeout ${TEST_TIMEOUT:-170} python3 -m pytest -q -p no:cacheprovider -rfEs --durations=8 \
  tests/kernels/test_registry.py tests/kernels/test_conv1d_pallas.py tests/kernels/test_grouped_kernels.py \
  tests/layers/test_moe_quantized.py tests/kernels/test_mgpu_gemv.py tests/kernels/test_mgpu_gemm.py \
  tests/kernels/test_mamba_layer_kernels.py 2>&1 | tee "$OUT/tests.log"
echo "tests exit: $?" | tee -a "$OUT/tests.log"

timeout ${E2E_TIMEOUT:-200} python3 benchmarks/bench_e2e_decode.py --out "$OUT/e2e_decode.json" \
  --weights fp8-block --states float32 --batches 1,32,256 2>&1 | tee "$OUT/e2e_fp8.log"
timeout ${RUNTIME_TIMEOUT:-200} python3 benchmarks/bench_runtime.py --out "$OUT" --weights fp8-block \
  --deadline ${RUNTIME_DEADLINE:-110} --sections ${RUNTIME_SECTIONS:-prefill,spec_builtin} 2>&1 \
  | tee "$OUT/runtime_fp8.log"
echo "bench_runtime fp8 exit: $?"

timeout ${MOE_TIMEOUT:-120} python3 benchmarks/bench_moe.py --out "$OUT" 2>&1 | tee "$OUT/moe.log"
echo "bench_moe exit: $?"
