"""Launch configs of the NVFP4 prefill GEMM (`w4a16_gemm` Mosaic arm) at the 8B shapes, M = 4096, on the GPU:
each config (tm<rows>:st<stages>:<grid minor><tile width>) and XLA BF16 timed in interleaved rounds, so all see
the same clocks. Before timing, every config's bf16 output is checked against the reference.
Writes OUT/nvfp4_probe.json (the date is in it).

    PYTHONPATH=. python3 benchmarks/probes/nvfp4_probe.py --out $OUT --configs tm256:st2:n8,tm128:st4:m8

--ref-module FILE loads another copy of the kernel module (e.g. `git show REV:pallas_kernels/mgpu_gemm_nvfp4.py`);
configs written ref:<config> run on it, in the same rounds (an A/B against an earlier version).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys

import jax
import jax.numpy as jnp

from benchmarks import timing
from benchmarks.bench_prefill import SHAPES, nvfp4_weights, xla_bf16
from metrale_jax.weights import quant_formats as qf
from pallas_kernels import mgpu_gemm_nvfp4 as mn
from pallas_kernels.w4a16 import w4a16_reference

M = 4096


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("nvfp4_ref_module", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod            # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def parse(cfg: str, mod=mn):
    tm, st, grid = cfg.split(":")
    return mod.Nvfp4Tiles(tile_m=int(tm[2:]), stages=int(st[2:]), grid_minor=grid[0], grid_tile_width=int(grid[1:]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", required=True, help="comma-separated tm<rows>:st<stages>:<m|n><width>")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--ref-module", help="another copy of mgpu_gemm_nvfp4.py for the ref:<config> entries")
    args = ap.parse_args()
    ref_mod = load_module(args.ref_module) if args.ref_module else None
    result = {"date": datetime.date.today().isoformat(), "device": str(jax.devices()[0]),
              "ref_module": args.ref_module,
              "versions": {"jax": jax.__version__}, "M": M, "rounds": args.rounds, "rows": []}
    for shape, (N, K) in SHAPES.items():
        key = jax.random.PRNGKey(0)
        kx, kw = jax.random.split(key)
        xs = [jax.random.normal(k, (M, K), jnp.bfloat16) for k in jax.random.split(kx, 4)]
        W = [nvfp4_weights(k, N, K) for k in jax.random.split(kw, 2)]
        plain = [(pt.T, st.T, g) for pt, st, g in W]
        wb = [qf.dequantize_nvfp4(pt.T, st.T, 1.0).astype(jnp.bfloat16) for pt, st, _ in W]
        arms = {"xla_bf16": (xla_bf16, [(xs[i], wb[i % 2]) for i in range(4)])}
        for cfg in args.configs.split(","):
            mod = ref_mod if cfg.startswith("ref:") else mn
            if mod is None:
                raise SystemExit(f"config {cfg!r} needs --ref-module")
            t = parse(cfg.removeprefix("ref:"), mod)
            arms[cfg] = (lambda x, p, s, g, t=t, mod=mod: mod.w4a16_gemm_mosaic(x, p, s, g, tiles=t),
                         [(xs[i], *plain[i % 2]) for i in range(4)])
        ref = w4a16_reference(xs[0], *plain[0], out_dtype=jnp.float32)
        checks = {}
        for cfg in args.configs.split(","):
            y = jax.block_until_ready(jax.jit(arms[cfg][0])(*arms[cfg][1][0])).astype(jnp.float32)
            checks[cfg] = {"rel_err": float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref)),
                           "finite": bool(jnp.all(jnp.isfinite(y)))}
            print(f"{shape:8s} {cfg:28s} check {checks[cfg]}", flush=True)
        walls = timing.interleaved_rounds(arms, args.rounds)
        base = min(walls["xla_bf16"])
        for name, us in walls.items():
            row = {"shape": shape, "N": N, "K": K, "config": name, "us_rounds": us, "us": min(us),
                   "ratio_vs_xla_bf16": base / min(us), "flops": 2 * M * N * K, **checks.get(name, {})}
            result["rows"].append(row)
            print(f"{shape:8s} {name:28s} {min(us):8.1f} us x{base / min(us):.2f}  rounds {[round(u, 1) for u in us]}",
                  flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "nvfp4_probe.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
