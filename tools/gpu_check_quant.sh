#!/usr/bin/env bash
# GPU check of the quantized projection kernels (one device call): the kernel tests compiled on the GPU
# against their references, then benchmarks/bench_quant.py (correctness at the 8B shapes, timings with
# baselines from the same run). Results land in $OUT (copy them to benchmarks/results/).
#   OUT=/tmp/q DEADLINE=150 BENCH_ARGS=--sweep tools/gpu_check_quant.sh
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1 METRALE_TEST_GPU=1
OUT=${OUT:-/tmp/quant_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jaxlib.__version__, jax.devices())" 2>&1 | tee -a "$OUT/gpu.txt"
timeout "${PYTEST_TIMEOUT:-90}" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant_kernels.py \
    2>&1 | tee "$OUT/pytest_quant.txt"
python3 benchmarks/bench_quant.py --out "$OUT" --deadline "${DEADLINE:-150}" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_log.txt"
