"""A refused call leaves the state pool it was given bit-identical (the layers' hostile-argument tests)."""

import jax
import numpy as np
import pytest


def assert_refused_leaving_pool_intact(call, layer, pool, error, message):
    """call(layer, pool) raises `error` matching `message`, and every array of the pool keeps its bits."""
    before = [np.asarray(a).copy() for a in jax.tree.leaves(pool)]
    with pytest.raises(error, match=message):
        call(layer, pool)
    for b, a in zip(before, jax.tree.leaves(pool), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
