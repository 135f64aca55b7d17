"""Routed-expert matmuls kept quantized (pallas_kernels/grouped.py) against XLA's dense ragged matmul.

Shapes: Nemotron-3-Nano-30B-A3B MoE (E=128 experts, top-6, hidden 2688, expert intermediate 1856): the up
projection [E, 1856, 2688] and the down projection [E, 2688, 1856] over the token-expert pairs of T tokens
(T*6 rows sorted by expert), T = 1, 32 (decode) and 4096 (prefill). Baselines in the same run: XLA
`ragged_dot_general` on the BF16 experts, and the copy bandwidth (bytes floor = the experts' weight bytes
touched: every expert that got a row, once). Each kernel is checked against its reference first.

    PYTHONPATH=. python benchmarks/bench_moe.py [--out DIR] [--tokens 1,32,4096]
writes DIR/moe.json (DIR default benchmarks/results; the date is in the JSON; --interpret: moe_interpret.json).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from metrale_jax.weights import quant_formats as qf
from pallas_kernels import grouped

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E, TOP_K, HIDDEN, INTER = 128, 6, 2688, 1856
PROJ = {"up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}


def wall_us(fn, args, variants: int = 8, reps: int = 4) -> float:
    """Microseconds per call: `variants` calls with distinct copies of the first argument queued in one
    executable (benchmarks/timing.py), best of 3 trials."""
    sets = [(args[0] * (1 + i / 64), *args[1:]) for i in range(variants)]
    return min(timing.queued_wall_us(fn, sets, reps=reps))


def copy_bytes_per_s() -> float:
    x = jax.random.normal(jax.random.key(0), (1 << (28 if jax.default_backend() == "gpu" else 20),), jnp.float32)
    return 2 * x.nbytes / (wall_us(lambda a: a * 1.0001 + 1.0, (x,)) * 1e-6)


def experts(N, K, key, distinct: int = 16):
    """Random experts: dense bf16, block FP8 and NVFP4, `distinct` of them quantized on the host and tiled
    to E (each copy its own device memory, so nothing is served from L2 that a real model would not be)."""
    rng = np.random.default_rng(key)
    dense = (rng.standard_normal((distinct, N, K), np.float32) * K ** -0.5)
    fp8 = [qf.quantize_fp8_block(w) for w in dense]
    nv = [qf.quantize_nvfp4(w) for w in dense]
    tile = lambda a: jnp.tile(jnp.asarray(a), (E // distinct,) + (1,) * (np.ndim(a) - 1))
    return (tile(dense.astype(jnp.bfloat16)),
            (tile(np.stack([q for q, _ in fp8])), tile(np.stack([s for _, s in fp8]))),
            tuple(tile(np.stack([a[i] for a in nv])) for i in range(3)))


def routing(T, rng):
    """Group sizes of T tokens x TOP_K distinct random experts each."""
    choice = np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(T)])
    return jnp.asarray(np.bincount(choice.reshape(-1), minlength=E), jnp.int32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--tokens", default="1,32,4096")
    ap.add_argument("--interpret", action="store_true", help="a CPU dry run: small shapes, interpret mode")
    args = ap.parse_args()
    global HIDDEN, INTER, PROJ
    if args.interpret:
        HIDDEN, INTER = 128, 64
        PROJ = {"up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}
    w8 = functools.partial(grouped.w8a16_grouped_pallas, interpret=args.interpret)
    w4 = functools.partial(grouped.w4a16_grouped_pallas, interpret=args.interpret)
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": jax.devices()[0].device_kind,
           "jax": jax.__version__, "python": platform.python_version(),
           "shapes": {"experts": E, "top_k": TOP_K, "hidden": HIDDEN, "intermediate": INTER}, "results": [],
           "errors": {}}
    bw = copy_bytes_per_s()
    out["copy_bytes_per_s"] = bw
    print(f"copy {bw / 1e9:,.0f} GB/s", flush=True)
    rng = np.random.default_rng(0)
    dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                             lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))
    xla = lambda x, w, g: jax.lax.ragged_dot_general(x, w, g, dims, preferred_element_type=jnp.float32)
    for proj, (N, K) in PROJ.items():
        dense, (q, s), (p, sc, gs) = experts(N, K, hash(proj) % 1000)
        for T in (int(t) for t in args.tokens.split(",")):
            sizes = routing(T, rng)
            used = int((np.asarray(sizes) > 0).sum())
            x = jnp.asarray(rng.standard_normal((T * TOP_K, K)), jnp.bfloat16)
            arms = {"xla_bf16_ragged_dot": (xla, (x, dense, sizes), used * N * K * 2),
                    "w8a16_grouped": (w8, (x, q, s, sizes), used * N * K),
                    "w4a16_grouped": (w4, (x, p, sc, gs, sizes),
                                      used * N * (K // 2 + K // 16))}
            refs = {"w8a16_grouped": grouped.w8a16_grouped_reference, "w4a16_grouped": grouped.w4a16_grouped_reference}
            row = {"proj": proj, "N": N, "K": K, "tokens": T, "rows": T * TOP_K, "experts_used": used, "arms": {}}
            for name, (fn, a, nbytes) in arms.items():
                try:
                    err = None
                    if name in refs:
                        y, want = fn(*a), refs[name](*a)
                        err = float(jnp.linalg.norm(y - want) / jnp.linalg.norm(want))
                        if not err < 1e-3:
                            raise AssertionError(f"{name}: rel err {err:.2e} vs its reference")
                    us = wall_us(fn, a)
                    row["arms"][name] = {"us": us, "weight_bytes": nbytes, "floor_us": nbytes / bw * 1e6,
                                         "of_copy_bw": nbytes / bw * 1e6 / us, "rel_err": err,
                                         "flops": 2 * T * TOP_K * N * K}
                except Exception as e:                      # keep the other arms' numbers
                    out["errors"][f"{proj}/{T}/{name}"] = f"{type(e).__name__}: {e}"
                    traceback.print_exc()
            base = row["arms"].get("xla_bf16_ragged_dot", {}).get("us")
            for a in row["arms"].values():
                a["vs_xla_bf16"] = base / a["us"] if base else None
            out["results"].append(row)
            print(f"{proj} T={T}: " + ", ".join(f"{n} {a['us']:.1f} us ({a['of_copy_bw']:.0%} of copy)"
                                                for n, a in row["arms"].items()), flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"moe{'_interpret' if args.interpret else ''}.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
