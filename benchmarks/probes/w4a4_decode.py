"""W4A4 decode on the H200: the Triton and Mosaic arms of `w4a4_gemm` (decode=True) at the Nemotron-H-8B projection
shapes, M = 1 / 16 / 256, wall us per call (4 distinct x queued, best of 3 trials); and a check of the activation
pass on the GPU, eager against jitted (an earlier run saw both jitted arms 7% away from the eagerly evaluated reference
at the 8B shapes while agreeing with each other to 3e-8; the E4M3 rounding of the group scales was a convert round
trip, which XLA GPU may fold away in jitted code; it is `round_e4m3` now, and this check should find no
difference).

    PYTHONPATH=. python3 benchmarks/probes/w4a4_decode.py --out $OUT
writes OUT/w4a4_decode.json."""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from benchmarks.bench_prefill import SHAPES
from pallas_kernels import w4a4
from tests.numpy_refs import rel_err
from benchmarks.probes.gemv_batch import nvfp4_rows


def activation_check(x) -> dict:
    """Eager vs jitted `quantize_activations_nvfp4` on this backend: how many elements differ, and the first."""
    eager = np.asarray(w4a4.quantize_activations_nvfp4(x), np.float32)
    jitted = np.asarray(jax.jit(w4a4.quantize_activations_nvfp4)(x), np.float32)
    diff = np.argwhere(eager != jitted)
    out = {"elements": int(eager.size), "differ": int(len(diff))}
    if len(diff):
        i, j = diff[0]
        out["first"] = {"row": int(i), "col": int(j), "x": float(np.asarray(x, np.float32)[i, j]),
                        "eager": float(eager[i, j]), "jit": float(jitted[i, j])}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/w4a4_decode")
    ap.add_argument("--ms", default="1,16,256")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    res = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "rows": [], "activations": {}}
    for shape, (N, K) in SHAPES.items():
        p, s, g = nvfp4_rows(jax.random.key(1), N, K)
        for M in map(int, args.ms.split(",")):
            xs = [jax.random.normal(k, (M, K), jnp.bfloat16) for k in jax.random.split(jax.random.key(M), 4)]
            res["activations"][f"{shape} M={M}"] = activation_check(xs[0])
            ref = jax.jit(lambda x: w4a4.w4a4_reference(x, p, s, g, out_dtype=jnp.float32))(xs[0])
            for arm, fn in (("triton", w4a4.w4a4_gemm_pallas), ("mosaic", w4a4.w4a4_gemm_mosaic)):
                f = lambda x, fn=fn, **kw: fn(x, p, s, g, decode=True, **kw)
                row = {"shape": shape, "M": M, "arm": arm,
                       "rel_err_vs_jitted_reference": rel_err(jax.jit(lambda x: f(x, out_dtype=jnp.float32))(xs[0]),
                                                              ref),
                       "us": min(timing.queued_wall_us(f, [(x,) for x in xs], reps=10))}
                res["rows"].append(row)
                print(row, flush=True)
        print(shape, res["activations"], flush=True)
    with open(os.path.join(args.out, "w4a4_decode.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
