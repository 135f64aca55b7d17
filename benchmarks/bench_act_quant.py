"""Fused FP8 activation quantizers (pallas_kernels/mgpu_gemm.py) over their block configs, against XLA's passes.

Shapes: the prefill activations of the 8B Mamba projections at M = 4096 (in_proj x [4096, 4096], out_proj
x [4096, 8192]). Each config's E4M3 bits and scales are checked against quant_formats first; bytes moved = read
x (bf16) + write E4M3 + scales; baseline in the same run: XLA's quantize_rows_fp8 / quantize_rows_fp8_blocks.
Then the Mosaic GEMM arms (fp8_gemm_t, w8a16_gemm_pipelined) with XLA, the default and the best fused
quantizer, against the XLA BF16 matmul of the same shape (issue #4's prefill target: >= 1.6x).

    PYTHONPATH=. python benchmarks/bench_act_quant.py [--out DIR] [--interpret]
writes DIR/act_quant.json (DIR default benchmarks/results; the date is in the JSON; --interpret: act_quant_dry.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os

import jax
import jax.numpy as jnp

from benchmarks import timing
from benchmarks.bench_prefill import xla_bf16
from metrale_jax.weights import quant_formats as qf
from pallas_kernels import mgpu_gemm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {"in_proj": (4096, 4096, 18560), "out_proj": (4096, 8192, 4096)}      # M, K, N
ROWS = [(4096, 4), (4096, 8), (8192, 4), (8192, 8), (16384, 8), (16384, 16), (32768, 8), (32768, 16)]  # elems, warps
BLOCKS = [(32, 4), (64, 4), (128, 4), (128, 8), (256, 8)]                                        # rows, warps


def _same_bits(got, want) -> bool:
    (gq, gs), (wq, ws) = got, want
    return bool(jnp.all(gq.view(jnp.uint8) == wq.view(jnp.uint8))) and bool(jnp.all(gs == ws))


def _gemms(sets, N, best_qb, dry, reps):
    """fp8_gemm_t / w8a16_gemm_pipelined Mosaic arms by quantizer, against the XLA BF16 matmul."""
    K = sets[0][0].shape[1]
    w = jax.random.normal(jax.random.PRNGKey(1), (N, K), jnp.bfloat16) * 0.02
    wq, ws = qf.quantize_rows_fp8(w)
    bq, bs = qf.quantize_fp8_block(w)
    wd = w.astype(jnp.bfloat16)
    # dry run: small tiles, one N tile; no block-scaled arm (queued calls of it deadlock GPU interpret mode;
    # on the H200 it is correct at the 8B shapes, and tests/kernels/test_mgpu_gemm.py interprets it alone)
    t_rows = mgpu_gemm.MgpuTiles(64, 64, "m", stages=2) if dry else None
    t_blocks = mgpu_gemm.MgpuTiles(64, 128, "m", stages=2) if dry else None
    arms = [("xla_bf16", "", lambda x: xla_bf16(x, wd))]             # bench_prefill's baseline (bf16 out)
    for aq, qb in (("xla", None), ("fused", None), ("fused", best_qb.get("rows"))):
        arms.append(("fp8_gemm_t", f"act_quant={aq} qb={qb}",
                     lambda x, aq=aq, qb=qb: mgpu_gemm.fp8_gemm_t_mosaic(x, wq, ws, act_quant=aq, qb=qb,
                                                                        tiles=t_rows, interpret=dry)))
    for aq, qb in (() if dry else (("fused", None), ("fused", best_qb.get("blocks")))):
        arms.append(("w8a16_gemm_pipelined", f"act_quant={aq} qb={qb}",
                     lambda x, aq=aq, qb=qb: mgpu_gemm.w8a16_gemm_pipelined_mosaic(x, bq, bs, act_quant=aq,
                                                                                   qb=qb, tiles=t_blocks,
                                                                                   interpret=dry)))
    out, base = ([{"kernel": "w8a16_gemm_pipelined", "skipped": "dry run (GPU interpret mode)"}] if dry else []), None
    for name, cfg, fn in arms:
        entry = {"kernel": name, "config": cfg}
        try:
            us = min(timing.queued_wall_us(fn, sets, reps=max(1, reps // 4)))
            base = base or us
            entry.update(us=us, x_xla_bf16=base / us)
        except Exception as e:  # noqa: BLE001
            entry["error"] = repr(e)[:300]
        out.append(entry)
        print("  gemm", entry, flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--interpret", action="store_true", help="a CPU dry run: small shapes, two configs")
    args = ap.parse_args()
    dry = args.interpret
    shapes = {"tiny": (128, 256, 128)} if dry else SHAPES     # one N tile: see _gemms
    rows_cfgs, block_cfgs = (ROWS[:2], BLOCKS[:2]) if dry else (ROWS, BLOCKS)
    reps = 1 if dry else 20
    result = {"device": str(jax.devices()[0].device_kind), "date": datetime.date.today().isoformat(),
              "versions": {"jax": jax.__version__}, "method": __doc__.split("\n\n")[1], "shapes": {}}
    for name, (M, K, N) in shapes.items():
        key = jax.random.PRNGKey(0)
        sets = [(jax.random.normal(jax.random.fold_in(key, i), (M, K), jnp.bfloat16) * (1 + i),) for i in range(4)]
        x0 = sets[0][0]
        nbytes = M * K * 3 + M * 4
        rows_ref, blocks_ref = qf.quantize_rows_fp8(x0), qf.quantize_rows_fp8_blocks(x0)
        blocks_ref = (blocks_ref[0], blocks_ref[1].T)
        arms = [("rows", "xla", None, qf.quantize_rows_fp8, None),
                ("blocks", "xla", None, qf.quantize_rows_fp8_blocks, None)]
        for e, w in rows_cfgs:
            qb = dataclasses.replace(mgpu_gemm.ACT_QUANT_BLOCKS, rows_elems=e, rows_warps=w)
            arms.append(("rows", "fused", {"rows_per_program": max(1, e // K), "warps": w},
                         lambda x, qb=qb: mgpu_gemm.quantize_rows_fused(x, qb=qb, interpret=dry), rows_ref))
        for r, w in block_cfgs:
            qb = dataclasses.replace(mgpu_gemm.ACT_QUANT_BLOCKS, blocks_rows=r, blocks_warps=w)
            arms.append(("blocks", "fused", {"rows_per_program": r, "warps": w},
                         lambda x, qb=qb: mgpu_gemm.quantize_blocks_fused_t(x, qb=qb, interpret=dry), blocks_ref))
        rows = []
        for kind, impl, cfg, fn, ref in arms:
            entry = {"kind": kind, "impl": impl, "config": cfg}
            try:
                if ref is not None:
                    entry["bits_match_xla"] = _same_bits(fn(x0), ref)
                us = min(timing.queued_wall_us(fn, sets, reps=reps))
                entry.update(us=us, gbps=nbytes / us / 1e3)
            except Exception as e:  # noqa: BLE001  (a config the compiler refuses is recorded, not fatal)
                entry["error"] = repr(e)[:300]
            rows.append(entry)
            print(name, entry, flush=True)
        result["shapes"][name] = {"M": M, "K": K, "N": N, "bytes": nbytes, "arms": rows}
        best_qb = {}
        for kind in ("rows", "blocks"):
            base = next(r["us"] for r in rows if r["kind"] == kind and r["impl"] == "xla" and "us" in r)
            ok = [r for r in rows if r["kind"] == kind and r["impl"] == "fused" and r.get("bits_match_xla")]
            for r in ok:
                r["x_xla"] = base / r["us"]
            best = min(ok, key=lambda r: r["us"], default=None)
            print(f"{name} {kind}: xla {base:.1f} us; best fused {best and best['config']} "
                  f"{best and round(best['us'], 1)} us ({best and round(best['gbps'])} GB/s)", flush=True)
            if best is not None:
                c = best["config"]
                best_qb[kind] = (dataclasses.replace(mgpu_gemm.ACT_QUANT_BLOCKS, rows_elems=c["rows_per_program"] * K,
                                                     rows_warps=c["warps"]) if kind == "rows" else
                                 dataclasses.replace(mgpu_gemm.ACT_QUANT_BLOCKS, blocks_rows=c["rows_per_program"],
                                                     blocks_warps=c["warps"]))
        result["shapes"][name]["gemms"] = _gemms(sets, N, best_qb, dry, reps)
        _save(result, args.out, dry)


def _save(result, out, dry):
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"act_quant{'_dry' if dry else ''}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path, flush=True)


if __name__ == "__main__":
    main()
