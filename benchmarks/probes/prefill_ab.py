"""A/B of fp8_gemm_t tile configs in interleaved rounds (H200): every config and XLA BF16 timed once per round,
round after round, so a drift of the GPU's clocks between runs hits all of them alike. Each arm quantizes its
bf16 x (the fused quantizer), as the layer's call does.

    PYTHONPATH=. python3 benchmarks/probes/prefill_ab.py --out $OUT [--rounds 5] [--shapes in_proj,out_proj]
writes OUT/prefill_ab.json (the date; per arm: the wall us of every round, min, median, median ratio vs XLA BF16)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks import timing
from benchmarks.bench_prefill import SHAPES, fp8_blocks, fp8_rows, rel_err, short, xla_bf16
from pallas_kernels import fp8_gemm, mgpu_gemm, w8a16
from pallas_kernels.mgpu_gemm import MgpuTiles

M = 4096
CANDIDATES = [MgpuTiles(128, 128, "m", stages=4), MgpuTiles(64, 256, "m", stages=3),
              MgpuTiles(64, 256, "m", stages=4, epi_bytes=64)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/ab")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", default="in_proj,out_proj")
    ap.add_argument("--blocks", action="store_true", help="also the block-scaled arm (w8a16_gemm_pipelined) default")
    ap.add_argument("--no-candidates", action="store_true", help="the default tiles only")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    res = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": str(jax.devices()[0].device_kind),
           "jax": jax.__version__, "M": M, "rounds": args.rounds,
           "method": __doc__.split("\n\n")[0], "shapes": {}}
    key = jax.random.key(0)
    for shape in args.shapes.split(","):
        N, K = SHAPES[shape]
        kx, kw, key = jax.random.split(key, 3)
        xs = [jax.random.normal(k, (M, K), jnp.bfloat16) for k in jax.random.split(kx, 4)]
        w = jax.random.normal(kw, (N, K), jnp.float32) * jax.random.uniform(kw, (N, 1), minval=0.1, maxval=3.0)
        wb = [w.astype(jnp.bfloat16), (w * 1.01).astype(jnp.bfloat16)]
        wr = [fp8_rows(w), fp8_rows(w * 1.01)]
        del w
        ref = fp8_gemm.fp8_gemm_t_reference(xs[0], *wr[0], out_dtype=jnp.float32)
        arms = {"xla_bf16": (xla_bf16, [(xs[i], wb[i % 2]) for i in range(4)])}
        d = mgpu_gemm.default_tiles(N, K, per_block=False)
        cands = [] if args.no_candidates else [c for c in CANDIDATES if c != d and N % c.cta[1] == 0]
        for t in [None] + cands:
            name = "default " + short(d) if t is None else short(t)
            fn = lambda x, q, s, t=t, **kw: mgpu_gemm.fp8_gemm_t_mosaic(x, q, s, tiles=t, **kw)
            err = rel_err(jax.jit(lambda *a, fn=fn: fn(*a, out_dtype=jnp.float32))(xs[0], *wr[0]), ref)
            if not err < 5e-3:
                raise AssertionError(f"{shape} {name}: rel err {err} against the reference")
            arms[name] = (fn, [(xs[i], *wr[i % 2]) for i in range(4)])
        if args.blocks:
            wq = [fp8_blocks(wb[0].astype(jnp.float32)), fp8_blocks(wb[1].astype(jnp.float32))]
            fn = mgpu_gemm.w8a16_gemm_pipelined_mosaic
            err = rel_err(jax.jit(lambda *a: fn(*a, out_dtype=jnp.float32))(xs[0], *wq[0]),
                          w8a16.w8a16_pipelined_reference(xs[0], *wq[0], out_dtype=jnp.float32))
            if not err < 5e-3:
                raise AssertionError(f"{shape} w8a16_gemm_pipelined: rel err {err} against the reference")
            arms["w8a16_gemm_pipelined default"] = (fn, [(xs[i], *wq[i % 2]) for i in range(4)])
        progress = lambda r, w: print(f"{time.time():.1f}", shape, "round", r,
                                      {n: round(v[-1], 1) for n, v in w.items()}, flush=True)
        walls = timing.interleaved_rounds(arms, args.rounds, trials=1, on_round=progress)
        base = statistics.median(walls["xla_bf16"])
        res["shapes"][shape] = {n: {"wall_us": [round(v, 2) for v in ws], "min_us": min(ws),
                                    "median_us": statistics.median(ws),
                                    "ratio_vs_xla_bf16_median": base / statistics.median(ws)}
                                for n, ws in walls.items()}
        for n, v in res["shapes"][shape].items():
            print(f"{shape:8s} {n:60s} median {v['median_us']:7.1f} us  min {v['min_us']:7.1f}  "
                  f"x{v['ratio_vs_xla_bf16_median']:.3f}", flush=True)
        with open(os.path.join(args.out, "prefill_ab.json"), "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
