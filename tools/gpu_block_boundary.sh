#!/usr/bin/env bash
# One device call (issue 31, Build 2): the fused block boundary (norms.add_rmsnorm reading the output projections'
# split partials; the Mosaic GEMVs' partials as uint16 halves) proved on the GPU, then timed against its fallback
# (--disable add_rmsnorm: the partials' sum + residual add, then the plain norm) in the same call.
#   OUT=$OUT [TESTS=0] bash tools/gpu_block_boundary.sh [WEIGHTS (fp8-block; bf16: the dense arm's float32
#   output handed on)] [BATCHES (1,256)]
# TESTS=0 skips the GPU tests (a second call for other weights). Writes $OUT/fused.json, unfused.json and the logs;
# never benchmarks/results.
set -o pipefail
OUT=${OUT:-gpu_out}
WEIGHTS=${1:-fp8-block}
BATCHES=${2:-1,256}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
# compiled: the fused kernel against its composition, every GEMV arm's unreduced partials, and the GEMVs' float32
# partials (now row-major uint16 halves) on their split, tail and 8B-shape paths
if [ "${TESTS:-1}" != 0 ]; then
  METRALE_TEST_GPU=1 timeout 240 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_add_rmsnorm.py \
    tests/kernels/test_mgpu_gemv.py -k "add_rmsnorm or matches_reference or tail or 8b_shapes or large_batch" \
    > "$OUT/tests.log" 2>&1
  echo "GPU tests exit $?" | tee -a "$OUT/tests.log"
  tail -6 "$OUT/tests.log"
fi
for arm in fused unfused; do
  extra=(); [ "$arm" = unfused ] && extra=(--disable add_rmsnorm)
  timeout 170 python3 benchmarks/bench_e2e_decode.py --weights "$WEIGHTS" --states float32 --batches "$BATCHES" \
    "${extra[@]}" --out "$OUT/$arm.json" > "$OUT/$arm.log" 2>&1
  echo "$arm exit: $?" | tee -a "$OUT/$arm.log"
done
python3 - "$OUT" <<'PY'
import json, sys
rows = {arm: {r["batch"]: r for r in json.load(open(f"{sys.argv[1]}/{arm}.json"))["rows"]} for arm in ("fused", "unfused")}
for b, f in rows["fused"].items():
    u = rows["unfused"].get(b)
    if u:
        print(f"B={b}: device {u['device_tok_s']:,.0f} -> {f['device_tok_s']:,.0f} tok/s "
              f"({f['device_tok_s'] / u['device_tok_s'] - 1:+.1%}), engine {u['engine_tok_s']:,.0f} -> "
              f"{f['engine_tok_s']:,.0f}, kernels {u.get('kernels_per_step')} -> {f.get('kernels_per_step')}, "
              f"same tokens {f.get('chained_tokens_sha256') == u.get('chained_tokens_sha256')}")
PY
