"""How fast can a Mosaic GPU kernel stream a decode GEMV's weights with plain loads from global memory (no TMA)?

The decode GEMVs stream their weight tiles through a TMA pipeline, whose stream alone (no compute) took 20-23 us
for the 8B in_proj E4M3 weights (76 MB; benchmarks/notes/gemv.md): the floor of that design. This probe reads the
same bytes with vector loads straight into registers (one warpgroup per CTA, `rows` weight rows, `step` bytes of K
per load, the loop unrolled `unroll` times so several loads are in flight, K split over `split` CTAs for more of
them per SM) and folds them into a running XOR so nothing is dead; every config's result is checked against jnp
first. Beside it, in the same interleaved rounds: XLA's BF16 GEMV (M = 1), the Mosaic W8A16 GEMV (M = 1, the arm to beat) and an
XLA uint32 reduction of the same bytes. Wall times of queued calls carry ~10 us of per-call overhead at these sizes,
so each arm is also timed from a profiler trace (gpu_us).

    PYTHONPATH=. python3 benchmarks/probes/gmem_stream_probe.py --out $OUT --configs 64:256:2:1,64:256:2:4
writes OUT/gmem_stream.json (the date is in it).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks import timing
from pallas_kernels import mgpu_gemv_w4, mgpu_gemv_w8

SHAPES = {"in_proj_w8": (18560, 4096), "in_proj_w4": (18560, 2048), "out_proj_w8": (4096, 8192)}


def stream_xor(w, *, rows: int, step: int, unroll: int, split: int = 1, interpret: bool = False):
    """w [N, K] uint8 -> [N / rows, split, rows, step] uint8: per row block and K split, the XOR of its column tiles
    of `step` bytes, every byte read once by plain global loads (16 bytes per thread and load)."""
    N, K = w.shape
    k_iters = K // (step * split)
    layout = plgpu.Layout.WG_STRIDED((rows, step), vec_size=16)

    def kernel(w_ref, o_ref):
        n, sp = lax.axis_index("n"), lax.axis_index("s")
        k0 = sp * (k_iters * step)

        def body(i, acc):
            return acc ^ plgpu.load(w_ref.at[pl.ds(n * rows, rows), pl.ds(k0 + i * step, step)], layout=layout)

        acc = plgpu.layout_cast(jnp.zeros((rows, step), jnp.uint8), layout)
        o_ref[n, sp] = lax.fori_loop(0, k_iters, body, acc, unroll=unroll)

    f = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((N // rows, split, rows, step), jnp.uint8),
                     grid=(N // rows, split), grid_names=("n", "s"),
                     interpret=plgpu.InterpretGPUParams() if interpret else None)
    return f(w)


def stream_xor_reference(w, rows: int, step: int, split: int = 1):
    N, K = w.shape
    t = w.reshape(N // rows, rows, split, K // (step * split), step)
    return lax.reduce(t, jnp.uint8(0), lax.bitwise_xor, (3,)).transpose(0, 2, 1, 3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="64:256:2:1,64:256:2:4,64:512:2:4,128:256:2:4,64:256:4:8",
                    help="comma-separated rows:step_bytes:unroll[:split]")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    configs = [tuple(int(v) for v in c.split(":")) + (1,) * (4 - len(c.split(":"))) for c in args.configs.split(",")]
    result = {"date": datetime.date.today().isoformat(), "device": str(jax.devices()[0]),
              "versions": {"jax": jax.__version__}, "rounds": args.rounds, "rows": []}
    for shape, (N, K) in SHAPES.items():
        ws = [jax.random.randint(k, (N, K), 0, 256, jnp.int32).astype(jnp.uint8)
              for k in jax.random.split(jax.random.PRNGKey(0), 4)]
        arms = {"xla_u32_sum": (lambda w: jnp.sum(lax.bitcast_convert_type(w.reshape(N, K // 4, 4), jnp.uint32),
                                                  axis=1, dtype=jnp.uint32), [(w,) for w in ws])}
        if shape.endswith("w8"):
            xs = [jax.random.normal(k, (1, K), jnp.bfloat16) for k in jax.random.split(jax.random.PRNGKey(1), 4)]
            wb = [jax.random.normal(k, (N, K), jnp.bfloat16) for k in jax.random.split(jax.random.PRNGKey(2), 2)]
            arms["xla_bf16_gemv_m1"] = (lambda x, w: x @ w.T, [(xs[i], wb[i % 2]) for i in range(4)])
            sc = jnp.ones((N // 128, K // 128), jnp.float32)
            arms["w8a16_gemv_mosaic_m1"] = (lambda x, w: mgpu_gemv_w8.w8a16_gemv_mosaic(x, w, sc),
                                            [(xs[i], lax.bitcast_convert_type(ws[i], jnp.float8_e4m3fn))
                                             for i in range(4)])
        else:
            xs = [jax.random.normal(k, (1, 2 * K), jnp.bfloat16) for k in jax.random.split(jax.random.PRNGKey(1), 4)]
            s4 = jnp.ones((N, 2 * K // 16), jnp.float8_e4m3fn)
            arms["w4a16_gemv_mosaic_m1"] = (lambda x, p: mgpu_gemv_w4.w4a16_gemv_mosaic(x, p, s4, jnp.float32(1.0)),
                                            [(xs[i], ws[i]) for i in range(4)])
        checks = {}
        for rows, step, unroll, split in configs:
            name = f"rows{rows}:step{step}:unroll{unroll}:split{split}"
            if N % rows or K % (step * split) or (K // (step * split)) % unroll:
                print(f"{shape:12s} {name:24s} skipped: needs N % rows == 0 (N = {N}), K % (step * split) == 0 "
                      f"(K = {K}) and unroll dividing the {K // (step * split)} iterations", flush=True)
                result["rows"].append({"shape": shape, "config": name, "skipped": "does not tile this shape"})
                continue
            fn = functools.partial(stream_xor, rows=rows, step=step, unroll=unroll, split=split)
            ok = bool(jnp.array_equal(jax.jit(fn)(ws[0]), stream_xor_reference(ws[0], rows, step, split)))
            checks[name] = ok
            print(f"{shape:12s} {name:24s} check {ok}", flush=True)
            arms[name] = (fn, [(w,) for w in ws])
        many = timing.queued_arms(arms)                  # one compile per arm for the rounds and the trace
        walls = timing.interleaved_rounds(arms, args.rounds, many=many)
        for name, us in walls.items():
            traced = timing.traced_gpu_us(many[name], arms[name][1])
            nbytes = 2 * N * K if name == "xla_bf16_gemv_m1" else N * K       # bf16 weights: twice the bytes
            gpu = traced["gpu_us"]
            row = {"shape": shape, "N": N, "K": K, "config": name, "us_rounds": us, "us": min(us), **traced,
                   "bytes": nbytes, "TB_per_s": nbytes / min(us) / 1e6, "check": checks.get(name),
                   "gpu_TB_per_s": nbytes / gpu / 1e6 if gpu else None}
            result["rows"].append(row)
            print(f"{shape:12s} {name:30s} wall {min(us):6.1f} us  gpu {gpu or float('nan'):6.1f} us "
                  f"{row['gpu_TB_per_s'] or float('nan'):.2f} TB/s  rounds {[round(u, 1) for u in us]}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gmem_stream.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
