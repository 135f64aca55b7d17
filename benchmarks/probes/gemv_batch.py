"""Decode GEMVs at large batch (H200): the Mosaic arms of w8a16_gemv, w8a8_gemv and w4a16_gemv (NVFP4) with several 16-row
x tiles per CTA (auto m_tiles, the default) against one CTA per 16 rows (m_tiles=1) and XLA BF16, at the
Nemotron-H-8B projection shapes, M = 1 .. 256. Each arm checked against the reference first; wall us per call
(4 distinct argument sets queued in one executable, best of 3 trials).

    PYTHONPATH=. python3 benchmarks/probes/gemv_batch.py --out $OUT [--kernels w8,w4] [--ms 1,16,64,256] [--m-tiles 1,2]
        [--launch 128/4/2,64/2/0/8,64/4/2/p] [--shapes in_proj,n16896=16896x4096] [--gpu-time]
writes OUT/gemv_batch.json."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from benchmarks.bench_prefill import SHAPES, fp8_blocks, nvfp4_weights, rel_err, xla_bf16
from pallas_kernels import mgpu_gemv as mg
from pallas_kernels import mgpu_gemv_w4, mgpu_gemv_w8
from pallas_kernels import w4a16, w8a16


def nvfp4_rows(key, N, K):
    """bench_prefill's random NVFP4 weights in the GEMV layout: packed [N, K/2], scale E4M3 [N, K/16], global."""
    pt, st, g = nvfp4_weights(key, N, K)
    return pt.T, st.T, g


SUFFIXES = {"x16": {"small_m": False}, "k1": {"k_blocks": 1}, "k2": {"k_blocks": 2}, "k4": {"k_blocks": 4},
            "tx": {"reduce": "xla"}, "tc": {"reduce": "cluster"},
            **{f"t{n}": {"tail_split": n} for n in (0, 2, 4, 8, 16)}}   # launch-spec suffixes
KERNELS = {"w8": (mgpu_gemv_w8.w8a16_gemv_mosaic, mgpu_gemv_w8.w8a16_gemv_blocks, w8a16.w8a16_reference),
           "w8a8": (mgpu_gemv_w8.w8a8_gemv_mosaic, mgpu_gemv_w8.w8a16_gemv_blocks, w8a16.w8a8_gemv_reference),
           "w4": (mgpu_gemv_w4.w4a16_gemv_mosaic, mgpu_gemv_w4.w4a16_gemv_blocks, w4a16.w4a16_reference)}


GEMV_NAMES = {"w8": "w8a16_gemv", "w8a8": "w8a8_gemv", "w4": "w4a16_gemv"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/gemv_batch")
    ap.add_argument("--kernels", default="w8", help="comma-separated: w8 (w8a16_gemv), w8a8 (w8a8_gemv: x quantized "
                    "in the call), w4 (w4a16_gemv)")
    ap.add_argument("--ms", default="1,16,64,256")
    ap.add_argument("--m-tiles", default="1", type=lambda v: [int(t) for t in v.split(",") if t],
                    help="fixed m_tiles configs timed beside the auto one")
    ap.add_argument("--launch", default="", help="extra launches beside the default, block_n/stages/split_k"
                    "[/m_tiles][/x16][/k2] or d[/...] (the default launch) comma-separated (e.g."
                    " 128/4/2,64/2/0/8,d/x16;"
                    " split 0 = the default launch's split; x16: 16-row x tiles at M <= 8 too; k1 / k2 / k4: K"
                    " blocks per pipeline step; t0 .. t16: w8 tail_split; tx / tc: split partials added by XLA / in"
                    " a cluster)")
    ap.add_argument("--shapes", default="in_proj,out_proj", help="names of bench_prefill.SHAPES or NAME=NxK")
    ap.add_argument("--gpu-time", action="store_true", help="also GPU kernel us per call from a profiler trace")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    res = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "method": __doc__.split("\n\n")[0],
           "rows": []}
    key = jax.random.key(0)
    shapes = {}
    for spec in args.shapes.split(","):
        name, _, nk = spec.partition("=")
        shapes[name] = tuple(map(int, nk.split("x"))) if nk else SHAPES[name]
    for (shape, (N, K)), kern in itertools.product(shapes.items(), args.kernels.split(",")):
        gemv, blocks, reference = KERNELS[kern]
        kx, kw, key = jax.random.split(key, 3)
        w = jax.random.normal(kw, (N, K), jnp.float32) * jax.random.uniform(kw, (N, 1), minval=0.1, maxval=3.0)
        wb = [w.astype(jnp.bfloat16), (w * 1.01).astype(jnp.bfloat16)]
        wq = [fp8_blocks(w), fp8_blocks(w * 1.01)] if kern in ("w8", "w8a8") else [nvfp4_rows(k, N, K) for k in
                                                                         jax.random.split(kw)]
        del w
        for M in map(int, args.ms.split(",")):
            base = blocks(N, K, M) if kern == "w4" else blocks(N, K)
            xs = [jax.random.normal(k, (M, K), jnp.bfloat16) for k in jax.random.split(jax.random.fold_in(kx, M), 4)]
            ref = reference(xs[0], *wq[0], out_dtype=jnp.float32)
            first = kern == args.kernels.split(",")[0]            # XLA BF16 once per shape and M
            arms = {"xla_bf16": (xla_bf16, [(xs[i], wb[i % 2]) for i in range(4)], None)} if first else {}
            extra = [(f"mosaic m_tiles={t}", dataclasses.replace(base, m_tiles=t)) for t in args.m_tiles]
            for spec in filter(None, args.launch.split(",")):
                toks, cfg = spec.split("/"), base
                while toks[-1] in SUFFIXES:
                    cfg = dataclasses.replace(cfg, **SUFFIXES[toks.pop()])
                if toks != ["d"]:
                    bn, st, sk, *mt = map(int, toks)
                    cfg = dataclasses.replace(cfg, block_n=bn, stages=st, split_k=sk or base.split_k,
                                              m_tiles=mt[0] if mt else base.m_tiles)
                extra.append((f"mosaic {spec}", cfg))
            for name, cfg in [("mosaic auto m_tiles", base)] + extra:
                fn = lambda *a, cfg=cfg, gemv=gemv, **kw: gemv(*a, config=cfg, **kw)
                arms[name] = (fn, [(xs[i], *wq[i % 2]) for i in range(4)], cfg)
            for name, (fn, sets, cfg) in arms.items():
                row = {"shape": shape, "kernel": kern, "N": N, "K": K, "M": M, "arm": name}
                try:
                    if cfg is not None:
                        row["rel_err"] = rel_err(jax.jit(lambda *a, fn=fn: fn(*a, out_dtype=jnp.float32))(*sets[0]),
                                                 ref)
                        launched = mg.resolve_k_blocks(cfg, M)
                        row["m_tiles"], row["stages"] = mg.launch_tiles(GEMV_NAMES[kern], M, N, K, launched,
                                                                        jnp.bfloat16)
                        row["k_blocks"] = launched.k_blocks
                        y = np.asarray(jax.jit(lambda *a, fn=fn: fn(*a, out_dtype=jnp.float32))(*sets[1]))
                        if cfg is base:
                            y_base = y
                        row["same_bits_as_default"] = bool(np.array_equal(y, y_base))
                    many = timing.queued(fn, len(sets))         # one compile for the wall time and the trace
                    walls = timing.wall_us(many, sets, reps=10)
                    row.update(us=min(walls), us_all=walls)
                    if args.gpu_time:
                        row.update(timing.traced_gpu_us(many, sets))
                except Exception as e:  # noqa: BLE001
                    row["error"] = repr(e)[:1500]
                res["rows"].append(row)
                keep = ("us", "gpu_us", "rel_err", "same_bits_as_default", "m_tiles", "stages", "k_blocks", "error")
                print(shape, kern, M, name, {k: v for k, v in row.items() if k in keep}, flush=True)
            with open(os.path.join(args.out, "gemv_batch.json"), "w") as fh:
                json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
