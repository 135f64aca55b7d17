#!/usr/bin/env bash
# One device call (under its 600 s) for the untimed decode lever, the FP8 decode on the FP8 matrix units
# (--fp8-decode-activations e4m3, aimed at batch >= 64), against the default rows of the same call: its GPU tests
# first (w8a8_gemv's Mosaic arm, not its GPU default yet: the e4m3 rows time it where they pass, else the Triton
# arm), then the default rows, then the e4m3 rows.
#   OUT=$OUT bash tools/gpu_decode_levers.sh [BATCHES (1,256)]
# Writes $OUT/ab_base.json, e4m3.json and the logs; never benchmarks/results.
set -o pipefail
OUT=${OUT:-gpu_out}
BATCHES=${1:-1,256}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
# the kernel's runs (the lowering and shared-memory checks are CPU tests, already run in CI); the four 8B-shape
# tests compile the four decode shapes' launches (the slowest; the call of 2026-12-08 ran the first in its 90 s)
METRALE_TEST_GPU=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_mgpu_gemv_w8a8.py \
  -k "not lowers_for_cuda and not shared_memory_stages and not alignment_check" > "$OUT/w8a8_tests.log" 2>&1
TESTS=$?
tail -8 "$OUT/w8a8_tests.log"
# the Mosaic arm is timed only if its GPU tests passed; else the e4m3 rows time the Triton arm (the registry default)
ARM=triton; [ "$TESTS" = 0 ] && ARM=mosaic
echo "w8a8 GPU tests exit $TESTS: the e4m3 rows time w8a8_gemv's $ARM arm" | tee -a "$OUT/w8a8_tests.log"
timeout 150 python3 benchmarks/bench_e2e_decode.py --weights fp8-block --states float32 --batches "$BATCHES" \
  --out "$OUT/ab_base.json" > "$OUT/base.log" 2>&1
echo "base exit: $?" | tee -a "$OUT/base.log"
timeout 120 python3 benchmarks/bench_e2e_decode.py --weights fp8-block --states float32 --batches "$BATCHES" \
  --fp8-decode-activations e4m3 --gpu-default "w8a8_gemv=$ARM" --out "$OUT/e4m3.json" > "$OUT/e4m3.log" 2>&1
echo "e4m3 exit: $?" | tee -a "$OUT/e4m3.log"
python3 - "$OUT" <<'PY'
import json, sys
base = {r["batch"]: r for r in json.load(open(f"{sys.argv[1]}/ab_base.json"))["rows"]}
e4m3 = json.load(open(f"{sys.argv[1]}/e4m3.json"))
arm = e4m3["levers"].get("gpu_defaults", {}).get("w8a8_gemv")
for r in e4m3["rows"]:
    b = base.get(r["batch"])
    if b:
        print(f"e4m3 ({arm}) B={r['batch']}: device {b['device_tok_s']:,.0f} -> {r['device_tok_s']:,.0f} tok/s "
              f"({r['device_tok_s'] / b['device_tok_s'] - 1:+.1%}), engine {b['engine_tok_s']:,.0f} -> "
              f"{r['engine_tok_s']:,.0f}")
PY
