"""What a bfloat16 Mamba state does to the built-in model's predictions, against the float32 state (CPU, ~1 min).

Eight held-out KJV passages of 300 bytes: the first 64 bytes prefilled, the rest decoded one token at a time with
the state kept in each dtype (`model.new_cache(..., ssm_state_dtype=)`). Prints the logit differences, the KL
divergence of the next-byte distributions, how often the argmax agrees, and the held-out bits per byte.

    PYTHONPATH=. python tools/state_dtype_effect.py [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.builtin import load_builtin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def decode_logits(model, ids: np.ndarray, prefill: int, state_dtype: str) -> np.ndarray:
    """Logits [B, T-1, V] of rows ids [B, T]: the first `prefill` tokens prefilled, the rest decoded."""
    B, T = ids.shape
    cache = model.new_cache(B, T, ssm_state_dtype=state_dtype)
    slots = np.arange(B)
    logits, cache = model.prefill(cache, slots, ids[:, :prefill], all_logits=True)
    out = [np.asarray(logits)]
    for t in range(prefill, T - 1):
        step, cache = model.decode(cache, slots, ids[:, t])
        out.append(np.asarray(step)[:, None])
    return np.concatenate(out, axis=1)


def heldout_windows(model, rng, n: int, length: int) -> np.ndarray:
    """ids [n, length]: n random windows of the held-out KJV text, as the built-in model's byte tokens."""
    text = open(os.path.join(ROOT, "data", "kjv", "heldout.txt"), "rb").read()
    return np.array([[b + model.tokenizer.offset for b in text[s:s + length]]
                     for s in rng.integers(0, len(text) - length, n)], np.int32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    model = load_builtin(dtype=jnp.float32)
    ids = heldout_windows(model, np.random.default_rng(0), 8, 300)
    ref, got = (decode_logits(model, ids, 64, d) for d in ("float32", args.dtype))
    lp_ref, lp = jax.nn.log_softmax(ref, -1), jax.nn.log_softmax(got, -1)
    kl = float(jnp.mean(jnp.sum(jnp.exp(lp_ref) * (lp_ref - lp), -1)))
    tgt = ids[:, 1:, None]
    bpb = lambda l: float(-jnp.mean(jnp.take_along_axis(l, tgt, -1)) / np.log(2))
    print(f"{args.dtype} vs float32 state, 8 x 236 decoded bytes: max |dlogit| {np.abs(got - ref).max():.3g}, "
          f"mean {np.abs(got - ref).mean():.2g}, KL {kl:.2g} nats, argmax agrees "
          f"{(got.argmax(-1) == ref.argmax(-1)).mean():.2%}, bits/byte {bpb(lp):.5f} vs {bpb(lp_ref):.5f}")


if __name__ == "__main__":
    main()
