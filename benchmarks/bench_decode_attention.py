"""Decode attention over the key/value pool in place (pallas_kernels/attention.py) against its reference.

Shapes: one attention layer of Nemotron-H-8B (32 query heads, 8 kv heads, head_dim 128, bf16 pools), B rows each
holding `held` positions of a slot in a pool of max_len positions (held + 64, or 8,192: short rows in a long
pool). Arms: the reference (the slot gathered whole, masked; what XLA runs without the kernel) and the Pallas
kernel over a few configs (the first is the frozen default; the others without or with other pieces of the slot
per program). Each arm's output is checked against the reference first. Times: wall us per call (calls queued in
one executable) and GPU kernel us from a profiler trace. Floor: the keys and values the rows hold, read once, at
the copy bandwidth measured in the same run.

    PYTHONPATH=. python benchmarks/bench_decode_attention.py [--out FILE] [--interpret]
writes FILE (default benchmarks/results/decode_attention.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import timing
from benchmarks.bench_runtime import copy_bandwidth
from pallas_kernels import attention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KVH, G, HD = 8, 4, 128
C = attention.DecodeAttentionConfig
CONFIGS = [attention.CONFIG, C(64, 4, None), C(64, 4, 256), C(64, 4, 1024)]


def case(B: int, held: int, L: int, key: int, sets: int = 4):
    """`sets` distinct queries [B, KVH, G, HD] and one pool pair [1, B, L, KVH, HD] (bf16); slots permuted."""
    rng = np.random.default_rng(key)
    k, v = (jax.random.normal(jax.random.key(key + i), (1, B, L, KVH, HD), jnp.bfloat16) for i in range(2))
    slots = jnp.asarray(rng.permutation(B), jnp.int32)
    limit = jnp.full((B,), held, jnp.int32)
    qs = [jnp.asarray(rng.standard_normal((B, KVH, G, HD)), jnp.bfloat16) for _ in range(sets)]
    return [(q, k, v, slots, limit) for q in qs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "decode_attention.json"))
    ap.add_argument("--interpret", action="store_true", help="a CPU dry run: small shapes, the default config")
    args = ap.parse_args()
    dry = args.interpret
    grid = [(2, 600, 664)] if dry else [(1, 128, 192), (1, 128, 8192), (1, 2048, 2112), (1, 8192, 8256),
                                       (8, 2048, 2112), (256, 128, 192), (256, 128, 8192), (256, 2048, 2112)]
    configs = CONFIGS[:1] if dry else CONFIGS
    bw = copy_bandwidth()
    scale = HD ** -0.5
    rows = []
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": jax.devices()[0].device_kind,
           "jax": jax.__version__, "python": platform.python_version(), "copy_bytes_per_s": bw,
           "shapes": {"kv_heads": KVH, "q_per_kv": G, "head_dim": HD, "pool_dtype": "bfloat16"}, "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for B, held, max_len in grid:
        sets = case(B, held, max_len, key=B * 7 + held)
        floor_bytes = B * held * KVH * HD * 2 * 2 + sets[0][0].nbytes + B * KVH * G * HD * 4
        row = {"batch": B, "held": held, "max_len": max_len, "floor_us": floor_bytes / bw * 1e6, "bytes": floor_bytes,
               "arms": {}}
        ref = lambda q, k, v, s, n: attention.decode_attention_reference(q, k, v, s, n, layer=0, scale=scale)
        want = np.asarray(ref(*sets[0]))
        arms = {"reference": ref}
        for c in configs:
            arms[f"pallas block_k={c.block_k} warps={c.num_warps} split={c.split_positions}"] = (
                lambda q, k, v, s, n, c=c: attention.decode_attention_pallas(q, k, v, s, n, layer=0, scale=scale,
                                                                             interpret=dry, config=c))
        for name, fn in arms.items():
            entry = {}
            try:
                got = np.asarray(fn(*sets[0]))
                entry["rel_err_vs_reference"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
                entry.update(timing.wall_and_traced_us(fn, sets, reps=2 if dry else 20, trace=not dry))
                entry["floor_fraction"] = row["floor_us"] / entry["us"]
            except Exception as e:  # noqa: BLE001  (an arm that fails is recorded, the others still run)
                entry["error"] = repr(e)[:300]
            row["arms"][name] = entry
            print(f"B={B} held={held} max_len={max_len} {name}: {entry}", flush=True)
        rows.append(row)
        with open(args.out, "w") as f:                  # after every row: a cut-off run keeps what it measured
            json.dump(out, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
