"""Quantized projection kernels on the GPU: correctness at the real shapes, then time against baselines
measured in the same run (device copy bandwidth, XLA BF16 matmul, optionally cuBLAS through torch).

Shapes: Nemotron-H 8B in_proj N=18560, K=4096 and out_proj N=4096, K=8192; decode M = 1, 4, 16 and
prefill M = 4096. Weight sets are rotated (4 copies for GEMVs) so repeated calls do not run from L2.
Times: wall clock over many calls queued inside one jitted executable (dispatch amortized), and, where
the profiler works, the summed GPU kernel time per call from a perfetto trace.

    PYTHONPATH=. python benchmarks/bench_quant.py --out DIR [--deadline SECONDS] [--sweep]
writes DIR/quant.json and DIR/quant.md (the date is in them; --interpret, the CPU dry run: quant_interpret.*).
    ... --decode-only --mosaic [--mosaic-sweep] [--mosaic-set grid]
times the decode GEMVs only: Mosaic GPU arm vs Triton arm vs XLA BF16 vs the copy ceiling (files
quant_decode.*, with --mosaic-set grid quant_decode_grid.*), after checking every Mosaic config it times against
the reference at the real shapes, with batch invariance (M=1 and M=4 rows bit-identical to the same rows of
M=16), and prints a short summary table last (gpu us per call with XLA's helper kernels, and the largest kernel
alone).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from metrale_jax.weights import quant_formats as qf
from pallas_kernels import fp8_gemm, mgpu_gemv_w4, mgpu_gemv_w8, w4a4, w4a16, w8a16
from pallas_kernels.mgpu_gemv import GemvConfig
from pallas_kernels.w4a16 import W4Blocks
from pallas_kernels.w8a16 import QuantBlocks

SHAPES = {"in_proj": (18560, 4096), "out_proj": (4096, 8192)}
SHAPES_ORDER = ("in_proj", "out_proj")
DECODE_M = (1, 4, 16)
PREFILL_M = 4096
T0 = time.time()
I = False           # --interpret: run the kernels in interpret mode (a CPU dry run of this script)
MOSAIC_SET = "defaults"


class Deadline(Exception):
    pass


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def rel_err(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


# ---- timing -----------------------------------------------------------------------------------------------
def time_calls(fn, arg_sets, *, per_exec: int, reps: int, profile: bool = True) -> dict:
    """Median-free simple timing: `per_exec` calls of fn inside one executable (cycling arg_sets), the
    executable run `reps` times back to back; returns us per call (wall) and GPU us per call (trace)."""
    arg_sets = [arg_sets[i % len(arg_sets)] for i in range(per_exec)]   # per_exec <= len: all distinct
    return timing.wall_and_traced_us(fn, arg_sets, reps=reps, trace=profile)


# ---- inputs -----------------------------------------------------------------------------------------------
def make_weights(N, K, copies, rng):
    """`copies` weight sets per format in distinct device buffers (quantized once, then copied: L2 sees
    different addresses, which is all that matters for keeping repeated calls out of the cache)."""
    w = rng.standard_normal((N, K), np.float32) * 0.02
    q, s = qf.quantize_fp8_block(w)
    qr, sr = qf.quantize_fp8_rows(w)
    p, s4, g = qf.quantize_nvfp4(w)
    one = {"bf16": (jnp.asarray(w, jnp.bfloat16),), "fp8": (jnp.asarray(q), jnp.asarray(s)),
           "fp8_rows": (jnp.asarray(qr), jnp.asarray(sr)), "nvfp4": (jnp.asarray(p), jnp.asarray(s4), jnp.asarray(g)),
           "nvfp4_t": (jnp.asarray(np.ascontiguousarray(p.T)), jnp.asarray(np.ascontiguousarray(s4.T)),
                       jnp.asarray(g))}
    sets = {k: [v] + [tuple(jnp.array(a, copy=True) for a in v) for _ in range(copies - 1)] for k, v in one.items()}
    sets["bf16"] = [v[0] for v in sets["bf16"]]
    sets["dense_f32"] = w
    return sets


def weight_bytes(fmt, N, K):
    return {"bf16": 2 * N * K, "fp8": N * K + 4 * ((N + 127) // 128) * ((K + 127) // 128),
            "fp8_rows": N * K + 4 * N, "nvfp4": N * K // 2 + N * K // 16 + 4}[fmt]


# ---- the run ----------------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds after which remaining items are skipped")
    ap.add_argument("--sweep", action="store_true", help="also time alternative tile configs")
    ap.add_argument("--torch", action="store_true", help="also time cuBLAS BF16 / FP8 through torch (context)")
    ap.add_argument("--shapes", default="in_proj,out_proj")
    ap.add_argument("--interpret", action="store_true", help="CPU dry run at tiny shapes")
    ap.add_argument("--decode-only", action="store_true", help="decode GEMVs only (no prefill GEMMs)")
    ap.add_argument("--mosaic", action="store_true", help="also check and time the Mosaic GPU GEMV arms")
    ap.add_argument("--mosaic-sweep", action="store_true", help="time alternative Mosaic GEMV configs (M=1, 16)")
    ap.add_argument("--mosaic-set", default="defaults", choices=("defaults", "grid"),
                    help="Mosaic GEMV configs checked and timed at M = 1, 16, 4: the registry defaults or the "
                         "launch-shape grid of both GEMVs (GEMV_GRID: CTAs per SM, split-K)")
    ap.add_argument("--no-copy", action="store_true", help="skip the copy-bandwidth measurement (use an earlier run's)")
    ap.add_argument("--no-triton", action="store_true",
                    help="skip the Triton decode GEMV timings (use an earlier run's)")
    args = ap.parse_args()
    global I, PREFILL_M, MOSAIC_SET
    MOSAIC_SET = args.mosaic_set
    if args.interpret:
        I, PREFILL_M = True, 64
        SHAPES.update(in_proj=(320, 256), out_proj=(256, 512))
    os.makedirs(args.out, exist_ok=True)
    date = datetime.date.today().isoformat()
    dev = jax.devices()[0]
    result = {"date": date, "device": str(getattr(dev, "device_kind", dev)), "platform": jax.default_backend(),
              "versions": {"jax": jax.__version__, "jaxlib": jax.lib.__version__ if hasattr(jax, "lib") else None,
                           "python": platform.python_version(), "numpy": np.__version__},
              "items": [], "errors": [], "checks": []}
    try:
        import triton
        result["versions"]["triton(torch's)"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    # one name per arm set: prefill and decode, decode only, the Mosaic GEMV launch grid; the dry run apart
    stem = "_".join(["quant"] + ["decode"] * args.decode_only + ["grid"] * (args.mosaic_set == "grid")
                    + ["interpret"] * args.interpret)
    path_json = os.path.join(args.out, f"{stem}.json")

    def save():
        with open(path_json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)

    def check_time():
        if time.time() - T0 > args.deadline:
            raise Deadline()

    def record(item):
        result["items"].append(item)
        log(json.dumps({k: v for k, v in item.items() if k not in ("timing",)}, default=str))
        save()

    def bench(kind, shape, M, name, fn, arg_sets, fmt, N, K, *, config=None, per_exec=4, reps=20, baseline=None,
              extra_bytes=0):
        check_time()
        try:
            t = time_calls(fn, arg_sets, per_exec=per_exec, reps=reps, profile=kind != "sweep")
        except Deadline:
            raise
        except Exception as e:  # noqa: BLE001
            result["errors"].append({"kernel": name, "shape": shape, "M": M, "config": config,
                                     "error": repr(e)[:2000], "trace": traceback.format_exc()[-3000:]})
            log("ERROR", name, shape, M, config, repr(e)[:300])
            save()
            return None
        us = t["us"]
        wb = weight_bytes(fmt, N, K)
        io = wb + 2 * M * K + 2 * M * N + extra_bytes
        item = {"kind": kind, "shape": shape, "N": N, "K": K, "M": M, "kernel": name, "format": fmt,
                "config": config, "us": us, "wall_us": t["wall_us"], "gpu_us": t.get("gpu_us"),
                "weight_bytes": wb, "bytes": io, "weight_GBps": wb / us / 1e3, "flops": 2 * M * N * K,
                "TFLOPs": 2 * M * N * K / us / 1e6, "timing": t}
        if baseline:
            item["speedup_vs_xla_bf16"] = baseline / us
        record(item)
        return us

    rng = np.random.default_rng(0)
    try:
        # -- copy bandwidth: 4 distinct 512 MiB buffers negated (read + write), so no call can be merged --------
        if not args.no_copy:
            n = 2 ** (16 if I else 28)
            bufs = [(jnp.asarray(rng.standard_normal(n, np.float32)).astype(jnp.bfloat16),) for _ in range(4)]
            t = time_calls(lambda v: -v, bufs, per_exec=4, reps=5)
            copy_gbps = 2 * n * 2 / t["us"] / 1e3
            result["copy_GBps"] = copy_gbps
            result["copy_timing"] = t
            log(f"copy bandwidth {copy_gbps:.0f} GB/s (read+write), {t}")
            del bufs
            if args.torch or (args.decode_only and not I):
                torch_copy(result)
        save()

        weights, bases = {}, {}
        for shape in args.shapes.split(","):
            N, K = SHAPES[shape]
            W = weights[shape] = make_weights(N, K, 4, rng)
            log("weights ready", shape)
            xs = {M: [jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16) for _ in range(4)]
                  for M in (*DECODE_M, PREFILL_M)}
            if not args.decode_only:
                run_checks(result, shape, N, K, W, xs, check_time, save)
            if args.mosaic:
                run_mosaic_checks(result, shape, N, K, W, xs, mosaic_configs(N, K, False), check_time, save)

            # -- decode GEMVs ------------------------------------------------------------------------------
            base = {}
            for M in DECODE_M:
                base[M] = bench("baseline", shape, M, "xla_bf16", lambda x, w: jnp.dot(x, w.T),
                                [(xs[M][i], W["bf16"][i]) for i in range(4)], "bf16", N, K)
            for M in (() if args.no_triton else DECODE_M):
                bench("decode", shape, M, "w8a16_gemv", lambda x, q, s: w8a16.w8a16_gemv_pallas(x, q, s, interpret=I),
                      [(xs[M][i], *W["fp8"][i]) for i in range(4)], "fp8", N, K,
                      config=str(w8a16.w8a16_gemv_blocks(N, K)), baseline=base[M])
                blk = w4a16.w4a16_gemv_blocks(N, K)
                bench("decode", shape, M, "w4a16_gemv",
                      lambda x, p, s, g: w4a16.w4a16_gemv_pallas(x, p, s, g, interpret=I),
                      [(xs[M][i], *W["nvfp4"][i]) for i in range(4)], "nvfp4", N, K, config=str(blk),
                      baseline=base[M])
            if args.mosaic:
                mosaic_decode(bench, shape, N, K, W, xs, base, result)
                bases[shape] = base
            if args.decode_only:
                result[f"done_{shape}"] = True
                save()
                continue
            bench("decode", shape, 1, "w4a4_gemm(decode)",
                  lambda x, p, s, g: w4a4.w4a4_gemm_pallas(x, p, s, g, decode=True, interpret=I),
                  [(xs[1][i], *W["nvfp4"][i]) for i in range(4)], "nvfp4", N, K, baseline=base[1])

            # -- prefill GEMMs -----------------------------------------------------------------------------
            M = PREFILL_M
            pre = [xs[M][i] for i in range(2)]
            bp = bench("baseline", shape, M, "xla_bf16", lambda x, w: jnp.dot(x, w.T),
                       [(pre[i], W["bf16"][i]) for i in range(2)], "bf16", N, K, per_exec=2, reps=3)
            bench("context", shape, M, "xla_fp8_dot(quantize rows + dot + scales)", xla_fp8_rows,
                  [(pre[i], *W["fp8_rows"][i]) for i in range(2)], "fp8_rows", N, K, per_exec=2, reps=3, baseline=bp)
            gemms = [
                ("w8a16_gemm_pipelined", "fp8", lambda x, q, s: w8a16.w8a16_gemm_pipelined_pallas(x, q, s, interpret=I)),
                ("fp8_gemm_t", "fp8_rows", lambda x, q, s: fp8_gemm.fp8_gemm_t_pallas(x, q, s, interpret=I)),
                ("w8a16_gemm", "fp8", lambda x, q, s: w8a16.w8a16_gemm_pallas(x, q, s, interpret=I)),
                ("w4a16_gemm_t_m128", "nvfp4_t", lambda x, p, s, g: w4a16.w4a16_gemm_t_m128_pallas(x, p, s, g, interpret=I)),
                ("w4a16_gemm_t", "nvfp4_t", lambda x, p, s, g: w4a16.w4a16_gemm_t_pallas(x, p, s, g, interpret=I)),
                ("w4a16_gemm", "nvfp4", lambda x, p, s, g: w4a16.w4a16_gemm_pallas(x, p, s, g, interpret=I)),
                ("w4a4_gemm", "nvfp4", lambda x, p, s, g: w4a4.w4a4_gemm_pallas(x, p, s, g, interpret=I)),
            ]
            for name, fmt, fn in gemms:
                bench("prefill", shape, M, name, fn, [(pre[i], *W[fmt][i]) for i in range(2)],
                      "nvfp4" if fmt == "nvfp4_t" else fmt, N, K, per_exec=2, reps=3, baseline=bp)
            result[f"done_{shape}"] = True
            save()

        # -- Mosaic GEMV config sweep (after every default is timed; deadline-limited) --------------------------
        if args.mosaic and args.mosaic_sweep:
            for shape in args.shapes.split(","):
                N, K = SHAPES[shape]
                xs = {M: [jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16) for _ in range(4)] for M in DECODE_M}
                run_mosaic_checks(result, shape, N, K, weights[shape], xs, mosaic_configs(N, K, True)[2:],
                                  check_time, save, full=False)
                mosaic_sweep(bench, shape, N, K, weights[shape], xs, bases[shape], result)

        # -- tile / variant sweeps (deadline-limited; alternatives to the defaults) ------------------------------
        if args.sweep:
            for shape in args.shapes.split(","):
                N, K = SHAPES[shape]
                W = weights[shape]
                x1 = [jnp.asarray(rng.standard_normal((1, K)), jnp.bfloat16) for _ in range(4)]
                for blk in gemv_variants(N, K, "fp8"):
                    bench("sweep", shape, 1, "w8a16_gemv", lambda x, q, s, blk=blk: w8a16.w8a16_gemv_pallas(
                        x, q, s, blocks=blk, interpret=I), [(x1[i], *W["fp8"][i]) for i in range(4)], "fp8", N, K,
                        config=str(blk))
                for blk in gemv_variants(N, K, "nvfp4"):
                    bench("sweep", shape, 1, "w4a16_gemv",
                          lambda x, p, s, g, blk=blk: w4a16.w4a16_gemv_pallas(x, p, s, g, blocks=blk, interpret=I),
                          [(x1[i], *W["nvfp4"][i]) for i in range(4)], "nvfp4", N, K, config=str(blk))
            for shape in args.shapes.split(",")[:1]:
                N, K = SHAPES[shape]
                W = weights[shape]
                x4k = [jnp.asarray(rng.standard_normal((PREFILL_M, K)), jnp.bfloat16) for _ in range(2)]
                for name, fmt, blk in gemm_variants():
                    fn = {"fp8_gemm_t": lambda x, q, s, blk=blk: fp8_gemm.fp8_gemm_t_pallas(x, q, s, blocks=blk, interpret=I),
                          "w8a16_gemm_pipelined": lambda x, q, s, blk=blk: w8a16.w8a16_gemm_pipelined_pallas(
                              x, q, s, blocks=blk, interpret=I),
                          "w8a16_gemm": lambda x, q, s, blk=blk: w8a16.w8a16_gemm_pallas(x, q, s, blocks=blk, interpret=I),
                          "w4a16_gemm_t": lambda x, p, s, g, blk=blk: w4a16.w4a16_gemm_t_pallas(
                              x, p, s, g, blocks=blk, interpret=I),
                          "w4a16_gemm": lambda x, p, s, g, blk=blk: w4a16.w4a16_gemm_pallas(
                              x, p, s, g, blocks=blk, interpret=I)}[name]
                    bench("sweep", shape, PREFILL_M, name, fn, [(x4k[i], *W[fmt][i]) for i in range(2)],
                          "nvfp4" if fmt == "nvfp4_t" else fmt, N, K, config=str(blk), per_exec=2, reps=3)
        if args.torch:
            torch_baselines(result, rng, check_time)
    except Deadline:
        result["deadline_hit"] = True
        log("deadline reached; remaining items skipped")
    result["elapsed_s"] = time.time() - T0
    save()
    md = markdown(result)
    with open(os.path.join(args.out, f"{stem}.md"), "w") as fh:
        fh.write(md)
    print(md)
    print(summary(result))


def xla_fp8_rows(x, q, s):
    """Context only: what XLA's own FP8 matmul (cuBLASLt on Hopper) gives for the fp8_gemm_t math."""
    xq, xs = qf.quantize_rows_fp8(x)
    y = jax.lax.dot_general(xq, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * xs[:, None] * s[None, :]).astype(x.dtype)


def gemv_variants(N, K, fmt):
    """Alternative GEMV configs: operand orientation, tile widths, warps; NVFP4 also the nibble decoder."""
    out = []
    split = lambda bn, bk: w8a16.gemv_split_k(-(-N // bn), -(-K // bk))
    if fmt == "fp8":
        for swap in (True, False):
            for bn, warps in ((32, 4), (64, 4), (128, 4), (128, 8)):
                out.append(QuantBlocks(16, bn, 128, split(bn, 128), warps, 4, swap=swap))
        return out
    for dec in ("asm", "arith"):
        for swap in (True, False):
            for bn, bk, warps in ((64, 128, 4), (32, 256, 4), (128, 128, 4), (64, 64, 4)):
                if not swap and bn != 64:
                    continue
                out.append(W4Blocks(16, bn, bk, split(bn, bk), warps, 4, swap=swap, decode=dec))
    return out


def gemm_variants():
    """Alternative prefill GEMM configs (in_proj only)."""
    v = []
    for swap in (False, True):
        for bm, bn, bk, warps, stages in ((128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (64, 128, 128, 4, 4)):
            v.append(("fp8_gemm_t", "fp8_rows", QuantBlocks(bm, bn, bk, 1, warps, stages, swap=swap)))
    v.append(("w8a16_gemm_pipelined", "fp8", QuantBlocks(128, 128, 128, 1, 8, 4, swap=True)))
    v.append(("w8a16_gemm", "fp8", QuantBlocks(128, 128, 64, 1, 8, 3, swap=True)))
    v.append(("w8a16_gemm", "fp8", QuantBlocks(128, 128, 64, 1, 8, 3, swap=False)))
    for dec in ("asm", "arith"):
        v.append(("w4a16_gemm", "nvfp4", W4Blocks(128, 128, 64, 1, 8, 3, swap=True, decode=dec)))
        v.append(("w4a16_gemm_t", "nvfp4_t", W4Blocks(128, 128, 64, 1, 8, 3, decode=dec)))
        v.append(("w4a16_gemm_t", "nvfp4_t", W4Blocks(128, 256, 64, 1, 8, 3, decode=dec)))
    return v


def run_checks(result, shape, N, K, W, xs, check_time, save):
    """Every kernel (defaults and the variants the sweep may pick) against its reference at this shape."""
    x16, x4k = xs[16][0], xs[PREFILL_M][0][:512]
    q, s = W["fp8"][0]
    p, s4, g = W["nvfp4"][0]
    pt, s4t, _ = W["nvfp4_t"][0]
    qr, sr = W["fp8_rows"][0]
    f32 = jnp.float32
    exact16 = w8a16.w8a16_reference(x16, q, s, out_dtype=f32)
    ref4_16 = w4a16.w4a16_reference(x16, p, s4, g, out_dtype=f32)
    ref4_4k = w4a16.w4a16_reference(x4k, p, s4, g, out_dtype=f32)
    rp = w8a16.w8a16_pipelined_reference(x4k, q, s, out_dtype=f32)
    rt = fp8_gemm.fp8_gemm_t_reference(x4k, qr, sr, out_dtype=f32)
    checks = [("w8a16_gemv", lambda: w8a16.w8a16_gemv_pallas(x16, q, s, out_dtype=f32, interpret=I), exact16),
              ("w8a16_gemm", lambda: w8a16.w8a16_gemm_pallas(x4k, q, s, out_dtype=f32, interpret=I),
               w8a16.w8a16_reference(x4k, q, s, out_dtype=f32)),
              ("w8a16_gemm_pipelined", lambda: w8a16.w8a16_gemm_pipelined_pallas(x4k, q, s, out_dtype=f32,
                                                                                 interpret=I), rp),
              ("fp8_gemm_t", lambda: fp8_gemm.fp8_gemm_t_pallas(x4k, qr, sr, out_dtype=f32, interpret=I), rt),
              ("w4a16_gemv", lambda: w4a16.w4a16_gemv_pallas(x16, p, s4, g, out_dtype=f32, interpret=I), ref4_16),
              ("w4a16_gemm", lambda: w4a16.w4a16_gemm_pallas(x4k, p, s4, g, out_dtype=f32, interpret=I), ref4_4k),
              ("w4a16_gemm_t", lambda: w4a16.w4a16_gemm_t_pallas(x4k, pt, s4t, g, out_dtype=f32, interpret=I),
               ref4_4k),
              ("w4a16_gemm_t_m128", lambda: w4a16.w4a16_gemm_t_m128_pallas(x4k, pt, s4t, g, out_dtype=f32,
                                                                           interpret=I), ref4_4k),
              ("w4a4_gemm", lambda: w4a4.w4a4_gemm_pallas(x4k, p, s4, g, out_dtype=f32, interpret=I),
               w4a4.w4a4_reference(x4k, p, s4, g, out_dtype=f32))]
    for blk in gemv_variants(N, K, "fp8")[::3]:
        checks.append((f"w8a16_gemv{blk}", lambda blk=blk: w8a16.w8a16_gemv_pallas(
            x16, q, s, out_dtype=f32, blocks=blk, interpret=I), exact16))
    for blk in gemv_variants(N, K, "nvfp4"):
        checks.append((f"w4a16_gemv{blk}", lambda blk=blk: w4a16.w4a16_gemv_pallas(
            x16, p, s4, g, out_dtype=f32, blocks=blk, interpret=I), ref4_16))
    for name, fmt, blk in (gemm_variants() if shape == SHAPES_ORDER[0] else ()):
        run = {"fp8_gemm_t": lambda blk=blk: fp8_gemm.fp8_gemm_t_pallas(x4k, qr, sr, out_dtype=f32, blocks=blk,
                                                                        interpret=I),
               "w8a16_gemm_pipelined": lambda blk=blk: w8a16.w8a16_gemm_pipelined_pallas(
                   x4k, q, s, out_dtype=f32, blocks=blk, interpret=I),
               "w8a16_gemm": lambda blk=blk: w8a16.w8a16_gemm_pallas(x4k, q, s, out_dtype=f32, blocks=blk,
                                                                     interpret=I),
               "w4a16_gemm": lambda blk=blk: w4a16.w4a16_gemm_pallas(x4k, p, s4, g, out_dtype=f32, blocks=blk,
                                                                     interpret=I),
               "w4a16_gemm_t": lambda blk=blk: w4a16.w4a16_gemm_t_pallas(x4k, pt, s4t, g, out_dtype=f32,
                                                                         blocks=blk, interpret=I)}[name]
        ref = {"fp8_gemm_t": rt, "w8a16_gemm_pipelined": rp}.get(
            name, w8a16.w8a16_reference(x4k, q, s, out_dtype=f32) if name == "w8a16_gemm" else ref4_4k)
        checks.append((f"{name}{blk}", run, ref))
    for name, run, ref in checks:
        check_time()
        try:
            y = jax.block_until_ready(run())
            err = rel_err(y, ref)
            c = {"shape": shape, "kernel": name, "rel_err_vs_reference": err,
                 "finite": bool(jnp.all(jnp.isfinite(y))), "ok": bool(err < 1e-4 and jnp.all(jnp.isfinite(y)))}
        except Exception as e:  # noqa: BLE001
            c = {"shape": shape, "kernel": name, "ok": False, "error": repr(e)[:2000],
                 "trace": traceback.format_exc()[-3000:]}
        result["checks"].append(c)
        log("CHECK", {k: v for k, v in c.items() if k != "trace"})
        save()


# ---- Mosaic GPU decode GEMVs ---------------------------------------------------------------------------------
MOSAIC_ARMS = {"w8a16_gemv": ("fp8", mgpu_gemv_w8.w8a16_gemv_mosaic, w8a16.w8a16_reference),
               "w4a16_gemv": ("nvfp4", mgpu_gemv_w4.w4a16_gemv_mosaic, w4a16.w4a16_reference)}


# Launch-shape grid of both Mosaic GEMVs (CTAs per SM, split-K; benchmarks/notes/gemv.md).
_G8 = lambda *a, **k: ("w8a16_gemv", GemvConfig(*a, **k))       # noqa: E731
_G4 = lambda *a, **k: ("w4a16_gemv", GemvConfig(*a, **k))       # noqa: E731
GEMV_GRID = {
    "in_proj": [_G8(64, 2, split_k=2), _G4(64, 4, split_k=2), _G8(64, 6), _G8(64, 3), _G8(128, 4)],
    "out_proj": [_G8(64, 2, split_k=8), _G4(64, 3, split_k=4), _G8(64, 6)],
}


def mosaic_configs(N, K, sweep: bool) -> list[tuple[str, GemvConfig]]:
    """(kernel, config) pairs: the two defaults first, then (with `sweep`) the alternatives; with
    --mosaic-set grid the launch-shape grid instead."""
    if MOSAIC_SET == "grid" and not sweep:
        return next(v for k, v in GEMV_GRID.items() if SHAPES[k] == (N, K))
    d8, d4 = mgpu_gemv_w8.w8a16_gemv_blocks(N, K), mgpu_gemv_w4.w4a16_gemv_blocks(N, K)
    out = [("w8a16_gemv", d8), ("w4a16_gemv", d4)]
    if sweep:
        alt8 = [GemvConfig(64, 6), GemvConfig(64, 3), GemvConfig(128, 4)]
        alt4 = [GemvConfig(192 - d4.block_n, 3), GemvConfig(d4.block_n, 4)]
        out += [("w8a16_gemv", c) for c in alt8 if c != d8] + [("w4a16_gemv", c) for c in alt4 if c != d4]
    return out


def run_mosaic_checks(result, shape, N, K, W, xs, configs, check_time, save, full: bool = True):
    """Each Mosaic (kernel, config) at this shape against its reference at M=16 (float32 out); with `full`
    also the bf16 output and the rows of M=1 / M=4 against the same rows of M=16 (bitwise). Each config in
    its own try/except, the traceback logged."""
    x16 = xs[16][0]
    for name, cfg in configs:
        check_time()
        fmt, fn, ref_fn = MOSAIC_ARMS[name]
        args = W[fmt][0]
        try:
            ref = ref_fn(x16, *args, out_dtype=jnp.float32)
            y16 = jax.block_until_ready(fn(x16, *args, out_dtype=jnp.float32, config=cfg, interpret=I))
            err = rel_err(y16, ref)
            c = {"shape": shape, "kernel": f"{name}[mosaic]", "config": str(cfg), "rel_err_vs_reference": err,
                 "finite": bool(jnp.all(jnp.isfinite(y16)))}
            ok = err < 1e-5 and c["finite"]
            if full:
                c["batch_invariant_M1_M4"] = inv = {m: bool(np.array_equal(np.asarray(fn(
                    x16[:m], *args, out_dtype=jnp.float32, config=cfg, interpret=I)), np.asarray(y16[:m])))
                    for m in (1, 4)}
                yb = fn(x16, *args, config=cfg, interpret=I)               # bf16 out (the direct-store path)
                yb1 = fn(x16[:1], *args, config=cfg, interpret=I)
                c["rel_err_bf16_out"] = err_b = rel_err(yb, ref)
                c["batch_invariant_bf16_M1"] = inv_b = bool(np.array_equal(np.asarray(yb1), np.asarray(yb[:1])))
                ok = ok and err_b < 4e-3 and all(inv.values()) and inv_b
            c["ok"] = bool(ok)
        except Exception as e:  # noqa: BLE001
            c = {"shape": shape, "kernel": f"{name}[mosaic]", "config": str(cfg), "ok": False, "error": repr(e)[:2000],
                 "trace": traceback.format_exc()[-3000:]}
        result["checks"].append(c)
        log("CHECK", {k: v for k, v in c.items() if k != "trace"})
        save()


def _passed(result, shape):
    """(kernel, config) pairs whose check passed."""
    return {(c["kernel"].split("[")[0], c["config"]) for c in result["checks"]
            if c.get("shape") == shape and c["kernel"].endswith("[mosaic]") and c["ok"]}


def _time_mosaic(bench, kind, shape, N, K, W, xs, base, name, cfg, M):
    fmt, fn, _ = MOSAIC_ARMS[name]
    return bench(kind, shape, M, f"{name}[mosaic]", lambda *a, cfg=cfg: fn(*a, config=cfg, interpret=I),
                 [(xs[M][i], *W[fmt][i]) for i in range(4)], fmt, N, K, config=str(cfg),
                 baseline=base[M])


def mosaic_decode(bench, shape, N, K, W, xs, base, result):
    """Time the Mosaic configs at M = 1, 16, 4 (only those whose check passed)."""
    passed = _passed(result, shape)
    for M in [m for m in (1, 16, 4) if m in DECODE_M]:
        for name, cfg in mosaic_configs(N, K, False):
            if (name, str(cfg)) in passed:
                _time_mosaic(bench, "decode", shape, N, K, W, xs, base, name, cfg, M)


def mosaic_sweep(bench, shape, N, K, W, xs, base, result):
    """Alternative configs at M=1 (checked ones only); the fastest per kernel, if not the default, at M=4, 16."""
    passed = _passed(result, shape)
    defaults = dict(mosaic_configs(N, K, False))
    times = {}
    for item in result["items"]:
        if item["shape"] == shape and item["M"] == 1 and item["kernel"].endswith("[mosaic]"):
            times[(item["kernel"].split("[")[0], item["config"])] = item["us"]
    cfgs = {}
    for name, cfg in mosaic_configs(N, K, True):
        cfgs[(name, str(cfg))] = cfg
        if cfg != defaults[name] and (name, str(cfg)) in passed:
            us = _time_mosaic(bench, "sweep", shape, N, K, W, xs, base, name, cfg, 1)
            if us is not None:
                times[(name, str(cfg))] = us
    for name in defaults:
        mine = {c: t for (n, c), t in times.items() if n == name}
        if mine:
            best = min(mine, key=mine.get)
            result.setdefault("mosaic_best_M1", {})[f"{shape}/{name}"] = [best, mine[best]]
            if cfgs[(name, best)] != defaults[name]:
                for M in (4, 16):
                    _time_mosaic(bench, "sweep", shape, N, K, W, xs, base, name, cfgs[(name, best)], M)


def torch_copy(result):
    """Device copy bandwidth through torch (cross-check of the JAX number)."""
    try:
        import torch
        from triton.testing import do_bench
        a = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda").random_()
        b = torch.empty_like(a)
        ms = do_bench(lambda: b.copy_(a), return_mode="median")
        result["torch_copy_GBps"] = 2 * a.numel() / (ms * 1e-3) / 1e9
        log(f"torch copy {result['torch_copy_GBps']:.0f} GB/s")
        del a, b
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        result["torch_copy_error"] = repr(e)[:300]


def torch_baselines(result, rng, check_time):
    """cuBLAS BF16 and cuBLASLt FP8 through torch, for context (not a baseline of the targets)."""
    import torch
    from triton.testing import do_bench
    out = {}
    for shape, (N, K) in SHAPES.items():
        check_time()
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        for M in (1, 16, 4096):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            out[f"{shape}_bf16_M{M}_us"] = do_bench(lambda: x @ w.T, return_mode="median") * 1e3
        try:
            w8 = w.to(torch.float8_e4m3fn)
            one = torch.ones((), device="cuda")
            for M in (16, 4096):
                x8 = torch.randn(M, K, device="cuda").to(torch.float8_e4m3fn)
                out[f"{shape}_fp8_M{M}_us"] = do_bench(
                    lambda: torch._scaled_mm(x8, w8.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                    return_mode="median") * 1e3
        except Exception as e:  # noqa: BLE001
            out[f"{shape}_fp8_error"] = repr(e)[:300]
        del w
    result["torch_context"] = out
    log("torch", out)


def short_config(cfg) -> str:
    """GemvConfig(block_n=64, stages=6, split_k=0, ...) -> 64/6/0/... (other configs as given)."""
    if not cfg:
        return ""
    if cfg.startswith("GemvConfig("):
        return "/".join(v.split("=")[1].strip("'") for v in cfg[len("GemvConfig("):-1].split(", "))
    return cfg


def summary(result) -> str:
    """Short table: gpu us at M = 1 / 4 / 16 per (shape, kernel, config), % of the copy rate at M=1, check."""
    bw = result.get("torch_copy_GBps") or result.get("copy_GBps") or float("nan")
    rows = {}
    for it in result["items"]:
        key = (it["shape"], it["kernel"], short_config(it.get("config")))
        rows.setdefault(key, {})[it["M"]] = it
    ok = {(c["shape"], c["kernel"], short_config(c.get("config"))): c["ok"] for c in result["checks"]}
    lines = [f"copy {bw:.0f} GB/s",
             "| shape | kernel | config | M=1 | M=4 | M=16 us | % copy (M=1) | largest kernel M=1 | ok |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (shape, kernel, cfg), by_m in rows.items():
        t = [f"{by_m[m]['us']:.1f}" if m in by_m else "-" for m in DECODE_M]
        pct = f"{100 * by_m[1]['weight_GBps'] / bw:.0f}" if 1 in by_m else "-"
        kernels = (by_m[1]["timing"].get("gpu_kernels_us") if 1 in by_m else None) or {"": float("nan")}
        main = max(kernels.values())
        lines.append(f"| {shape} | {kernel} | {cfg} | {' | '.join(t)} | {pct} | {main:.1f} | "
                     f"{ok.get((shape, kernel, cfg), '')} |")
    return "\n".join(lines)


def markdown(result) -> str:
    lines = [f"# Quantized projections, {result['device']}, {result['date']}", "",
             f"copy bandwidth (read+write): {result.get('copy_GBps', float('nan')):.0f} GB/s", "",
             "| kind | shape | M | kernel | us (gpu) | us (wall) | weight GB/s | % copy BW | TFLOP/s | x XLA BF16 "
             "| config |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    bw = result.get("copy_GBps") or float("nan")
    for it in result["items"]:
        lines.append(f"| {it['kind']} | {it['shape']} | {it['M']} | {it['kernel']} | "
                     f"{(it['gpu_us'] or float('nan')):.1f} | {it['wall_us']:.1f} | {it['weight_GBps']:.0f} | "
                     f"{100 * it['weight_GBps'] / bw:.0f} | {it['TFLOPs']:.1f} | "
                     f"{it.get('speedup_vs_xla_bf16', float('nan')):.2f} | {short_config(it.get('config'))} |")
    lines += ["", "| check | shape | rel err vs reference | rel err vs unquantized | ok |", "|---|---|---|---|---|"]
    for c in result["checks"]:
        lines.append(f"| {c['kernel']} {short_config(c.get('config'))} | {c['shape']} | "
                     f"{c.get('rel_err_vs_reference', 'ERR')} | "
                     f"{c.get('rel_err_vs_unquantized_f32', '')} | {c['ok']} |")
    if result["errors"]:
        lines += ["", "errors:"] + [f"- {e['kernel']} {e['shape']} M={e['M']}: {e['error'][:300]}"
                                    for e in result["errors"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
