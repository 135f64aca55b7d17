#!/usr/bin/env bash
# One device call (issue 31): the decode-step kernels' GPU tests (decode attention, state update, the GEMVs'
# relu^2 epilogue), decode attention alone (benchmarks/bench_decode_attention.py), then end-to-end decode rows
# (benchmarks/bench_e2e_decode.py --update, which keeps the table's other rows). Everything goes to $OUT: copy
# e2e_decode.json over benchmarks/results/e2e_decode.json (and decode_attention.json) to commit them.
#   tools/gpu_bench_e2e.sh [WEIGHTS (fp8-block)] [STATES (float32)] [BATCHES (1,256)] [E2E_TIMEOUT_S (150)]
set -o pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
WEIGHTS=${1:-fp8-block}
STATES=${2:-float32}
BATCHES=${3:-1,256}
LIMIT=${4:-150}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/env.txt"
# the decode-step kernels compiled on this GPU first (a failure here makes the timings below moot)
METRALE_TEST_GPU=1 timeout 90 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_decode_attention.py \
  tests/kernels/test_state_update_pallas.py tests/kernels/test_conv1d_pallas.py 2>&1 | tail -15 | tee "$OUT/tests.log"
# the GEMVs with relu^2 in their epilogue (the MLP's up_proj), compiled, and rows' bits
METRALE_TEST_GPU=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_mgpu_gemv.py \
  -k "epilogue or batch_invariant" 2>&1 | tail -15 | tee -a "$OUT/tests.log"
timeout 150 python3 benchmarks/bench_decode_attention.py --out "$OUT/decode_attention.json" > "$OUT/da.log" 2>&1
echo "decode_attention exit: $?" | tee -a "$OUT/da.log"
cp benchmarks/results/e2e_decode.json "$OUT/e2e_decode.json"
timeout "$LIMIT" python3 benchmarks/bench_e2e_decode.py --weights "$WEIGHTS" --states "$STATES" --batches "$BATCHES" \
  --update --out "$OUT/e2e_decode.json" > "$OUT/e2e.log" 2>&1
echo "e2e exit: $?" | tee -a "$OUT/e2e.log"
grep -E "B=|rror" "$OUT/e2e.log"
