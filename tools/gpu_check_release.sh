#!/usr/bin/env bash
# One device call that re-checks main on the GPU within BUDGET seconds, most important first: the GPU runs of
# the kernel test files (each with its own timeout, so one slow file loses only itself) and the benchmarks
# named in STEPS between them. Everything lands in $OUT/w and is tarred to $OUT/results.tgz (the device tool returns 8 files).
#   OUT=$OUT BUDGET=540 tools/gpu_check_release.sh
# PYTEST=0 skips the test files. STEPS (default all but prefill_quant, in this order): prefill_quant
# (bench_prefill.py --quick-quant: both FP8 arms with XLA / fused quantization), norm_fp8 (the same with
# --norm-fp8: norm + projection, bf16 norm + XLA BF16 vs fused E4M3 norm + FP8 arms), act_quant (bench_act_quant.py),
# nvfp4 (bench_prefill.py --nvfp4 --sweep),
# spec (bench_runtime.py spec_builtin: n-gram and MTP drafting on the built-in model), grid (bench_quant.py's
# launch-shape grid of both Mosaic GEMVs, GRID_TIMEOUT seconds). A step starts only if BUDGET leaves it its timeout.
set -o pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1 METRALE_TEST_GPU=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
OUT=${OUT:-/tmp/release_out}
W="$OUT/w"; mkdir -p "$W"
BUDGET=${BUDGET:-540}
STEPS=${STEPS:-norm_fp8,act_quant,nvfp4,spec,grid}
left() { echo $(( BUDGET - SECONDS - 15 )); }
step() {   # step NAME TIMEOUT CMD...: run CMD under TIMEOUT if the budget allows, log to $W/NAME.log
  local name=$1 t=$2; shift 2
  if [ "$(left)" -lt "$t" ]; then echo "SKIPPED $name: $(left) s left, needs $t" | tee -a "$W/summary.txt"; return; fi
  timeout "$t" "$@" > "$W/$name.log" 2>&1
  echo "$name exit $? after ${SECONDS}s" | tee -a "$W/summary.txt"
}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, jaxlib.__version__, jax.devices())"; } > "$W/env.txt" 2>&1

pytest_file() {   # pytest_file FILE TIMEOUT
  local n; n=$(basename "$1" .py)
  step "pytest_$n" "$2" python3 -m pytest -q -p no:cacheprovider -rfEs "$1"
  [ -f "$W/pytest_$n.log" ] && tail -3 "$W/pytest_$n.log" | sed "s|^|  $n: |" >> "$W/summary.txt"
}
if [ "${PYTEST:-1}" = 1 ]; then
pytest_file tests/layers/test_moe_quantized.py 60
pytest_file tests/kernels/test_mamba_layer_kernels.py 80
fi
case ",$STEPS," in *,prefill_quant,*) step prefill_quant 100 python3 benchmarks/bench_prefill.py --out "$W" \
  --deadline 80 --quick-quant;; esac
case ",$STEPS," in *,norm_fp8,*) step norm_fp8 "${NORM_TIMEOUT:-170}" python3 benchmarks/bench_prefill.py --out "$W" \
  --deadline $(( ${NORM_TIMEOUT:-170} - 30 )) --quick-quant --norm-fp8;; esac
case ",$STEPS," in *,act_quant,*) step act_quant 150 python3 benchmarks/bench_act_quant.py --out "$W";; esac
if [ "${PYTEST:-1}" = 1 ]; then
pytest_file tests/kernels/test_mgpu_gemm.py 90
pytest_file tests/kernels/test_mgpu_gemm_nvfp4.py 60
pytest_file tests/kernels/test_mgpu_gemv.py 150
pytest_file tests/kernels/test_norm_fp8.py 90
fi
case ",$STEPS," in *,nvfp4,*) step nvfp4 "${NVFP4_TIMEOUT:-130}" python3 benchmarks/bench_prefill.py --out "$W" \
  --deadline $(( ${NVFP4_TIMEOUT:-130} - 30 )) --nvfp4 \
  --sweep --no-triton;; esac
case ",$STEPS," in *,spec,*) step spec 100 python3 benchmarks/bench_runtime.py --out "$W" --sections spec_builtin;; esac
case ",$STEPS," in *,grid,*) step grid "${GRID_TIMEOUT:-200}" python3 benchmarks/bench_quant.py --out "$W" \
  --deadline $(( ${GRID_TIMEOUT:-200} - 20 )) --decode-only --mosaic --mosaic-set grid --no-triton --no-copy;; esac
cat "$W/summary.txt"
tar czf "$OUT/results.tgz" -C "$W" .
