"""Where an Engine decode step's wall time goes: host time per phase (dispatching the decode and sample executables,
waiting for the read-back, the rest), the GPU's idle time between kernels over the same steps (profiler trace),
and the top host functions (cProfile). Random weights, Nemotron-H-8B shapes (or --tiny on the CPU).

    PYTHONPATH=. python benchmarks/probes/engine_timeline.py [--weights bf16] [--batches 1,8] [--tiny]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_runtime import CONFIG_8B, TINY, block, decode_profile, random_model
from metrale_jax.config import ModelConfig
from metrale_jax.runtime import Engine


def _timed(obj, name: str, acc: collections.Counter, label: str | None = None):
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[label or name] += time.perf_counter() - t

    setattr(obj, name, wrapper)


def d2h_order_probe() -> dict:
    """Does reading back a small result of computation A wait for B, queued after A? (A, B ~ equal matmul chains.)"""
    n = 4096 if jax.default_backend() == "gpu" else 256
    x = jnp.ones((n, n), jnp.bfloat16)
    f = jax.jit(lambda a: [a := a @ a * 0.5 for _ in range(20)][-1])
    small = jax.jit(lambda a: a[0, :4])
    block(f(x))
    t = time.perf_counter()
    block(f(x))
    one = time.perf_counter() - t
    out = {}
    for name, prefetch in (("plain", False), ("copy_to_host_async", True)):
        a = f(x)
        s = small(a)
        if prefetch:
            s.copy_to_host_async()
        b = f(a)                                          # queued after A
        t = time.perf_counter()
        np.asarray(s)
        out[name] = (time.perf_counter() - t) / one       # ~1: waited for A only (from dispatch); ~2: also for B
        block(b)
    return {"one_computation_s": one, "read_back_wait_in_computations": out}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", default="bf16")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    print("d2h order:", d2h_order_probe(), flush=True)
    config = ModelConfig.from_hf(TINY if args.tiny else CONFIG_8B)
    model = random_model(config, jnp.bfloat16, weights=args.weights)
    batches = tuple(int(b) for b in args.batches.split(","))
    n = args.steps
    eng = Engine(model, max_slots=max(batches), max_len=64 + 4 * n + 8, batch_buckets=batches,
                 prefill_batch_buckets=(max(batches),), token_buckets=(64,), prefill_token_budget=64 * max(batches),
                 eos_ids=[])
    eng.warmup()
    acc = collections.Counter()
    _timed(eng, "call", acc, "dispatch decode")
    _timed(eng.exe, "run", acc, "dispatch (all executables)")
    _timed(eng, "_read_back", acc, "read back")
    rng = np.random.default_rng(0)
    V = config.vocab_size
    for B in batches:
        for _ in range(B):
            eng.submit(rng.integers(0, V, 64).tolist(), 4 * n)
        while eng.queue or any(r.done < len(r.prompt) for r in eng.running.values()):
            eng.step()
        for _ in range(4):
            eng.step()
        acc.clear()
        t = time.perf_counter()
        for _ in range(n):
            eng.step()
        wall = (time.perf_counter() - t) / n
        phases = {k: round(v / n * 1e6) for k, v in acc.items()}
        print(f"B={B}: {wall * 1e6:,.0f} us per engine step; host us per step: {phases}", flush=True)
        prof = decode_profile(lambda: [eng.step() for _ in range(8)], 8, wall)
        print(f"B={B}: GPU over engine steps: " + (prof.get("error") or
              f"span {prof['traced_span_us_per_step']:,.0f} us, kernels {prof['kernel_us_per_step']:,.0f} us, idle "
              f"{prof['idle_us_per_step']:,.0f} us, {prof['kernels_per_step']:.0f} kernels per step"), flush=True)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(16):
            eng.step()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12)
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:3000], flush=True)
        while eng.has_work:
            eng.step()


if __name__ == "__main__":
    main()
