#!/usr/bin/env bash
# GPU check of the quantized projection kernels (one device call): the kernel tests compiled on the GPU
# against their references, then benchmarks/bench_quant.py (correctness at the 8B shapes, timings with
# baselines from the same run). Results land in $OUT (copy them to benchmarks/results/).
#   OUT=/tmp/q DEADLINE=150 BENCH_ARGS=--sweep tools/gpu_check_quant.sh
# Decode GEMVs with the Mosaic GPU arms:
#   OUT=/tmp/q DEADLINE=200 MGPU=1 BENCH_ARGS="--decode-only --mosaic --mosaic-sweep" tools/gpu_check_quant.sh
# MGPU=1 runs tests/kernels/test_mgpu_gemv.py compiled on the GPU, the gpu-marked tests of test_quant_kernels.py
# (QUANT_PYTEST_ARGS, default "-m gpu"), and dumps ptxas resources + SASS of the default Mosaic GEMVs (sass.txt).
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1 METRALE_TEST_GPU=1
OUT=${OUT:-/tmp/quant_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jaxlib.__version__, jax.devices())" 2>&1 | tee -a "$OUT/gpu.txt"
if [ -n "${MGPU:-}" ]; then
  { timeout "${PYTEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_mgpu_gemv.py
    timeout "${PYTEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider ${QUANT_PYTEST_ARGS--m gpu} \
        tests/kernels/test_quant_kernels.py; } 2>&1 | tee "$OUT/pytest_quant.txt"
  MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 timeout 60 python3 -c "
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels import mgpu_gemv_w4 as mg4, mgpu_gemv_w8 as mg8
N, K = 18560, 4096
x = jnp.ones((1, K), jnp.bfloat16)
w = jnp.ones((N, K), jnp.float8_e4m3fn); s = jnp.ones((N // 128, K // 128), jnp.float32)
print('=== w8a16_gemv mosaic', mg8.w8a16_gemv_blocks(N, K), flush=True)
jax.block_until_ready(mg8.w8a16_gemv_mosaic(x, w, s))
p = jnp.ones((N, K // 2), jnp.uint8); s4 = jnp.ones((N, K // 16), jnp.float8_e4m3fn)
print('=== w4a16_gemv mosaic', mg4.w4a16_gemv_blocks(N, K), flush=True)
jax.block_until_ready(mg4.w4a16_gemv_mosaic(x, p, s4, jnp.float32(1)))
" > "$OUT/sass.txt" 2>&1
  grep -i "registers\|spill\|smem\|stack" "$OUT/sass.txt" | head -20
else
  timeout "${PYTEST_TIMEOUT:-90}" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant_kernels.py \
      2>&1 | tee "$OUT/pytest_quant.txt"
fi
python3 benchmarks/bench_quant.py --out "$OUT" --deadline "${DEADLINE:-150}" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_log.txt"
