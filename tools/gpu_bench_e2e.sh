#!/usr/bin/env bash
# One device call (issue 31): end-to-end decode (benchmarks/bench_e2e_decode.py) under XLA's command buffers off, at
# their default and over every kernel sequence (CUDA graphs with --xla_gpu_graph_min_graph_size=1), to see whether
# the idle gaps of a batch-1 step are launch gaps. Each arm writes $OUT/e2e_<arm>.json and its log (the JSON records
# XLA_FLAGS); copy the arm that wins to benchmarks/results/e2e_decode.json only after a full-table run.
#   tools/gpu_bench_e2e.sh [WEIGHTS (fp8-block)] [STATES (float32)] [BATCHES (1,256)] [TIMEOUT_PER_ARM_S (170)]
set -o pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
WEIGHTS=${1:-fp8-block}
STATES=${2:-float32}
BATCHES=${3:-1,256}
LIMIT=${4:-170}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/env.txt"
# the decode-step kernels compiled on this GPU first (a failure here makes the timings below moot)
METRALE_TEST_GPU=1 timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_decode_attention.py \
  tests/kernels/test_state_update_pallas.py 2>&1 | tail -15 | tee "$OUT/tests.log"
declare -A ARMS=([off]="--xla_gpu_enable_command_buffer=" [default]="" [graphs_all]="--xla_gpu_graph_min_graph_size=1")
for arm in off default graphs_all; do
  XLA_FLAGS="${ARMS[$arm]}" timeout "$LIMIT" python3 benchmarks/bench_e2e_decode.py --weights "$WEIGHTS" \
    --states "$STATES" --batches "$BATCHES" --out "$OUT/e2e_$arm.json" > "$OUT/e2e_$arm.log" 2>&1
  echo "$arm exit: $?" | tee -a "$OUT/e2e_$arm.log"
  grep -E "B=|error" "$OUT/e2e_$arm.log"
done
