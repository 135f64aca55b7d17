"""benchmarks/timing.py on the CPU: interleaved rounds time every arm once per round, on distinct argument sets."""

import jax.numpy as jnp
import numpy as np

from benchmarks import timing


def test_interleaved_rounds_time_every_arm_each_round(rng):
    sets = [(jnp.asarray(rng.standard_normal((64, 64)), jnp.float32),) for _ in range(3)]
    arms = {"neg": (lambda v: -v, sets), "matmul": (lambda v: v @ v, sets)}
    seen = []
    walls = timing.interleaved_rounds(arms, 4, reps=2, trials=1,
                                      on_round=lambda r, w: seen.append((r, {n: len(v) for n, v in w.items()})))
    assert list(walls) == ["neg", "matmul"] and all(len(v) == 4 and min(v) > 0 for v in walls.values())
    assert seen == [(r, {"neg": r + 1, "matmul": r + 1}) for r in range(4)]      # both arms in every round


def test_queued_calls_fn_once_per_distinct_set(rng):
    sets = [(jnp.asarray(rng.standard_normal(8), jnp.float32),) for _ in range(3)]
    out = timing.queued(lambda v: v * 2.0, len(sets))(sets)
    for (x,), y in zip(sets, out):
        np.testing.assert_array_equal(np.asarray(y), 2.0 * np.asarray(x))


def test_interleaved_rounds_reuse_given_executables(rng):
    """Executables from queued_arms serve the rounds as they are: fn is traced once, not again per round or call."""
    traces = []
    fn = lambda v: (traces.append(1), v + 1.0)[1]
    sets = [(jnp.asarray(rng.standard_normal(16), jnp.float32),) for _ in range(2)]
    arms = {"add": (fn, sets)}
    many = timing.queued_arms(arms)
    jax_out = many["add"](sets)
    np.testing.assert_array_equal(np.asarray(jax_out[1]), np.asarray(sets[1][0]) + 1.0)
    n = len(traces)
    walls = timing.interleaved_rounds(arms, 3, reps=2, trials=1, many=many)
    assert len(walls["add"]) == 3 and len(traces) == n
