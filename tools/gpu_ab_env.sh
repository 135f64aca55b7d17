#!/usr/bin/env bash
# One device call: end-to-end decode rows without and then with extra environment settings (a lever such as
# XLA_FLAGS=...), same model and batches, so that the two runs' device_tok_s compare on one machine and their
# chained_tokens_sha256 say whether the bits held.
#   tools/gpu_ab_env.sh "VAR=VALUE [VAR=VALUE...]" [WEIGHTS (fp8-block)] [STATES (float32)] [BATCHES (1,256)] [LIMIT_S (200)]
#   e.g. tools/gpu_ab_env.sh XLA_FLAGS=--xla_gpu_enable_command_buffer= fp8-block float32 1,64
# Writes $OUT/ab_base.json and $OUT/ab_lever.json (never benchmarks/results: a lever is not the default table).
set -o pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
LEVER=${1:?environment settings to try, e.g. XLA_FLAGS=--xla_gpu_enable_command_buffer=}
WEIGHTS=${2:-fp8-block}
STATES=${3:-float32}
BATCHES=${4:-1,256}
LIMIT=${5:-200}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$OUT/env.txt"
for arm in base lever; do
  settings=""; [ "$arm" = lever ] && settings="$LEVER"
  # shellcheck disable=SC2086
  env $settings timeout "$LIMIT" python3 benchmarks/bench_e2e_decode.py --weights "$WEIGHTS" --states "$STATES" \
    --batches "$BATCHES" --out "$OUT/ab_$arm.json" > "$OUT/ab_$arm.log" 2>&1
  echo "$arm exit: $?" | tee -a "$OUT/ab_$arm.log"
done
python3 - "$OUT" "$LEVER" <<'PY'
import json, sys
runs = {arm: json.load(open(f"{sys.argv[1]}/ab_{arm}.json")) for arm in ("base", "lever")}
print("lever:", sys.argv[2])
rows = {arm: {(r["weights"], r["state_dtype"], r["batch"]): r for r in d["rows"]} for arm, d in runs.items()}
for key, b in rows["base"].items():
    f = rows["lever"].get(key)
    if f:
        print(key, f"device {b['device_tok_s']:,.0f} -> {f['device_tok_s']:,.0f} tok/s "
              f"({f['device_tok_s'] / b['device_tok_s'] - 1:+.1%}), kernels {b['kernels_per_step']} -> "
              f"{f['kernels_per_step']}, engine {b['engine_tok_s']:,.0f} -> {f['engine_tok_s']:,.0f}, same tokens: "
              f"{b['chained_tokens_sha256'] == f['chained_tokens_sha256']}")
PY
