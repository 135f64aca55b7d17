#!/usr/bin/env bash
# One device call (issue 36): gradients through the default GPU kernels against the reference path, on the built-in
# model (tools/grad_check.py, JSON log), then the gradient and LoRA tests with the kernels compiled on the GPU.
# Logs and the JSON go to $OUT (the device tool's folder) or ./gpu_out; copy the JSON to
# benchmarks/results/grad_check.json to commit it.
#   tools/gpu_check_grads.sh [TEST_TIMEOUT_S]
set -o pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
TEST_TIMEOUT=${1:-300}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv 2>&1 | tee "$OUT/env.txt"
python3 tools/grad_check.py --kernels auto --out "$OUT/grad_check.json" 2>&1 | tee "$OUT/grad_check.log"
echo "grad_check exit: $?" | tee -a "$OUT/grad_check.log"
METRALE_TEST_GPU=1 timeout "$TEST_TIMEOUT" python3 -m pytest -q -p no:cacheprovider -rfEs --durations=10 \
  tests/kernels/test_kernel_grads.py tests/model/test_gradients.py tests/model/test_lora.py \
  tests/model/test_peft_adapter.py 2>&1 | tee "$OUT/tests.log"
echo "tests exit: $?" | tee -a "$OUT/tests.log"
