"""Executables: compile once per shape, hits afterwards, eager when graphs are off, per-slot dropping."""

import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.runtime import Executables, bucket


def _step(pool, x):
    return pool.at[0].add(x.sum()), x * 2


def test_bucket():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert bucket(3, minimum=8) == 8 and bucket(100, maximum=64 + 64) == 128
    with pytest.raises(ValueError, match="exceeds"):
        bucket(200, maximum=128)


def test_compiles_once_per_shape_and_donates(rng):
    ex = Executables()
    pool = jnp.asarray(rng.standard_normal(4), jnp.float32)
    total = float(pool[0])
    for i in range(5):
        x = jnp.asarray(rng.standard_normal(3), jnp.float32)
        old = pool
        pool, y = ex.run("step", _step, pool, x, donate_argnums=(0,))
        total += float(x.sum())
        np.testing.assert_allclose(np.asarray(y), 2 * np.asarray(x))
        assert old.is_deleted()                         # the pool was donated
    assert ex.compiles["step"] == 1 and ex.hits["step"] == 4
    np.testing.assert_allclose(float(pool[0]), total, rtol=1e-5, atol=1e-5)   # a float32 running sum (may cancel)
    ex.run("step", _step, pool, jnp.ones(5), donate_argnums=(0,))   # a new bucket compiles again
    assert ex.compiles["step"] == 2


def test_graphs_off_runs_eagerly(rng):
    ex = Executables(graphs=False)
    pool = jnp.asarray(rng.standard_normal(4), jnp.float32)
    pool, _ = ex.run("step", _step, pool, jnp.ones(3))
    assert ex.eager_runs["step"] == 1 and ex.size == 0 and not ex.compiles


def test_drop_slot_forgets_its_executables(rng):
    ex = Executables()
    pool = jnp.asarray(rng.standard_normal(4), jnp.float32)
    pool, _ = ex.run("a", _step, pool, jnp.ones(3), slots=[1, 2])
    pool, _ = ex.run("b", _step, pool, jnp.ones(2), slots=[2])
    assert ex.drop_slot(1) == 1 and ex.size == 1
    pool, _ = ex.run("a", _step, pool, jnp.ones(3), slots=[1])
    assert ex.compiles["a"] == 2
    assert ex.drop_slot(7) == 0


def test_static_options_are_part_of_the_key(rng):
    import functools

    def scaled(x, *, factor):
        return x * factor

    ex = Executables(compiler_options={"xla_backend_optimization_level": 0})
    x = jnp.asarray(rng.standard_normal(3), jnp.float32)
    for f in (2.0, 3.0, 2.0):
        y = ex.run("scaled", functools.partial(scaled, factor=f), x, static=f)
        np.testing.assert_allclose(np.asarray(y), f * np.asarray(x), rtol=1e-6)
    assert ex.compiles["scaled"] == 2 and ex.hits["scaled"] == 1 and ex.total_compiles == 2


def test_frozen_arguments_share_executables_by_signature(rng):
    """A frozen argument (the weights) keys by its signature: an equal list hits, another shape compiles; the key
    holds a small id for it, so hashing the key per call and per slot does not walk hundreds of leaves."""
    def scaled(ws, x):
        return sum(w.sum() for w in ws) * x

    ex = Executables()
    ws = [jnp.asarray(rng.standard_normal(4), jnp.float32) for _ in range(300)]
    x = jnp.asarray(rng.standard_normal(3), jnp.float32)
    y = ex.run("s", scaled, ws, x, frozen_argnums=(0,), slots=range(32))
    twin = [w + 1 for w in ws]                                    # another list, same signature
    y2 = ex.run("s", scaled, twin, x, frozen_argnums=(0,), slots=range(32))
    np.testing.assert_allclose(np.asarray(y2), np.asarray(y) + 1200 * np.asarray(x), rtol=1e-4)
    assert ex.compiles["s"] == 1 and ex.hits["s"] == 1
    ex.run("s", scaled, ws[:7], x, frozen_argnums=(0,))
    assert ex.compiles["s"] == 2
    keys = list(ex._cache)
    assert all(isinstance(k[-1][0][0], int) for k in keys) and len({k[-1][0][0] for k in keys}) == 2


def test_pick_bucket():
    from metrale_jax.runtime import pick_bucket

    assert [pick_bucket(n, (4, 16)) for n in (1, 4, 5, 16)] == [4, 4, 16, 16]
    with pytest.raises(ValueError, match="largest bucket"):
        pick_bucket(17, (4, 16), "prefill chunk")
