#!/usr/bin/env bash
# One device call: the Mamba-2 kernel tests compiled on the GPU, then the benchmark sweep.
# Logs and the benchmark JSON go to $OUT (the device tool's folder) or ./gpu_out.
#   tools/gpu_check_mamba.sh [TEST_TIMEOUT_S] [BENCH_DEADLINE_S] [extra bench args...]
#   SSD_ONLY=1 tools/gpu_check_mamba.sh ...   the SSD sweep and the SSD GPU tests only (issue #9)
set -o pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
TEST_TIMEOUT=${1:-120}
BENCH_DEADLINE=${2:-150}
shift 2 2>/dev/null
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# jax-linear-attention (a baseline) travels as a pure-python wheel under .whl/
if ls .whl/jax_linear_attention-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/jax_linear_attention-*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv 2>&1 | tee "$OUT/env.txt"
python3 -c 'import jax, triton; print("jax", jax.__version__, "triton", triton.__version__, jax.devices())' 2>&1 | tee -a "$OUT/env.txt"

if [ -n "$SSD_ONLY" ]; then
  # SSD only (issue #9): the SSD sweep first (Mosaic GPU and Triton arms, XLA, jla), then the GPU tests of both
  # arms; SSD_TESTS_K selects tests by -k (e.g. "not 4gib").
  timeout $((BENCH_DEADLINE + 30)) python3 benchmarks/bench_mamba.py --out "$OUT" --deadline "$BENCH_DEADLINE" \
    --only ssd "$@" 2>&1 | tee "$OUT/bench.log"
  echo "bench exit: $?" | tee -a "$OUT/bench.log"
  METRALE_TEST_GPU=1 timeout "$TEST_TIMEOUT" python3 -m pytest -q -p no:cacheprovider -m gpu -rfEs --durations=10 \
    -k "${SSD_TESTS_K:-not nothing}" tests/kernels/test_ssd_mgpu.py tests/kernels/test_ssd_pallas.py 2>&1 \
    | tee "$OUT/tests.log"
  echo "tests exit: $?" | tee -a "$OUT/tests.log"
  # the layer on the GPU default arms (ssd_scan resolves to the Mosaic arm there)
  METRALE_TEST_GPU=1 timeout "$TEST_TIMEOUT" python3 -m pytest -q -p no:cacheprovider -m 'not slow' -rfEs \
    tests/kernels/test_mamba_layer_kernels.py 2>&1 | tee -a "$OUT/tests.log"
  echo "layer tests exit: $?" | tee -a "$OUT/tests.log"
  exit 0
fi

TESTS="tests/kernels/test_ssd_pallas.py tests/kernels/test_ssd_mgpu.py tests/kernels/test_state_update_pallas.py
       tests/kernels/test_conv1d_pallas.py tests/kernels/test_norms_pallas.py tests/kernels/test_mamba_layer_kernels.py"
METRALE_TEST_GPU=1 timeout "$TEST_TIMEOUT" python3 -m pytest -q -p no:cacheprovider -m 'not slow' -rfEs \
  --durations=10 $TESTS 2>&1 | tee "$OUT/tests.log"
echo "tests exit: $?" | tee -a "$OUT/tests.log"

timeout $((BENCH_DEADLINE + 30)) python3 benchmarks/bench_mamba.py --out "$OUT" --deadline "$BENCH_DEADLINE" "$@" \
  2>&1 | tee "$OUT/bench.log"
echo "bench exit: $?"
