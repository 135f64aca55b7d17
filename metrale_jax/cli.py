"""`metrale-jax` command line."""

from __future__ import annotations

import argparse
import sys
import time


def _demo(args) -> int:
    """One Mamba-2 layer on random weights: prefill a sequence, decode tokens, check they agree."""
    import jax
    import jax.numpy as jnp

    from metrale_jax import ModelConfig, NemotronMamba2Layer, SlotAllocator, SsmPool
    from metrale_jax.init import random_norm, random_ssm_weights

    cfg = ModelConfig.from_hf(dict(vocab_size=256, hidden_size=128, hybrid_override_pattern="M",
                                   mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=32, n_groups=2,
                                   chunk_size=32))
    k1, k2, k3 = jax.random.split(jax.random.key(args.seed), 3)
    layer = NemotronMamba2Layer(random_norm(cfg, k1, jnp.float32), random_ssm_weights(cfg, k2, jnp.float32), cfg, 0)
    pool = SsmPool.for_config(cfg, max_slots=2, dtype=jnp.float32)
    alloc = SlotAllocator(pool.num_slots)
    slot, pool = alloc.alloc(pool)
    x = jax.random.normal(k3, (args.tokens, cfg.hidden_size), jnp.float32)
    prefill = jax.jit(lambda l, p, h: l.prefill(p, slot, h))
    decode = jax.jit(lambda l, p, h: l.decode(p, slot, h), donate_argnums=1)
    t0 = time.perf_counter()
    y_prefill, pool_prefill = jax.block_until_ready(prefill(layer, pool, x))
    t1 = time.perf_counter()
    ys = []
    for t in range(args.tokens):
        y, pool = decode(layer, pool, x[t])
        ys.append(y)
    y_decode = jax.block_until_ready(jnp.stack(ys))
    t2 = time.perf_counter()
    err = float(jnp.linalg.norm(y_decode - y_prefill) / jnp.linalg.norm(y_prefill - x))
    state_err = float(jnp.linalg.norm(pool.ssm_state - pool_prefill.ssm_state) / jnp.linalg.norm(pool_prefill.ssm_state))
    print(f"NemotronMamba2Layer  hidden={cfg.hidden_size} heads={cfg.mamba_num_heads}x{cfg.mamba_head_dim} "
          f"state={cfg.ssm_state_size} groups={cfg.n_groups}  backend={jax.default_backend()}")
    print(f"prefill {args.tokens} tokens: {t1 - t0:.3f} s (with compile)")
    print(f"decode  {args.tokens} tokens: {t2 - t1:.3f} s ({args.tokens / (t2 - t1):.1f} tokens/s, with compile)")
    print(f"prefill vs token-by-token decode: output rel err {err:.2e}, final state rel err {state_err:.2e}")
    return 0 if err < 1e-4 and state_err < 1e-4 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="metrale-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the built-in demo")
    demo.add_argument("--tokens", type=int, default=64)
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return {"demo": _demo}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
