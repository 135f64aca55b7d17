"""The Pallas causal conv1d (varlen forward and decode update) against the references and a float64 loop."""

import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.errors import ShapeError
from pallas_kernels import registry
from pallas_kernels.conv1d import (ConvBlocks, causal_conv1d_pallas, causal_conv1d_reference,
                                   causal_conv1d_update_pallas, causal_conv1d_update_reference)
from tests.numpy_refs import causal_conv, rel_err

SMALL = ConvBlocks(block_t=8, block_c=16)     # several token and channel blocks at test sizes


def _cu(lens):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)


@pytest.mark.parametrize("with_init,bias,dtype,tol", [(True, True, jnp.float32, 1e-5),
                                                      (False, False, jnp.float32, 1e-5),
                                                      (True, True, jnp.bfloat16, 1e-2)])
def test_varlen_forward(rng, interpret, with_init, bias, dtype, tol):
    lens = [5, 0, 2, 33, 1]
    T, C, K, S = sum(lens) + 3, 40, 4, len(lens)
    a = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    x, w = a(T, C), a(C, K)
    b = a(C) if bias else None
    h0 = a(S, C, K - 1) if with_init else None
    cu = _cu(lens)
    y, final = causal_conv1d_pallas(x, w, b, initial_states=h0, cu_seqlens=cu, interpret=interpret, blocks=SMALL)
    y_ref, final_ref = causal_conv1d_reference(x, w, b, initial_states=h0, cu_seqlens=cu)
    assert y.dtype == dtype and np.all(np.isfinite(np.asarray(y, np.float32)))
    assert rel_err(np.asarray(y, np.float32), np.asarray(y_ref, np.float32)) <= tol
    np.testing.assert_array_equal(np.asarray(final), np.asarray(final_ref))
    assert np.all(np.asarray(y, np.float32)[sum(lens):] == 0)
    # and each sequence against the float64 loop
    f = lambda v: None if v is None else np.asarray(v, np.float64)
    for s, L in enumerate(lens):
        if L:
            sl = slice(int(cu[s]), int(cu[s + 1]))
            y64, _ = causal_conv(f(x)[sl], f(w), f(b), None if h0 is None else f(h0)[s])
            assert rel_err(np.asarray(y, np.float32)[sl], y64) <= max(tol, 1e-5)


def test_single_sequence_default_blocks(rng, interpret):
    T, C, K = 50, 24, 4
    x, w = jnp.asarray(rng.standard_normal((T, C)), jnp.float32), jnp.asarray(rng.standard_normal((C, K)), jnp.float32)
    y, final = causal_conv1d_pallas(x, w, activation=None, interpret=interpret)
    y_ref, final_ref = causal_conv1d_reference(x, w, activation=None)
    assert rel_err(y, y_ref) <= 1e-6
    np.testing.assert_array_equal(np.asarray(final), np.asarray(final_ref))


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
def test_update(rng, interpret, state_dtype):
    Bt, C, K = 3, 40, 4
    x = jnp.asarray(rng.standard_normal((Bt, C)), jnp.float32)
    st = jnp.asarray(rng.standard_normal((Bt, C, K - 1)), state_dtype)
    w, b = jnp.asarray(rng.standard_normal((C, K)), jnp.float32), jnp.asarray(rng.standard_normal(C), jnp.float32)
    y, new = causal_conv1d_update_pallas(x, st, w, b, interpret=interpret, blocks=SMALL)
    y_ref, new_ref = causal_conv1d_update_reference(x, st, w, b)
    assert np.all(np.isfinite(np.asarray(y))) and new.dtype == state_dtype
    assert rel_err(y, y_ref) <= 1e-6
    np.testing.assert_array_equal(np.asarray(new, np.float32), np.asarray(new_ref, np.float32))


def test_registered_and_bad_shapes(rng, interpret):
    for name in ("causal_conv1d", "causal_conv1d_update"):
        assert registry.resolve(name, "interpret").impl == "interpret"
    x, w = jnp.ones((5, 8)), jnp.ones((8, 4))
    with pytest.raises(ShapeError, match="weight"):
        causal_conv1d_pallas(x, w[:4], interpret=interpret)
    with pytest.raises(ShapeError, match="initial_states"):
        causal_conv1d_pallas(x, w, initial_states=jnp.ones((1, 8, 2)), interpret=interpret)
    with pytest.raises(ShapeError, match="conv_state"):
        causal_conv1d_update_pallas(x, jnp.ones((5, 8, 2)), w, interpret=interpret)
