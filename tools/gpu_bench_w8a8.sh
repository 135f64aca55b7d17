#!/usr/bin/env bash
# Device calls for the FP8 decode on the FP8 matrix units (w8a8_gemv, ModelLevers.fp8_decode_activations "e4m3"),
# each under the 600 s of one call. Everything goes to $OUT.
#   tools/gpu_bench_w8a8.sh kernels   its GPU tests, the GEMV probe (w8a16_gemv / w8a8_gemv / XLA BF16 at the four
#                                     8B projection shapes, M = 1 .. 256) and decode attention alone
#   tools/gpu_bench_w8a8.sh one       one call: the GPU tests, the probe at M = 1 / 64 / 256, e4m3 e2e rows at B = 256
#   tools/gpu_bench_w8a8.sh short     the GPU tests and the probe at M = 1 / 256 (about 5 minutes)
#   tools/gpu_bench_w8a8.sh e2e [BATCHES (1,64,256)] [STATES (float32)]
#                                     end-to-end block-FP8 rows, the default decode and then the e4m3 one, same call
set -o pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$OUT/env.txt"
case "${1:-kernels}" in
kernels)
  METRALE_TEST_GPU=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_mgpu_gemv_w8a8.py \
    2>&1 | tail -15 | tee "$OUT/tests.log"
  timeout 240 python3 benchmarks/probes/gemv_batch.py --out "$OUT" --kernels w8,w8a8 --ms 1,16,64,256 --m-tiles "" \
    --shapes in_proj,out_proj,up_proj=21504x4096,down_proj=4096x21504 --gpu-time > "$OUT/gemv.log" 2>&1
  echo "gemv exit: $?" | tee -a "$OUT/gemv.log"
  grep -E "^(in|out|up|down)_proj" "$OUT/gemv.log" | sed -E 's/, .us_all.*//' | cut -c1-220
  timeout 120 python3 benchmarks/bench_decode_attention.py --out "$OUT/decode_attention.json" > "$OUT/da.log" 2>&1
  echo "decode_attention exit: $?" | tee -a "$OUT/da.log"
  tail -25 "$OUT/da.log"
  ;;
one)        # one call for all: GPU tests, the probe at M = 1 / 64 / 256, the e4m3 e2e rows at B = 256
  METRALE_TEST_GPU=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_mgpu_gemv_w8a8.py \
    2>&1 | tail -15 | tee "$OUT/tests.log"
  timeout 180 python3 benchmarks/probes/gemv_batch.py --out "$OUT" --kernels w8,w8a8 --ms 1,64,256 --m-tiles "" \
    --shapes in_proj,out_proj,up_proj=21504x4096,down_proj=4096x21504 --gpu-time > "$OUT/gemv.log" 2>&1
  echo "gemv exit: $?" | tee -a "$OUT/gemv.log"
  grep -E "^(in|out|up|down)_proj" "$OUT/gemv.log" | sed -E 's/, .us_all.*//' | cut -c1-220
  timeout 230 python3 benchmarks/bench_e2e_decode.py --weights fp8-block --states float32,bfloat16 --batches 256 \
    --fp8-decode-activations e4m3 --out "$OUT/e2e_decode_fp8-decode-e4m3.json" > "$OUT/e2e_e4m3.log" 2>&1
  echo "e2e e4m3 exit: $?" | tee -a "$OUT/e2e_e4m3.log"
  grep -E "B=|rror" "$OUT/e2e_e4m3.log"
  ;;
short)      # what a few minutes allow: the GPU tests, the probe at M = 1 / 256
  METRALE_TEST_GPU=1 timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_mgpu_gemv_w8a8.py \
    2>&1 | tail -15 | tee "$OUT/tests.log"
  timeout 150 python3 benchmarks/probes/gemv_batch.py --out "$OUT" --kernels w8,w8a8 --ms 1,256 --m-tiles "" \
    --shapes in_proj,out_proj,down_proj=4096x21504 --gpu-time > "$OUT/gemv.log" 2>&1
  echo "gemv exit: $?" | tee -a "$OUT/gemv.log"
  grep -E "^(in|out|up|down)_proj" "$OUT/gemv.log" | sed -E 's/, .us_all.*//' | cut -c1-220
  ;;
e2e)
  BATCHES=${2:-1,64,256}
  STATES=${3:-float32}
  cp benchmarks/results/e2e_decode.json "$OUT/e2e_decode.json"
  timeout 270 python3 benchmarks/bench_e2e_decode.py --weights fp8-block --states "$STATES" --batches "$BATCHES" \
    --update --out "$OUT/e2e_decode.json" > "$OUT/e2e.log" 2>&1
  echo "e2e exit: $?" | tee -a "$OUT/e2e.log"
  timeout 270 python3 benchmarks/bench_e2e_decode.py --weights fp8-block --states "$STATES" --batches "$BATCHES" \
    --fp8-decode-activations e4m3 --out "$OUT/e2e_decode_fp8-decode-e4m3.json" > "$OUT/e2e_e4m3.log" 2>&1
  echo "e2e e4m3 exit: $?" | tee -a "$OUT/e2e_e4m3.log"
  grep -E "B=|rror" "$OUT/e2e.log" "$OUT/e2e_e4m3.log"
  ;;
esac
