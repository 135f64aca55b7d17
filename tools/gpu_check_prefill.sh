#!/usr/bin/env bash
# GPU check of the Mosaic GPU prefill GEMMs (one device call): tests/kernels/test_mgpu_gemm.py compiled on the
# GPU, ptxas resources of the default kernels (registers / spills), then benchmarks/bench_prefill.py
# (correctness at the 8B shapes, timings vs Triton arms, XLA BF16 and XLA FP8 in the same run).
#   OUT=/tmp/p DEADLINE=120 BENCH_ARGS="--sweep" tools/gpu_check_prefill.sh
# Short follow-up call: SKIP_PYTEST=1 SKIP_PTXAS=1 PTXAS_IN_BENCH=1 BENCH_ARGS="--sweep --no-triton --no-xla-fp8 ..."
# Fused activation quantization (XLA vs one-pass kernels, ~30 s): SKIP_PYTEST=1 SKIP_PTXAS=1 BENCH_ARGS="--quick-quant"
# NVFP4 GEMMs (the Mosaic w4a16_gemm / w4a16_gemm_t arms): NVFP4=1 OUT=$OUT/w BENCH_ARGS="--nvfp4 --sweep"
#   (pytest of tests/kernels/test_mgpu_gemm_nvfp4.py, ptxas resources of the w4a16_gemm_t kernel, then the benchmark)
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1 METRALE_TEST_GPU=1
OUT=${OUT:-/tmp/prefill_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jaxlib.__version__, jax.devices())" 2>&1 | tee -a "$OUT/gpu.txt"
if [ -n "${NVFP4:-}" ]; then
  timeout "${PYTEST_TIMEOUT:-90}" python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_mgpu_gemm_nvfp4.py \
      2>&1 | tee "$OUT/pytest_nvfp4.txt"
  MOSAIC_GPU_DUMP_PTXAS=1 timeout 60 python3 -c "
import jax, jax.numpy as jnp
from pallas_kernels import mgpu_gemm_nvfp4 as mn
N, K, M = 18560, 4096, 256
x = jnp.ones((M, K), jnp.bfloat16); p = jnp.zeros((K // 2, N), jnp.uint8); s = jnp.ones((K // 16, N), jnp.float8_e4m3fn)
print('=== w4a16_gemm_t mosaic', mn.default_tiles(M, N, K), flush=True)
jax.block_until_ready(mn.w4a16_gemm_t_mosaic(x, p, s, jnp.float32(1)))
" > "$OUT/ptxas_nvfp4.txt" 2>&1
  grep -i "===\|registers\|spill\|stack\|error" "$OUT/ptxas_nvfp4.txt" | head -20
  SKIP_PYTEST=1 SKIP_PTXAS=1
fi
if [ -z "${SKIP_PYTEST:-}" ]; then
  timeout "${PYTEST_TIMEOUT:-120}" python3 -m pytest -q -p no:cacheprovider -rs ${PYTEST_ARGS:-} \
      tests/kernels/test_mgpu_gemm.py 2>&1 | tee "$OUT/pytest_prefill.txt"
fi
[ -z "${SKIP_PTXAS:-}" ] && MOSAIC_GPU_DUMP_PTXAS=1 timeout 60 python3 -c "
import jax, jax.numpy as jnp
from pallas_kernels import mgpu_gemm as mg
N, K, M = 18560, 4096, 256
x = jnp.ones((M, K), jnp.bfloat16); w = jnp.ones((N, K), jnp.float8_e4m3fn)
print('=== fp8_gemm_t mosaic', mg.default_tiles(N, K, per_block=False), flush=True)
jax.block_until_ready(mg.fp8_gemm_t_mosaic(x, w, jnp.ones((N,), jnp.float32)))
print('=== w8a16_gemm_pipelined mosaic', mg.default_tiles(N, K, per_block=True), flush=True)
jax.block_until_ready(mg.w8a16_gemm_pipelined_mosaic(x, w, jnp.ones((N // 128, K // 128), jnp.float32)))
" > "$OUT/ptxas.txt" 2>&1
[ -f "$OUT/ptxas.txt" ] && grep -i "===\|registers\|spill\|stack\|error" "$OUT/ptxas.txt" | head -20
# PTXAS_IN_BENCH=1: ptxas resource lines of every Mosaic kernel the benchmark compiles (saves a JAX start)
${PTXAS_IN_BENCH:+env MOSAIC_GPU_DUMP_PTXAS=1} python3 benchmarks/bench_prefill.py --out "$OUT" --deadline "${DEADLINE:-120}" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_log.txt"
