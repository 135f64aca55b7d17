"""Where the wall time of a prefill arm goes on the GPU: per-kernel durations and the idle gaps between
consecutive kernels in a perfetto trace, next to the wall time of the same queued calls (H200 probe).

    PYTHONPATH=. python3 benchmarks/probes/prefill_gaps.py --out $OUT [--shapes out_proj]
writes OUT/prefill_gaps.json."""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import tempfile

import jax
import jax.numpy as jnp

from benchmarks import timing
from benchmarks.bench_prefill import SHAPES, fp8_rows, xla_bf16
from metrale_jax.weights import quant_formats as qf
from pallas_kernels import mgpu_gemm
from pallas_kernels.mgpu_gemm import MgpuTiles

M = 4096


def kernel_events(trace_dir: str) -> list[tuple[float, float, str]]:
    """(start us, duration us, name) of every GPU kernel in the trace, in start order."""
    (f,) = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    with gzip.open(f, "rt") as fh:
        tr = json.load(fh)
    events = tr["traceEvents"] if isinstance(tr, dict) else tr
    names = {e["pid"]: str(e.get("args", {}).get("name", "")) for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {p for p, n in names.items() if "gpu" in n.lower()}
    ks = [(float(e["ts"]), float(e.get("dur", 0)), str(e.get("name", ""))[:60]) for e in events
          if e.get("ph") == "X" and e.get("pid") in gpu and "memcpy" not in str(e.get("name", "")).lower()]
    return sorted(ks)


def probe(fn, arg_sets, reps: int = 10) -> dict:
    many = timing.queued(fn, len(arg_sets))
    walls = timing.wall_us(many, arg_sets, reps=reps)
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d, create_perfetto_trace=True):
        jax.block_until_ready([many(arg_sets) for _ in range(3)])
    ks = kernel_events(d)
    calls = 3 * len(arg_sets)
    per_name: dict[str, float] = {}
    for _, dur, name in ks:
        per_name[name] = per_name.get(name, 0.0) + dur / calls
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(ks, ks[1:])]
    span = ks[-1][0] + ks[-1][1] - ks[0][0]
    return {"wall_us": min(walls), "kernels_us": {k: round(v, 2) for k, v in per_name.items()},
            "kernel_sum_us": sum(per_name.values()), "span_us_per_call": span / calls,
            "gaps_us": [round(g, 2) for g in gaps[:40]], "n_kernels": len(ks)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/gaps")
    ap.add_argument("--shapes", default="in_proj,out_proj")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    res = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
    key = jax.random.key(0)
    for shape in args.shapes.split(","):
        N, K = SHAPES[shape]
        kx, kw, key = jax.random.split(key, 3)
        xs = [jax.random.normal(k, (M, K), jnp.bfloat16) for k in jax.random.split(kx, 4)]
        w = jax.random.normal(kw, (N, K), jnp.float32)
        wb = [w.astype(jnp.bfloat16), (w * 1.01).astype(jnp.bfloat16)]
        wr = [fp8_rows(w), fp8_rows(w * 1.01)]
        del w
        pre = [qf.Fp8Activations(*qf.quantize_rows_fp8(x), jnp.dtype(jnp.bfloat16)) for x in xs]
        arms = {
            "xla_bf16": (xla_bf16, [(xs[i], wb[i % 2]) for i in range(4)]),
            "fp8_gemm_t (fused quant)": (lambda x, q, s: mgpu_gemm.fp8_gemm_t_mosaic(x, q, s),
                                         [(xs[i], *wr[i % 2]) for i in range(4)]),
            "fp8_gemm_t pre-quantized x": (lambda xa, q, s: mgpu_gemm.fp8_gemm_t_mosaic(xa, q, s),
                                           [(pre[i], *wr[i % 2]) for i in range(4)]),
            "quantize_rows_fused": (lambda x: mgpu_gemm.quantize_rows_fused(x), [(x,) for x in xs]),
        }
        for t in (MgpuTiles(64, 256, "m", stages=4), MgpuTiles(64, 256, "m", stages=3)):
            if N % t.cta[1] == 0:
                arms[f"fp8_gemm_t pre-quantized x, {t.tile_m}x{t.tile_n} st{t.stages}"] = (
                    lambda xa, q, s, t=t: mgpu_gemm.fp8_gemm_t_mosaic(xa, q, s, tiles=t),
                    [(pre[i], *wr[i % 2]) for i in range(4)])
        for name, (fn, sets) in arms.items():
            try:
                r = probe(fn, sets)
            except Exception as e:  # noqa: BLE001
                res[f"{shape} {name}"] = {"error": repr(e)[:1500]}
                print(shape, name, "FAILED", repr(e)[:1500], flush=True)
                continue
            res[f"{shape} {name}"] = r
            print(shape, name, {k: v for k, v in r.items() if k != "gaps_us"}, "gaps", r["gaps_us"][:10], flush=True)
        with open(os.path.join(args.out, "prefill_gaps.json"), "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
