#!/usr/bin/env bash
# One device call: end-to-end decode rows without and then with a change, same model, batches and machine, so that
# the two runs' device_tok_s compare and their chained_tokens_sha256 say whether the bits held. The change is
# extra environment settings (a lever such as XLA_FLAGS=...), or this tree against an earlier one (BASE_TREE):
#   tools/gpu_ab_env.sh "VAR=VALUE [VAR=VALUE...]" [WEIGHTS (fp8-block)] [STATES (float32)] [BATCHES (1,256)] [LIMIT_S (200)]
#   e.g. tools/gpu_ab_env.sh XLA_FLAGS=--xla_gpu_enable_command_buffer= fp8-block float32 1,64
#   BASE_TREE=ab_base tools/gpu_ab_env.sh "" bf16 bfloat16 64,256     (the baseline: an earlier commit unpacked
#   here first, `mkdir -p ab_base && git archive REV | tar -x -C ab_base`, and carried: run's carry ["ab_base"];
#   it runs this tree's benchmark scripts on its own library, so both profiles are taken the same way)
# The summary prints each row's tok/s and, per kernel (its launches over the layers summed), the time that moved.
# Writes $OUT/ab_base.json and $OUT/ab_lever.json (never benchmarks/results: a lever is not the default table).
set -o pipefail
OUT=$(mkdir -p "${OUT:-gpu_out}" && cd "${OUT:-gpu_out}" && pwd)
LEVER=${1?environment settings to try (\"\" with BASE_TREE), e.g. XLA_FLAGS=--xla_gpu_enable_command_buffer=}
[ -n "$LEVER" ] || [ -n "$BASE_TREE" ] || { echo "nothing to compare: give settings or BASE_TREE" >&2; exit 2; }
WEIGHTS=${2:-fp8-block}
STATES=${3:-float32}
BATCHES=${4:-1,256}
LIMIT=${5:-200}
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$OUT/env.txt"
[ -z "$BASE_TREE" ] || cp benchmarks/*.py "$BASE_TREE/benchmarks/"
for arm in base lever; do
  settings=""; tree=.
  if [ "$arm" = lever ]; then settings="$LEVER"; else tree=${BASE_TREE:-.}; fi
  # shellcheck disable=SC2086
  (cd "$tree" && env PYTHONPATH=. $settings timeout "$LIMIT" python3 benchmarks/bench_e2e_decode.py \
    --weights "$WEIGHTS" --states "$STATES" --batches "$BATCHES" --out "$OUT/ab_$arm.json") > "$OUT/ab_$arm.log" 2>&1
  echo "$arm ($tree) exit: $?" | tee -a "$OUT/ab_$arm.log"
done
python3 - "$OUT" "$LEVER" <<'PY'
import json, sys
runs = {arm: json.load(open(f"{sys.argv[1]}/ab_{arm}.json")) for arm in ("base", "lever")}
print("lever:", sys.argv[2] or "this tree against BASE_TREE")
rows = {arm: {(r["weights"], r["state_dtype"], r["batch"]): r for r in d["rows"]} for arm, d in runs.items()}
for key, b in rows["base"].items():
    f = rows["lever"].get(key)
    if f:
        print(key, f"device {b['device_tok_s']:,.0f} -> {f['device_tok_s']:,.0f} tok/s "
              f"({f['device_tok_s'] / b['device_tok_s'] - 1:+.1%}), kernels {b['kernels_per_step']} -> "
              f"{f['kernels_per_step']}, engine {b['engine_tok_s']:,.0f} -> {f['engine_tok_s']:,.0f}, same tokens: "
              f"{b['chained_tokens_sha256'] == f['chained_tokens_sha256']}")
        kb, kf = b.get("top_kernels", {}), f.get("top_kernels", {})
        for name in sorted(set(kb) | set(kf), key=lambda n: -max(kb.get(n, {}).get("us", 0), kf.get(n, {}).get("us", 0))):
            ub, uf = kb.get(name, {}).get("us", 0.0), kf.get(name, {}).get("us", 0.0)
            if abs(uf - ub) >= 2.0:
                print(f"    {name}: {ub:,.1f} -> {uf:,.1f} us per step (launches {kb.get(name, {}).get('n', 0)} -> "
                      f"{kf.get(name, {}).get('n', 0)})")
PY
