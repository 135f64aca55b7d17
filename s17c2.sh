set -x
cd "$(dirname "$0")"
export PYTHONPATH=.
timeout 200 python3 tools/gemv_batch.py --out $OUT/a --kernels w4 --ms 1,4,16,64 --m-tiles "" --shapes in_proj --gpu-time --launch d/tc,d/xr,d/tc/xr,64/3/0/tc/xr,64/2/0/tc/xr > $OUT/a.log 2>&1
echo rc_a=$?
timeout 120 python3 tools/gemv_batch.py --out $OUT/b --kernels w4 --ms 1,4,16,64 --m-tiles "" --shapes out_proj --gpu-time --launch d/xr,64/2/0/xr,64/4/0/xr > $OUT/b.log 2>&1
echo rc_b=$?
METRALE_TEST_GPU=1 timeout 240 python3 -m pytest -q tests/kernels/test_mgpu_gemv.py -k "x_resident or split_k_cluster or w4a16_mosaic_8b" > $OUT/pytest.txt 2>&1
echo rc_p=$?
tail -5 $OUT/pytest.txt
