#!/usr/bin/env bash
# One device call: the serving-runtime benchmark (benchmarks/bench_runtime.py) on Nemotron-H-8B shapes with
# random BF16 weights; optionally the runtime tests on the GPU first. Logs and the JSON go to $OUT (the device
# tool's folder) or ./gpu_out.
#   tools/gpu_bench_runtime.sh [BENCH_DEADLINE_S] [TEST_TIMEOUT_S (0 = no tests)] [extra bench args...]
# e.g. tools/gpu_bench_runtime.sh 480 0 --sections prefill,ttft
# Expect roughly 17 compiles of the 52-block model (prefill + ttft 9, spec 8); sections that start
# after the deadline are skipped and recorded as such in the JSON.
set -o pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
BENCH_DEADLINE=${1:-480}
TEST_TIMEOUT=${2:-0}
shift 2 2>/dev/null
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# keep the pools and weights (~45 GB at batch 256) clear of XLA's default 75% preallocation headroom
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv 2>&1 | tee "$OUT/env.txt"
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' 2>&1 | tee -a "$OUT/env.txt"

if [ "$TEST_TIMEOUT" -gt 0 ]; then
  METRALE_TEST_GPU=1 timeout "$TEST_TIMEOUT" python3 -m pytest -q -p no:cacheprovider -m 'not slow' -rfEs \
    --durations=10 tests/runtime 2>&1 | tee "$OUT/tests.log"
  echo "tests exit: $?" | tee -a "$OUT/tests.log"
fi

timeout $((BENCH_DEADLINE + 120)) python3 benchmarks/bench_runtime.py --out "$OUT" --deadline "$BENCH_DEADLINE" "$@" \
  2>&1 | tee "$OUT/bench.log"
echo "bench exit: $?"
