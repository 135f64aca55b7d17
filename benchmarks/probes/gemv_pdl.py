"""Does programmatic dependent launch (GemvConfig.pdl) shorten a decode chain of GEMVs? A jitted chain of `layers`
x (an XLA kernel writes each GEMV's x: a norm-like rescale of the previous output's first K columns) -> GEMV at
M rows, with the shapes of the 8B step (in_proj, out_proj, up_proj, down_proj in turn), timed with pdl off and on
in alternating rounds; the outputs must be bit-identical. Wall us per chain and per GEMV; JSON to --out.

    PYTHONPATH=. python3 benchmarks/probes/gemv_pdl.py [--kernel w8a16|w4a16] [--ms 1,16] [--layers 24] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.weights import quant_formats as qf
from pallas_kernels import mgpu_gemv_w4 as w4m
from pallas_kernels import mgpu_gemv_w8 as w8m

SHAPES = [(18560, 4096), (4096, 8192), (21504, 4096), (4096, 21504)]       # in, out, up, down (N, K)


def weights(kernel: str, rng, N: int, K: int):
    w = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
    q = qf.quantize_fp8_block(w) if kernel == "w8a16" else qf.quantize_nvfp4(w)
    return tuple(jnp.asarray(a) for a in q)


def gemv(kernel: str, N: int, K: int, pdl: bool):
    if kernel == "w8a16":
        cfg = dataclasses.replace(w8m.w8a16_gemv_blocks(N, K), pdl=pdl)
        return lambda x, *w: w8m.w8a16_gemv_mosaic(x, *w, config=cfg)
    cfg = dataclasses.replace(w4m.w4a16_gemv_blocks(N, K), pdl=pdl)
    return lambda x, *w: w4m.w4a16_gemv_mosaic(x, *w, config=cfg)


def chain_fn(kernel: str, layers: int, pdl: bool):
    fns = [gemv(kernel, N, K, pdl) for N, K in SHAPES]

    @jax.jit
    def chain(h, ws):
        for i in range(layers):
            j = i % len(SHAPES)
            K = SHAPES[j][1]
            src = jnp.tile(h, (1, -(-K // h.shape[1])))[:, :K].astype(jnp.float32)
            x = (src * jax.lax.rsqrt(jnp.mean(src * src, axis=1, keepdims=True) + 1e-5)).astype(jnp.bfloat16)
            h = fns[j](x, *ws[j])
        return h
    return chain


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", default="w8a16", choices=("w8a16", "w4a16"))
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    ws = [weights(args.kernel, rng, N, K) for N, K in SHAPES]
    chains = {pdl: chain_fn(args.kernel, args.layers, pdl) for pdl in (False, True)}
    rows = []
    for M in (int(m) for m in args.ms.split(",")):
        h0 = jnp.asarray(rng.standard_normal((M, 4096)), jnp.bfloat16)
        outs = {pdl: np.asarray(c(h0, ws)) for pdl, c in chains.items()}          # compile + check
        same = bool(np.array_equal(outs[True], outs[False]))
        times = {False: [], True: []}
        for _ in range(args.rounds):
            for pdl, c in chains.items():
                jax.block_until_ready(c(h0, ws))
                t = time.perf_counter()
                for _ in range(5):
                    out = c(h0, ws)
                jax.block_until_ready(out)
                times[pdl].append((time.perf_counter() - t) / 5 * 1e6)
        off, on = statistics.median(times[False]), statistics.median(times[True])
        rows.append(dict(M=M, us_chain_off=off, us_chain_on=on, us_per_gemv_saved=(off - on) / args.layers,
                         same_bits=same))
        print(f"M={M}: chain of {args.layers} {args.kernel}: {off:.1f} us without pdl, {on:.1f} us with "
              f"({(off - on) / args.layers:+.2f} us per GEMV saved), same bits: {same}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    doc = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), device=jax.devices()[0].device_kind,
               jax=jax.__version__, kernel=args.kernel, layers=args.layers, shapes=SHAPES, rows=rows,
               method="wall clock, 5 chains per sample, median of rounds alternating off/on")
    with open(os.path.join(args.out, f"gemv_pdl_{args.kernel}.json"), "w") as fh:
        json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
