#!/usr/bin/env bash
# One device call on the 2-GPU machine (nvidia-h200-x2): the tensor-parallel tests on the 2 GPUs, then the
# benchmark (Nemotron-H-8B shapes, random BF16 weights): decode and prefill tokens/s on 2 GPUs vs 1.
# Logs and the JSON go to $OUT (the device tool's folder) or ./gpu_out.
#   tools/gpu_bench_tp.sh [TEST_TIMEOUT_S] [BENCH_DEADLINE_S] [extra bench_tp.py args...]
# e.g. run(kind=nvidia-h200-x2): tools/gpu_bench_tp.sh 180 300 --decode-batch 1,32 --prefill 1x2048
set -o pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
TEST_TIMEOUT=${1:-180}
BENCH_DEADLINE=${2:-300}
shift 2 2>/dev/null
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv 2>&1 | tee "$OUT/env.txt"
nvidia-smi topo -m 2>&1 | tee -a "$OUT/env.txt"
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1 | tee -a "$OUT/env.txt"

# f32 tests compare split and whole models to 2e-5: f32 matmuls stay f32 (no TF32); the tiny test shapes
# (head_dim 4) run the jnp kernels (the Pallas ones are tested at real shapes elsewhere; the bench uses them)
METRALE_TEST_GPU=1 JAX_DEFAULT_MATMUL_PRECISION=highest METRALE_KERNELS=reference timeout "$TEST_TIMEOUT" \
  python3 -m pytest -q -p no:cacheprovider -rfEs --durations=10 tests/sharding 2>&1 | tee "$OUT/tests.log"
echo "tests exit: $?" | tee -a "$OUT/tests.log"

timeout $((BENCH_DEADLINE + 240)) python3 benchmarks/bench_tp.py --out "$OUT" --deadline "$BENCH_DEADLINE" "$@" \
  2>&1 | tee "$OUT/bench.log"
echo "bench exit: $?"
