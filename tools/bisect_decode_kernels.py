"""Which decode kernel changed the tokens between two trees: this tree's conv update and decode attention (the
step's keys / values appended by the kernel) against an earlier tree's (an XLA scatter, then its kernel, its
float32 output rounded by XLA) on the same random inputs, bitwise.

On a GPU, from the repository root, with the earlier tree unpacked first (`mkdir -p ab_base && git archive REV |
tar -x -C ab_base`, carried to the device):
    PYTHONPATH=. python3 tools/bisect_decode_kernels.py ab_base            # Nemotron-H-8B shapes, B = 1 / 64 / 256
    JAX_PLATFORMS=cpu PYTHONPATH=. python3 tools/bisect_decode_kernels.py ab_base --tiny   # interpret mode
Prints per kernel and batch whether the outputs (and pools) are the same bits, else the share that differs and
the largest difference. For earlier trees whose two kernels take the arguments they take at 4418f8e.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
BF16 = jnp.bfloat16


def _load(name: str, path: pathlib.Path):
    """A kernel module of the earlier tree under its own name; its registry entries are not registered (this
    tree's stay in force)."""
    from pallas_kernels import registry

    register, registry.register = registry.register, lambda *a, **k: None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        registry.register = register


def _differ(label: str, a, b) -> str:
    a, b = (np.asarray(jnp.asarray(x).astype(jnp.float32)) for x in (a, b))
    if np.array_equal(a, b, equal_nan=True):
        return f"{label} same bits"
    return f"{label} DIFFER ({np.mean(a != b):.3%} of entries, max |diff| {np.nanmax(np.abs(a - b)):.3g})"


def conv(old, new, rng, B: int, C: int, x_col: int, interpret: bool) -> str:
    """The conv update at B rows of a pool with a padding row (skipped) and one spare."""
    pool = jnp.asarray(rng.standard_normal((B + 2, C, 3)), BF16)
    x = jnp.asarray(rng.standard_normal((B, x_col + C + 8)), BF16)
    w = jnp.asarray(rng.standard_normal((C, 4)) * 0.5, BF16)
    bias = jnp.asarray(rng.standard_normal(C) * 0.1, BF16)
    rows = jnp.asarray(rng.permutation(B + 1)[:B], jnp.int32)
    outs = [jax.jit(lambda p, m=m: m.causal_conv1d_update_pallas(
        p, rows, x, w, bias, x_col=x_col, skip_row=B + 1, interpret=interpret))(jnp.copy(pool)) for m in (old, new)]
    (y0, pool0), (y1, pool1) = outs
    return f"conv B={B}: {_differ('y', y0, y1)}, {_differ('pool', pool0, pool1)}"


def attention(old, new, rng, B: int, L: int, KVH: int, G: int, hd: int, interpret: bool) -> str:
    """Decode attention at layer 1 of a 2-layer pool, each row at its own length, the step's keys / values at
    limit - 1: the earlier tree scatters them and attends; this tree's kernel appends them itself."""
    pools = [jnp.asarray(rng.standard_normal((2, B + 1, L, KVH, hd)), BF16) for _ in range(2)]
    q = jnp.asarray(rng.standard_normal((B, KVH, G, hd)), BF16)
    kn, vn = (jnp.asarray(rng.standard_normal((B, KVH, hd)), BF16) for _ in range(2))
    slots = jnp.asarray(rng.permutation(B + 1)[:B], jnp.int32)
    limit = jnp.asarray(rng.integers(1, L + 1, B), jnp.int32)
    scale = hd ** -0.5

    def before(kp, vp):
        kp, vp = kp.at[1, slots, limit - 1].set(kn), vp.at[1, slots, limit - 1].set(vn)
        out = old.decode_attention_pallas(q, kp, vp, slots, limit, layer=1, scale=scale, interpret=interpret)
        return out.astype(BF16), kp, vp

    def now(kp, vp):
        return new.decode_attention_pallas(q, kp, vp, slots, limit, layer=1, scale=scale, out_dtype=BF16,
                                           new_kv=(kn, vn), interpret=interpret)

    a, b = (jax.jit(f)(*map(jnp.copy, pools)) for f in (before, now))
    return f"attention B={B}: " + ", ".join(_differ(n, x, y) for n, x, y in zip(("out", "k pool", "v pool"), a, b))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", type=pathlib.Path, help="the earlier tree, unpacked (e.g. ab_base)")
    ap.add_argument("--tiny", action="store_true", help="small shapes in interpret mode (a CPU check of the script)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from pallas_kernels import attention as new_attention
    from pallas_kernels import conv1d as new_conv

    old_conv = _load("base_conv1d", args.base / "pallas_kernels" / "conv1d.py")
    old_attention = _load("base_attention", args.base / "pallas_kernels" / "attention.py")
    rng = np.random.default_rng(0)
    if args.tiny:
        batches, C, x_col, attn = (2,), 64, 16, dict(L=16, KVH=2, G=2, hd=16)
    else:       # Nemotron-H-8B: conv channels x + B + C, x read at column 8192 of in_proj's output
        batches, C, x_col, attn = (1, 64, 256), 8192 + 2 * 8 * 128, 8192, dict(L=256, KVH=8, G=4, hd=128)
    for B in batches:
        print(conv(old_conv, new_conv, rng, B, C, x_col, args.tiny))
        print(attention(old_attention, new_attention, rng, B, **attn, interpret=args.tiny))
    return 0


if __name__ == "__main__":
    sys.exit(main())
