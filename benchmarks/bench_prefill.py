"""Prefill GEMMs at M = 4096 on the H200: Mosaic GPU arms vs Triton arms vs XLA BF16 vs XLA's FP8 dot.

Shapes (Nemotron-H 8B): in_proj N=18560 K=4096, out_proj N=4096 K=8192. Every arm is first checked against
its jnp reference at the full shape (rel err), then timed: 4 calls (all arguments distinct) inside one jitted function
cycling through 4 activation sets and 2 weight copies (so neither sits in the 60 MB L2 from the call
before), warmed up twice, best of 3 trials of `reps` executions; the time per call includes each arm's
activation quantization (an XLA pass), as the layer pays it. Baseline: XLA BF16 matmul in the same run.

    PYTHONPATH=. python3 benchmarks/bench_prefill.py --out $OUT [--sweep] [--deadline 150]
writes OUT/prefill.json and prefill.md (the date is in them). `--nvfp4` runs the NVFP4 set instead (Mosaic arms on
the plain and transposed layouts, with --sweep the plain arm's launch neighbours; Triton arm, dequantize-to-bf16 +
XLA dot, the transposed arm's weight relayout alone): prefill_nvfp4.*; `--quick-quant` / `--norm-fp8` name theirs
likewise (prefill_quick-quant.*, prefill_quick-quant_norm-fp8.*). The CPU dry run (PREFILL_DRY=1) adds _dry.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import time
import traceback

import jax
import jax.numpy as jnp

from benchmarks import timing
from metrale_jax.errors import ShapeError
from metrale_jax.weights import quant_formats as qf
from pallas_kernels import fp8_gemm, mgpu_gemm, mgpu_gemm_nvfp4, norm_fp8, norms, w4a16, w8a16
from pallas_kernels.mgpu_gemm import MgpuTiles
from pallas_kernels.mgpu_gemm_nvfp4 import Nvfp4Tiles

T0 = time.time()
M = 4096
SHAPES = {"in_proj": (18560, 4096), "out_proj": (4096, 8192)}
# CPU dry run of this script (tiny shapes, every Pallas arm in interpret mode): PREFILL_DRY=1
DRY = os.environ.get("PREFILL_DRY") == "1"
if DRY:
    M, SHAPES = 256, {"in_proj": (384, 256), "out_proj": (256, 512)}


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def rel_err(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def time_calls(fn, arg_sets, *, reps: int = 6) -> dict:
    """us per call (wall): one call per (distinct) arg set inside one executable, best of 3 trials of `reps`
    executions. The arg sets must all differ: XLA merges identical calls (call 1 of s2 cycled 3 sets in
    6 calls and so timed every arm at half its time)."""
    walls = timing.queued_wall_us(fn, arg_sets, reps=reps)
    return {"us": min(walls), "us_all": walls}


def timed_row(result, save, row: dict, deadline: float, measure) -> None:
    """Append `row` to the results (saved): marked skipped past the deadline, else filled in by measure(row),
    whose failure is recorded in the row (its traceback) instead of stopping the run."""
    if time.time() - T0 > deadline:
        row["skipped"] = "deadline"
    else:
        try:
            measure(row)
        except Exception:  # noqa: BLE001
            row["error"] = traceback.format_exc()[-3000:]
            log(f"{row['shape']} {row['name']} {row['impl']} {row['config']} FAILED\n{row['error']}")
    result["rows"].append(row)
    save()


# ---- weights (quantized on the device; same formulas as metrale_jax.weights.quant_formats) ---------------
def fp8_rows(w):
    return qf.quantize_rows_fp8(w)                     # E4M3 [N, K], f32 [N]


def fp8_blocks(w):
    N, K = w.shape
    b = w.astype(jnp.float32).reshape(N // 128, 128, K // 128, 128)
    amax = jnp.max(jnp.abs(b), axis=(1, 3))
    s = jnp.where(amax > 0, amax / qf.E4M3_MAX, 1.0)
    q = jnp.clip(b / s[:, None, :, None], -qf.E4M3_MAX, qf.E4M3_MAX).reshape(N, K).astype(jnp.float8_e4m3fn)
    return q, s


def xla_bf16(x, w):
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))


def xla_fp8_rows(x, q, s):
    """XLA's own FP8 matmul (cuBLASLt on Hopper) on the fp8_gemm_t math, for context."""
    xq, xs = qf.quantize_rows_fp8(x)
    y = jax.lax.dot_general(xq, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * xs[:, None] * s[None, :]).astype(x.dtype)


def mosaic_variants(name: str, N: int, K: int, sweep: bool) -> list[MgpuTiles | None]:
    """None = the arm's default tiles; with --sweep the block-scaled kernel's launch neighbours (128x128 per
    warpgroup: stages 3 / 4, epilogue staging 64 / 128 bytes, snake order and width) other than its default, and
    the row-scaled kernel's 128x128 and 64x256 warpgroup tiles."""
    out: list[MgpuTiles | None] = [None]
    if not sweep:
        return out
    if name == "fp8_gemm_t":     # 128x128 against 64x256 per warpgroup
        cands = [MgpuTiles(128, 128, "m", stages=4), MgpuTiles(64, 256, "m", stages=3),
                 MgpuTiles(64, 256, "m", stages=4, epi_bytes=64), MgpuTiles(64, 256, "m", stages=3, grid_minor="n")]
        d = mgpu_gemm.default_tiles(N, K, per_block=False)
        return out + [t for t in cands if t != d and N % t.cta[1] == 0]
    base = MgpuTiles(128, 128, "m", stages=4, epi_bytes=64)
    cands = [dataclasses.replace(base, stages=3), dataclasses.replace(base, stages=3, epi_bytes=128), base,
             dataclasses.replace(base, grid_minor="n"), dataclasses.replace(base, grid_tile_width=4),
             dataclasses.replace(base, grid_tile_width=16)]
    return out + [t for t in cands if t != mgpu_gemm.default_tiles(N, K, per_block=True)]


def short(t: MgpuTiles | str | None) -> str:
    """MgpuTiles -> '128x128m st4 m8 dr1 epi64x128B' (per-warpgroup tile, wg_dim, stages, snake order,
    delay_release, epilogue sub-tile); None -> 'default'."""
    if t is None:
        return "default"
    return (f"{t.tile_m}x{t.tile_n}{t.wg_dim} st{t.stages} {t.grid_minor}{t.grid_tile_width} dr{t.delay_release} "
            f"epi{t.epi_m}x{t.epi_bytes}B")


def variant_name(args) -> str:
    """The arm set a run times, which names its files: 'nvfp4', 'quick-quant', 'quick-quant_norm-fp8',
    'norm-fp8' or 'default' (prefill.json)."""
    if args.nvfp4:
        return "nvfp4"
    parts = (["quick-quant"] if args.quick_quant else []) + (["norm-fp8"] if args.norm_fp8 else [])
    return "_".join(parts) or "default"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/prefill_out")
    ap.add_argument("--deadline", type=float, default=150.0, help="seconds; later arms are skipped")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated arm names to keep (default: all)")
    ap.add_argument("--shapes", default="in_proj,out_proj")
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--no-xla-fp8", action="store_true")
    ap.add_argument("--nvfp4", action="store_true", help="the NVFP4 GEMMs (w4a16_gemm, w4a16_gemm_t) only")
    ap.add_argument("--quick-quant", action="store_true",
                    help="only XLA BF16, the quantization passes (XLA vs fused) and the Mosaic arms with each")
    ap.add_argument("--norm-fp8", action="store_true",
                    help="with --quick-quant: also the norm in front of each projection (gated RMSNorm before "
                         "out_proj, RMSNorm before in_proj) + GEMM, bf16 norm + XLA BF16 vs the fused E4M3 norm "
                         "(norm_fp8) + Mosaic FP8 arms, and the FP8 arms alone on pre-quantized x")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    date = datetime.date.today().isoformat()
    variant = variant_name(args)
    stem = os.path.join(args.out, "prefill" + ("" if variant == "default" else "_" + variant) + ("_dry" if DRY else ""))
    dev = jax.devices()[0]
    result = {"date": date, "variant": variant, "device": str(getattr(dev, "device_kind", dev)),
              "platform": jax.default_backend(), "M": M, "shapes": {}, "rows": [], "errors": [],
              "versions": {"jax": jax.__version__}, "method": __doc__.split("\n\n")[1]}
    try:
        import jaxlib
        result["versions"]["jaxlib"] = jaxlib.__version__
        import torch
        import triton
        result["versions"].update(torch=torch.__version__, triton=triton.__version__)
    except Exception as e:  # noqa: BLE001
        result["versions"]["import_error"] = repr(e)[:200]

    def save():
        with open(stem + ".json", "w") as fh:
            json.dump(result, fh, indent=1, default=str)
        with open(stem + ".md", "w") as fh:
            fh.write(markdown(result))

    key = jax.random.key(0)
    if args.nvfp4:
        nvfp4_main(args, result, save, key)
        print(markdown(result))
        return
    for shape in args.shapes.split(","):
        N, K = SHAPES[shape]
        flops = 2 * M * N * K
        result["shapes"][shape] = {"N": N, "K": K, "M": M, "flops": flops}
        log(f"== {shape} N={N} K={K} M={M}")
        try:
            kx, kw, key = jax.random.split(key, 3)
            xs = [jax.random.normal(k, (M, K), jnp.bfloat16) for k in jax.random.split(kx, 4)]
            w = (jax.random.normal(kw, (N, K), jnp.float32)
                 * jax.random.uniform(kw, (N, 1), minval=0.1, maxval=3.0))
            W = {"bf16": [(w.astype(jnp.bfloat16),)], "rows": [fp8_rows(w)], "blocks": [fp8_blocks(w)]}
            del w
            for f in W:                                          # a second copy in distinct buffers
                W[f].append(tuple(jnp.array(a, copy=True) for a in W[f][0]))
            jax.block_until_ready(W)
            x0 = xs[0]
            refs = {"rows": fp8_gemm.fp8_gemm_t_reference(x0, *W["rows"][0], out_dtype=jnp.float32),
                    "blocks": w8a16.w8a16_pipelined_reference(x0, *W["blocks"][0], out_dtype=jnp.float32)}
            if not args.quick_quant:
                refs["bf16"] = xla_bf16(x0.astype(jnp.float32), W["bf16"][0][0].astype(jnp.float32))
            jax.block_until_ready(refs)
        except Exception:  # noqa: BLE001
            result["errors"].append({"shape": shape, "stage": "setup", "traceback": traceback.format_exc()})
            log(traceback.format_exc())
            save()
            continue

        arms = [("xla_bf16", "xla", None, "bf16", xla_bf16)]
        if not args.no_xla_fp8:
            arms.append(("xla_fp8_dot", "xla", None, "rows", xla_fp8_rows))
        arms += [("quantize_rows (part of fp8_gemm_t)", "xla", None, "rows", lambda x, q, s: qf.quantize_rows_fp8(x)),
                 ("quantize_blocks (part of w8a16_gemm_pipelined)", "xla", None, "blocks",
                  lambda x, q, s: qf.quantize_rows_fp8_blocks(x))]
        if not args.no_triton:
            arms += [("fp8_gemm_t", "triton", None, "rows",
                      lambda x, q, s, **kw: fp8_gemm.fp8_gemm_t_pallas(x, q, s, interpret=DRY, **kw)),
                     ("w8a16_gemm_pipelined", "triton", None, "blocks",
                      lambda x, q, s, **kw: w8a16.w8a16_gemm_pipelined_pallas(x, q, s, interpret=DRY, **kw))]
        result["shapes"][shape]["default_tiles"] = {
            name: short(mgpu_gemm.default_tiles(N, K, per_block=name != "fp8_gemm_t"))
            for name in ("fp8_gemm_t", "w8a16_gemm_pipelined")}
        for t in mosaic_variants("fp8_gemm_t", N, K, args.sweep):
            arms.append(("fp8_gemm_t", "mosaic", t, "rows",
                         lambda x, q, s, t=t, **kw: mgpu_gemm.fp8_gemm_t_mosaic(x, q, s, tiles=t, interpret=DRY, **kw)))
        for t in mosaic_variants("w8a16_gemm_pipelined", N, K, args.sweep):
            arms.append(("w8a16_gemm_pipelined", "mosaic", t, "blocks",
                         lambda x, q, s, t=t, **kw: mgpu_gemm.w8a16_gemm_pipelined_mosaic(x, q, s, tiles=t,
                                                                                             interpret=DRY, **kw)))

        if args.quick_quant:
            arms = [a for a in arms if a[0] == "xla_bf16" or a[0].startswith("quantize")]
            arms += [("quantize_rows fused", "triton", None, "rows",
                      lambda x, q, s: mgpu_gemm.quantize_rows_fused(x, interpret=DRY)),
                     ("quantize_blocks fused", "triton", None, "blocks",
                      lambda x, q, s: mgpu_gemm.quantize_blocks_fused_t(x, interpret=DRY))]
            for aq in ("xla", "fused"):
                arms.append(("fp8_gemm_t", "mosaic", f"default act_quant={aq}", "rows",
                             lambda x, q, s, aq=aq, **kw: mgpu_gemm.fp8_gemm_t_mosaic(x, q, s, act_quant=aq,
                                                                                    interpret=DRY, **kw)))
            arms.append(("w8a16_gemm_pipelined", "mosaic", "default act_quant=fused", "blocks",
                         lambda x, q, s, **kw: mgpu_gemm.w8a16_gemm_pipelined_mosaic(x, q, s, act_quant="fused",
                                                                                     interpret=DRY, **kw)))
            try:
                qx, qs = mgpu_gemm.quantize_rows_fused(x0, interpret=DRY)
                rx, rs = qf.quantize_rows_fp8(x0)
                bx, bs = mgpu_gemm.quantize_blocks_fused_t(x0, interpret=DRY)
                cx, cs = qf.quantize_rows_fp8_blocks(x0)
                result["shapes"][shape]["fused_quant_check"] = {
                    "rows_q_mismatch": float(jnp.mean(qx.view(jnp.uint8) != rx.view(jnp.uint8))),
                    "rows_scale_max_abs_diff": float(jnp.max(jnp.abs(qs - rs))),
                    "blocks_q_mismatch": float(jnp.mean(bx.view(jnp.uint8) != cx.view(jnp.uint8))),
                    "blocks_scale_max_abs_diff": float(jnp.max(jnp.abs(bs - cs.T)))}
                log("fused quantization vs XLA", result["shapes"][shape]["fused_quant_check"])
            except Exception:  # noqa: BLE001
                result["errors"].append({"shape": shape, "stage": "fused_quant_check",
                                         "traceback": traceback.format_exc()})
                log(traceback.format_exc())
        if args.only:
            arms = [a for a in arms if a[0] in args.only.split(",")]
        base_us = None
        for name, impl, cfg, fmt, fn in arms:
            def measure(row, name=name, impl=impl, fmt=fmt, fn=fn):
                nonlocal base_us
                # accuracy with a float32 output where the arm takes out_dtype (bf16 rounding hides ~1e-3)
                kw = {} if impl == "xla" or name.startswith("quantize") else {"out_dtype": jnp.float32}
                y = jax.block_until_ready(jax.jit(lambda *a: fn(*a, **kw))(x0, *W[fmt][0]))
                if not name.startswith("quantize") and fmt in refs:
                    row["rel_err"] = rel_err(y, refs[fmt])
                    row["finite"] = bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))
                tm = time_calls(fn, [(xs[i], *W[fmt][i % 2]) for i in range(4)])
                row.update(tm)
                row["TFLOPs"] = flops / tm["us"] / 1e6
                wbytes = sum(a.size * a.dtype.itemsize for a in W[fmt][0])
                row["bytes"] = wbytes + M * K * 2 + M * N * 2
                if name == "xla_bf16":
                    base_us = tm["us"]
                row["ratio_vs_xla_bf16"] = base_us / tm["us"] if base_us else None
                log(f"{shape:8s} {name:22s} {impl:7s} {row['config'][:60]:60s} {tm['us']:8.1f} us "
                    f"{row['TFLOPs']:6.0f} TF/s x{row['ratio_vs_xla_bf16'] or 0:.2f} err {row.get('rel_err', 0):.2e}")

            timed_row(result, save, {"shape": shape, "name": name, "impl": impl,
                                     "config": cfg if isinstance(cfg, str) else short(cfg), "format": fmt,
                                     "N": N, "K": K, "M": M, "flops": flops}, args.deadline, measure)

        if args.norm_fp8 and time.time() - T0 < args.deadline:
            norm_fused_rows(result, save, shape, N, K, flops, xs, W, args.deadline)

    try:
        if not DRY and not args.quick_quant:
            torch_context(result)
    except Exception:  # noqa: BLE001
        result["errors"].append({"stage": "torch", "traceback": traceback.format_exc()[-2000:]})
    save()
    print(markdown(result))


# ---- norm + projection (norm_fp8) -------------------------------------------------------------------------
GATED_GROUP = 1024     # Nemotron-H 8B: d_inner 8192 over n_groups 8
# the per-group gated kernel (one [rows, group] tile per program): elements per program, warps, grid order; the
# first is the default
GROUP_SWEEP = [norm_fp8.NormFp8Blocks(group_rows_elems=e, group_warps=w, groups_first=f)
               for e, w, f in ((4096, 4, True), (1024, 1, True), (2048, 2, True), (8192, 8, True), (4096, 4, False))]


def group_cfg(nb: norm_fp8.NormFp8Blocks) -> str:
    return f"{nb.group_rows_elems}/{nb.group_warps}{'' if nb.groups_first else ' rows first'}"


# fused norm configs timed alone (the first: one reshaped [1, 8192] tile per program, the kernel's first layout)
NORM_SWEEP = list(dict.fromkeys([
    norm_fp8.NormFp8Blocks(8192, 8, False), norm_fp8.NORM_FP8_BLOCKS, norm_fp8.NormFp8Blocks(8192, 4, True),
    norm_fp8.NormFp8Blocks(16384, 8, True), norm_fp8.NormFp8Blocks(4096, 4, True)]))


def norm_fused_rows(result, save, shape, N, K, flops, xs, W, deadline):
    """Norm + projection as the Mamba layer runs them at M rows: out_proj behind the gated RMSNorm (z: another
    of the 4 activation sets), in_proj behind the RMSNorm. bf16 norm + XLA BF16 (the baseline of this block),
    bf16 norm + FP8 arm (which quantizes), fused E4M3 norm + FP8 arm; then each FP8 arm alone on pre-quantized
    x (the GEMM the fused path leaves). Bits of the fused norm checked against norm + quant_formats."""
    nw = jax.random.uniform(jax.random.key(7), (K,), jnp.float32, 0.5, 1.5).astype(jnp.bfloat16)
    gated = shape == "out_proj"
    group = (256 if DRY else GATED_GROUP) if gated else K
    if gated:
        bf16_norm = lambda x, z: norms.gated_rmsnorm_pallas(x, z, nw, group_size=group, eps=1e-5, interpret=DRY)
        fp8_norm = lambda x, z, pb, pg=False, nb=None: norm_fp8.gated_rmsnorm_fp8_pallas(
            x, z, nw, group_size=group, eps=1e-5, per_block=pb, per_group=pg, interpret=DRY, nb=nb)
    else:
        bf16_norm = lambda x, z: norms.rmsnorm_pallas(x, nw, eps=1e-5, interpret=DRY)
        fp8_norm = lambda x, z, pb: norm_fp8.rmsnorm_fp8_pallas(x, nw, eps=1e-5, per_block=pb, interpret=DRY)
    gemm = {"rows": lambda x, q, s: mgpu_gemm.fp8_gemm_t_mosaic(x, q, s, interpret=DRY),
            "blocks": lambda x, q, s: mgpu_gemm.w8a16_gemm_pipelined_mosaic(x, q, s, interpret=DRY)}
    name = {"rows": "fp8_gemm_t", "blocks": "w8a16_gemm_pipelined"}
    zs = [xs[(i + 1) % 4] for i in range(4)]
    prefix = "gated_rmsnorm" if gated else "rmsnorm"
    arms = [(f"{prefix} + xla_bf16", "bf16", lambda x, z, w: xla_bf16(bf16_norm(x, z), w))]
    for fmt in ("rows", "blocks"):
        arms += [(f"{prefix} + {name[fmt]}", fmt, lambda x, z, q, s, f=fmt: gemm[f](bf16_norm(x, z), q, s)),
                 (f"{prefix}_fp8 + {name[fmt]}", fmt,
                  lambda x, z, q, s, f=fmt: gemm[f](fp8_norm(x, z, f == "blocks"), q, s))]
        if gated:       # scales per (row, norm group): the norm keeps the bf16 kernel's grid, the GEMM rescales
            arms += [(f"{prefix}_fp8 per-group + {name[fmt]}", fmt,
                      lambda x, z, q, s, f=fmt: gemm[f](fp8_norm(x, z, False, True), q, s))]
    for nb in (GROUP_SWEEP[1:] if gated else []):     # the other per-group configs, end to end
        arms += [(f"{prefix}_fp8 per-group {group_cfg(nb)} + fp8_gemm_t", "rows",
                  lambda x, z, q, s, nb=nb: gemm["rows"](fp8_norm(x, z, False, True, nb), q, s))]
    try:
        x0, z0 = xs[0], zs[0]
        modes = {"rows": (False, False), "blocks": (True, False)} | ({"group": (False, True)} if gated else {})
        y = bf16_norm(x0, z0)
        for mode, (pb, pg) in modes.items():
            got = fp8_norm(x0, z0, pb, pg) if gated else fp8_norm(x0, z0, pb)
            ref = qf.quantize_rows_fp8(y) if mode == "rows" else qf.quantize_rows_fp8_blocks(
                y, group if pg else qf.FP8_BLOCK)
            result["shapes"][shape][f"norm_fp8_check_{mode}"] = {
                "q_mismatch": float(jnp.mean(got.q.view(jnp.uint8) != ref[0].view(jnp.uint8))),
                "scale_max_rel_diff": float(jnp.max(jnp.abs(got.scale - ref[1]) / ref[1]))}
        pre = {f: [jax.block_until_ready(fp8_norm(xs[i], zs[i], f == "blocks")) for i in range(4)]
               for f in ("rows", "blocks")}
        if gated:
            pre["group"] = [jax.block_until_ready(fp8_norm(xs[i], zs[i], False, True)) for i in range(4)]
    except Exception:  # noqa: BLE001
        result["errors"].append({"shape": shape, "stage": "norm_fp8 setup", "traceback": traceback.format_exc()})
        log(traceback.format_exc())
        return
    rows = [(f"{prefix} alone (bf16 out)", "bf16", lambda x, z, w: bf16_norm(x, z), None)]
    for nb in NORM_SWEEP:                         # the fused norm alone, per kernel config (rows; default: blocks too)
        for pb in ((False, True) if nb == norm_fp8.NORM_FP8_BLOCKS else (False,)):
            if gated:
                f = lambda x, z, w, nb=nb, pb=pb: norm_fp8.gated_rmsnorm_fp8_pallas(
                    x, z, nw, group_size=group, eps=1e-5, per_block=pb, interpret=DRY, nb=nb)
            else:
                f = lambda x, z, w, nb=nb, pb=pb: norm_fp8.rmsnorm_fp8_pallas(x, nw, eps=1e-5, per_block=pb,
                                                                            interpret=DRY, nb=nb)
            rows.append((f"{prefix}_fp8 alone ({'blocks' if pb else 'rows'}) {nb}", "bf16", f, None))
    for nb in (GROUP_SWEEP if gated else []):       # the per-group kernel alone, per config
        f = lambda x, z, w, nb=nb: norm_fp8.gated_rmsnorm_fp8_pallas(x, z, nw, group_size=group, eps=1e-5,
                                                                     per_block=False, per_group=True,
                                                                     interpret=DRY, nb=nb)
        rows.append((f"{prefix}_fp8 alone (per group) {group_cfg(nb)}", "bf16", f, None))
    rows = [(n, fmt, fn, [(xs[i], zs[i], *W[fmt][i % 2]) for i in range(4)]) for n, fmt, fn, _ in rows]
    rows += [(n, fmt, fn, [(xs[i], zs[i], *W[fmt][i % 2]) for i in range(4)]) for n, fmt, fn in arms]
    rows += [(f"{name[f]} on pre-quantized x (Fp8Activations)", f, gemm[f],
              [(pre[f][i], *W[f][i % 2]) for i in range(4)]) for f in ("rows", "blocks")]
    rows += [(f"{name[f]} on pre-quantized x per norm group (Fp8Activations)", f, gemm[f],
              [(pre["group"][i], *W[f][i % 2]) for i in range(4)]) for f in (("rows", "blocks") if gated else ())]
    outs, base = {}, None
    for n, fmt, fn, sets in rows:
        def measure(row, n=n, fmt=fmt, fn=fn, sets=sets):
            nonlocal base
            outs[n] = y = jax.block_until_ready(jax.jit(fn)(*sets[0]))
            twin = f"{prefix} + {name.get(fmt, '')}"
            if n != twin and twin in outs:
                row["rel_err_vs_unfused"] = rel_err(y, outs[twin])
            tm = time_calls(fn, sets)
            row.update(tm)
            row["TFLOPs"] = flops / tm["us"] / 1e6
            base = tm["us"] if n.endswith("xla_bf16") else base
            if "+" in n:
                row["ratio_vs_norm_xla_bf16"] = base / tm["us"] if base else None
            elif "alone" in n:
                row["bytes"] = (2 if gated else 1) * M * K * 2 + M * K * (2 if "bf16" in n else 1)
                row["GBps"] = row["bytes"] / tm["us"] / 1e3
            else:                                        # the GEMM alone: against the plain XLA BF16 matmul row
                gemm_base = [r["us"] for r in result["rows"] if r["shape"] == shape and r["name"] == "xla_bf16"
                             and "us" in r]
                row["ratio_vs_xla_bf16"] = gemm_base[0] / tm["us"] if gemm_base else None
            log(f"{shape:8s} {n:50s} {tm['us']:8.1f} us", {k: v for k, v in row.items() if k.startswith("ratio")})

        impl = "layer" if "+" in n else "norm" if "alone" in n else "mosaic"
        timed_row(result, save, {"shape": shape, "name": n, "impl": impl, "config": "norm_fp8", "format": fmt,
                                 "N": N, "K": K, "M": M, "flops": flops}, deadline, measure)


# ---- NVFP4 transposed (w4a16_gemm_t / _m128) ------------------------------------------------------------------
def nvfp4_weights(key, N, K):
    """Random NVFP4 transposed weights: packed_t uint8 [K/2, N] (all 256 codes), scale_t E4M3 [K/16, N] in
    [0.25, 4), global 0.01 (timing and accuracy do not need a real quantized matrix)."""
    kp, ks = jax.random.split(key)
    pt = jax.random.randint(kp, (K // 2, N), 0, 256, jnp.int32).astype(jnp.uint8)
    st = jax.random.uniform(ks, (K // 16, N), minval=0.25, maxval=4.0).astype(jnp.float8_e4m3fn)
    return pt, st, jnp.float32(0.01)


def dequant_xla_dot(x, pt, st, g):
    """Baseline: dequantize the whole weight to bf16 with XLA (one pass), then XLA's bf16 dot."""
    w = qf.dequantize_nvfp4(pt.T, st.T, g).astype(jnp.bfloat16)          # [N, K] (exact in bf16 up to g)
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))


def nvfp4_variants(sweep: bool) -> list:
    """Launch neighbours of the plain arm's default (with --sweep)."""
    out = []
    if sweep:
        out += [Nvfp4Tiles(tile_m=128, stages=4), Nvfp4Tiles(tile_m=128, stages=3),
                Nvfp4Tiles(tile_m=256, stages=2), Nvfp4Tiles(tile_m=256, stages=2, grid_minor="n", grid_tile_width=16),
                Nvfp4Tiles(tile_m=256, stages=2, grid_minor="n", grid_tile_width=4)]
    return out


def short_nv(t) -> str:
    if t is None:
        return "default"
    return f"tm{t.tile_m} st{t.stages} {t.grid_minor}{t.grid_tile_width}"


def nvfp4_main(args, result, save, key):
    """Per shape: reference check (f32 out vs dequantize + f32 HIGHEST matmul), then 4 distinct calls per timing."""
    result["nvfp4"] = True
    for shape in args.shapes.split(","):
        N, K = SHAPES[shape]
        flops = 2 * M * N * K
        result["shapes"][shape] = {"N": N, "K": K, "M": M, "flops": flops,
                                   "default_tiles": short_nv(mgpu_gemm_nvfp4.default_tiles(M, N, K))}
        log(f"== nvfp4 {shape} N={N} K={K} M={M}")
        try:
            kx, kw, key = jax.random.split(key, 3)
            xs = [jax.random.normal(k, (M, K), jnp.bfloat16) for k in jax.random.split(kx, 4)]
            W = [nvfp4_weights(k, N, K) for k in jax.random.split(kw, 2)]
            wb = [(qf.dequantize_nvfp4(pt.T, st.T, 1.0).astype(jnp.bfloat16),) for pt, st, _ in W]
            P = [mgpu_gemm_nvfp4.prepare_weights(pt, st) + (g,) for pt, st, g in W]
            plain = [(pt.T, st.T, g) for pt, st, g in W]                  # the decode layout [N, K/2], [N, K/16]
            x0 = xs[0]
            ref = w4a16.w4a16_t_reference(x0, *W[0], out_dtype=jnp.float32)
            jax.block_until_ready((xs, W, wb, P, plain, ref))
        except Exception:  # noqa: BLE001
            result["errors"].append({"shape": shape, "stage": "setup", "traceback": traceback.format_exc()})
            log(traceback.format_exc())
            save()
            continue
        sets = {"w": lambda i: (xs[i], *W[i % 2]), "bf16": lambda i: (xs[i], *wb[i % 2]),
                "prep": lambda i: (xs[i], *P[i % 2]), "plain": lambda i: (xs[i], *plain[i % 2])}
        arms = [("xla_bf16", "xla", "bf16 weight [N, K]", "bf16", xla_bf16),
                ("dequant+xla_dot", "xla", "dequantize to bf16, then dot", "w", dequant_xla_dot)]
        if not args.no_triton:
            arms.append(("w4a16_gemm_t_m128", "triton", "default", "w",
                         lambda x, p, s, g, **kw: w4a16.w4a16_gemm_t_m128_pallas(x, p, s, g, interpret=DRY, **kw)))
        arms += [("w4a16_gemm_t prepared", "mosaic", "default; weights relaid out once (not timed)", "prep",
                  lambda x, p, s, g, **kw: mgpu_gemm_nvfp4.w4a16_gemm_t_prepared(x, p, s, g, interpret=DRY, **kw)),
                 ("w4a16_gemm (plain layout)", "mosaic", "default; packed [N, K/2] as is, scales relaid out", "plain",
                  lambda x, p, s, g, **kw: mgpu_gemm_nvfp4.w4a16_gemm_mosaic(x, p, s, g, interpret=DRY, **kw)),
                 ("weight relayout (part of the Mosaic arm)", "xla", "", "w",
                  lambda x, p, s, g: mgpu_gemm_nvfp4.prepare_weights(p, s))]
        arms.insert(len(arms) - 1, ("w4a16_gemm_t", "mosaic", "default; packed_t transposed back per call", "w",
                                    lambda x, p, s, g, **kw: mgpu_gemm_nvfp4.w4a16_gemm_t_mosaic(x, p, s, g,
                                                                                               interpret=DRY, **kw)))
        for t in nvfp4_variants(args.sweep):
            arms.append(("w4a16_gemm (plain layout)", "mosaic", short_nv(t), "plain",
                         lambda x, p, s, g, t=t, **kw: mgpu_gemm_nvfp4.w4a16_gemm_mosaic(x, p, s, g, tiles=t,
                                                                                          interpret=DRY, **kw)))
        if args.only:
            arms = [a for a in arms if a[0] in args.only.split(",")]
        base_us = None
        for name, impl, cfg, fmt, fn in arms:
            def measure(row, name=name, impl=impl, cfg=cfg, fmt=fmt, fn=fn):
                nonlocal base_us
                part = "part of" in name
                if not part:
                    kw = {} if impl == "xla" else {"out_dtype": jnp.float32}
                    try:
                        y = jax.block_until_ready(jax.jit(lambda *a: fn(*a, **kw))(*sets[fmt](0)))
                    except ShapeError:     # f32 staging does not fit these tiles' shared memory: check in bf16
                        row["check_dtype"] = "bfloat16"
                        y = jax.block_until_ready(jax.jit(fn)(*sets[fmt](0)))
                    if fmt != "bf16":
                        row["rel_err"] = rel_err(y, ref)
                    row["finite"] = bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))
                tm = time_calls(fn, [sets[fmt](i) for i in range(4)])
                row.update(tm)
                row["TFLOPs"] = flops / tm["us"] / 1e6
                if name == "xla_bf16":
                    base_us = tm["us"]
                row["ratio_vs_xla_bf16"] = base_us / tm["us"] if base_us and not part else None
                log(f"{shape:8s} {name:42s} {impl:7s} {cfg[:44]:44s} {tm['us']:8.1f} us "
                    f"x{row['ratio_vs_xla_bf16'] or 0:.2f} err {row.get('rel_err', 0):.2e}")

            timed_row(result, save, {"shape": shape, "name": name, "impl": impl, "config": cfg,
                                     "format": "nvfp4_t/" + fmt, "N": N, "K": K, "M": M, "flops": flops},
                      args.deadline, measure)
    try:
        if not DRY:
            torch_context(result)
    except Exception:  # noqa: BLE001
        result["errors"].append({"stage": "torch", "traceback": traceback.format_exc()[-2000:]})
    save()


def torch_context(result):
    """cuBLAS BF16 and torch._scaled_mm FP8 at the same shapes, for context."""
    import torch
    from triton.testing import do_bench
    out = {}
    for shape in result["shapes"]:
        N, K = SHAPES[shape]
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        out[f"{shape}_bf16_us"] = do_bench(lambda: x @ w.T, return_mode="median") * 1e3
        w8, x8 = w.to(torch.float8_e4m3fn), x.to(torch.float8_e4m3fn)
        sa = torch.ones((M, 1), device="cuda")
        sb = torch.ones((1, N), device="cuda")
        out[f"{shape}_fp8_rowwise_us"] = do_bench(
            lambda: torch._scaled_mm(x8, w8.T, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16),
            return_mode="median") * 1e3
    result["torch_context"] = out
    log("torch", out)


def markdown(result) -> str:
    lines = [f"# Prefill GEMMs M={result['M']}, {result['device']}, {result['date']} ({result['variant']})", "",
             f"versions: {result['versions']}", "",
             "| shape | kernel | impl | config | us | TFLOP/s | x XLA BF16 | rel err |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "us" in r:
            ratio = (f"{r['ratio_vs_xla_bf16']:.2f}" if r.get("ratio_vs_xla_bf16") else
                     f"{r['ratio_vs_norm_xla_bf16']:.2f} vs norm + XLA BF16" if r.get("ratio_vs_norm_xla_bf16") else "")
            err = r.get("rel_err", r.get("rel_err_vs_unfused", float("nan")))
            lines.append(f"| {r['shape']} | {r['name']} | {r['impl']} | {r['config']} | {r['us']:.1f} | "
                         f"{r['TFLOPs']:.0f} | {ratio} | {err:.2e} |")
        else:
            lines.append(f"| {r['shape']} | {r['name']} | {r['impl']} | {r['config']} | "
                         f"{r.get('skipped') or 'FAILED'} | | | |")
    if "torch_context" in result:
        lines += ["", f"torch context (do_bench median, us): {result['torch_context']}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
