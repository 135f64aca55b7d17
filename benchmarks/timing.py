"""Wall-clock timing shared by the benchmarks: calls queued inside one executable, so host dispatch is paid once.

Every queued call must get its own inputs: XLA merges identical computations in one executable, and a call
repeated on the same arguments is timed as if it were free (seen on the H200, 2026-11-30: two benchmarks read
1.7-10x too fast that way).
"""

from __future__ import annotations

import time

import jax


def queued(fn, n: int):
    """A jitted function of `sets` (n argument tuples, all distinct) that calls fn once per set."""
    return jax.jit(lambda sets: [fn(*sets[i]) for i in range(n)])


def wall_us(many, arg_sets, *, reps: int, trials: int = 3) -> list[float]:
    """us per queued call of `many` (from `queued`): warmed up, then `reps` executions back to back per trial."""
    jax.block_until_ready(many(arg_sets))             # compile + warm
    jax.block_until_ready(many(arg_sets))
    walls = []
    for _ in range(trials):
        t = time.perf_counter()
        jax.block_until_ready([many(arg_sets) for _ in range(reps)])
        walls.append((time.perf_counter() - t) / (reps * len(arg_sets)) * 1e6)
    return walls


def queued_wall_us(fn, arg_sets, *, reps: int, trials: int = 3) -> list[float]:
    """`wall_us` of fn called once per (distinct) entry of arg_sets."""
    return wall_us(queued(fn, len(arg_sets)), arg_sets, reps=reps, trials=trials)
