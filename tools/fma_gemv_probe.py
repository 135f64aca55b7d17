"""Probe (H200): can a W8A16 decode GEMV without matrix units stream the E4M3 weights near the copy rate?

Two FMA forms of y = x @ (w * scale)^T at small M, beside the Mosaic default (wgmma) and XLA's u32 sum of the
same bytes (the stream floor measured in session 13):
  triton   Pallas (Triton backend): a [bn, bk] E4M3 tile widened to f32 and multiplied by x pre-scaled by the
           step's block scale, accumulated elementwise in registers per row of x, reduced over K once at the end;
           Triton pipelines the tile loads (cp.async, `num_stages`).
  xla      XLA's own fusion of widen * scale * x + reduce (one row-reduction kernel).
GPU kernel us per call from a profiler trace (4 distinct argument sets queued), rel err to the reference.

    PYTHONPATH=. python3 tools/fma_gemv_probe.py --out $OUT/fma [--ms 1,4] [--configs 32:256:4:4:1,...]
writes OUT/fma_gemv.json; config = bn:bk:num_warps:num_stages:split."""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from benchmarks import timing
from benchmarks.bench_prefill import SHAPES, fp8_blocks, rel_err
from metrale_jax.weights.quant_formats import FP8_BLOCK
from pallas_kernels import mgpu_gemv as mg
from pallas_kernels import w8a16
from pallas_kernels.triton_util import compiler_params

DEFAULT_CONFIGS = ("16:256:4:4:1,32:256:4:4:1,64:128:4:4:1,32:512:8:3:1,16:512:4:3:1,32:256:4:6:1,"
                   "32:256:8:4:1,64:256:8:4:1,16:256:4:4:2,32:128:4:8:1")


def fma_gemv(x, w, scale, *, bn: int, bk: int, num_warps: int, num_stages: int, split: int = 1,
             interpret: bool = False):
    """x bf16 [M, K], w E4M3 [N, K], scale f32 [N/128, K/128] -> f32 [M, N]; FMA units only."""
    M, K = x.shape
    N = w.shape[0]
    assert N % bn == 0 and FP8_BLOCK % bn == 0 and K % (bk * split) == 0, (N, K, bn, bk, split)
    k_split = K // split

    def kernel(x_ref, w_ref, s_ref, o_ref):
        n0 = pl.program_id(0) * bn
        k_first = pl.program_id(1) * k_split
        s_row = n0 // FP8_BLOCK

        def body(i, accs):
            k0 = k_first + i * bk
            wt = w_ref[pl.ds(n0, bn), pl.ds(k0, bk)].astype(jnp.float32)              # [bn, bk]
            if bk <= FP8_BLOCK:
                s = s_ref[s_row, k0 // FP8_BLOCK]
            else:
                s = plgpu.load(s_ref.at[s_row, (k0 + jnp.arange(bk)) // FP8_BLOCK])   # [bk]
            return tuple(acc + wt * (x_ref[m, pl.ds(k0, bk)].astype(jnp.float32) * s)[None, :]
                         for m, acc in enumerate(accs))

        accs = lax.fori_loop(0, k_split // bk, body, tuple(jnp.zeros((bn, bk), jnp.float32) for _ in range(M)))
        for m, acc in enumerate(accs):
            o_ref[pl.program_id(1), m, pl.ds(n0, bn)] = jnp.sum(acc, axis=1)

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((split, M, N), jnp.float32),
                         grid=(N // bn, split), compiler_params=compiler_params(num_warps, num_stages),
                         interpret=interpret, name="fma_gemv_probe")(x, w, scale)
    return w8a16.finish_split(out, split, M, jnp.float32)


def xla_fma_gemv(x, w, scale):
    """XLA's fusion of the same math: widen, scale, multiply by x, reduce over K."""
    M, K = x.shape
    N = w.shape[0]
    wq = w.astype(jnp.float32).reshape(1, N // FP8_BLOCK, FP8_BLOCK, K // FP8_BLOCK, FP8_BLOCK)
    xs = x.astype(jnp.float32).reshape(M, 1, 1, K // FP8_BLOCK, FP8_BLOCK) * scale[None, :, None, :, None]
    return jnp.sum(wq * xs, axis=(3, 4)).reshape(M, N)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/fma_gemv")
    ap.add_argument("--ms", default="1,4")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    res = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "method": __doc__.split("\n\n")[0],
           "rows": []}
    key = jax.random.key(0)
    for shape, (N, K) in SHAPES.items():
        kx, kw, key = jax.random.split(key, 3)
        w = jax.random.normal(kw, (N, K), jnp.float32) * jax.random.uniform(kw, (N, 1), minval=0.1, maxval=3.0)
        wq = [fp8_blocks(w), fp8_blocks(w * 1.01)]
        del w
        u32 = lambda q, s: jnp.sum(lax.bitcast_convert_type(q.reshape(N, K // 4, 4), jnp.uint32), axis=1)
        for M in map(int, args.ms.split(",")):
            xs = [jax.random.normal(k, (M, K), jnp.bfloat16) for k in jax.random.split(jax.random.fold_in(kx, M), 4)]
            sets = [(xs[i], *wq[i % 2]) for i in range(4)]
            ref = w8a16.w8a16_reference(*sets[0], out_dtype=jnp.float32)
            arms = {"xla_u32_sum": (lambda x, q, s: u32(q, s), False),
                    "mosaic_default": (functools.partial(mg.w8a16_gemv_mosaic, out_dtype=jnp.float32), True),
                    "xla_fma": (xla_fma_gemv, True)}
            for spec in filter(None, args.configs.split(",")):
                bn, bk, nw, ns, sp = map(int, spec.split(":"))
                arms[f"triton {spec}"] = (functools.partial(fma_gemv, bn=bn, bk=bk, num_warps=nw, num_stages=ns,
                                                            split=sp), True)
            for name, (fn, check) in arms.items():
                row = {"shape": shape, "N": N, "K": K, "M": M, "arm": name, "weight_bytes": N * K}
                try:
                    if check:
                        row["rel_err"] = rel_err(jax.jit(fn)(*sets[0]), ref)
                    many = timing.queued(fn, len(sets))
                    row["us"] = min(timing.wall_us(many, sets, reps=10))
                    row.update(timing.traced_gpu_us(many, sets))
                    if row.get("gpu_us"):
                        row["weight_TBps"] = N * K / row["gpu_us"] / 1e6
                except Exception as e:  # noqa: BLE001
                    row["error"] = repr(e)[:1500]
                res["rows"].append(row)
                keep = ("us", "gpu_us", "weight_TBps", "rel_err", "error")
                print(shape, M, name, {k: v for k, v in row.items() if k in keep}, flush=True)
            with open(os.path.join(args.out, "fma_gemv.json"), "w") as fh:
                json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
