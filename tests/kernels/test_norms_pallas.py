"""The Pallas RMSNorm and gated group RMSNorm against the references and float64 numpy."""

import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.errors import ShapeError
from pallas_kernels import registry
from pallas_kernels.norms import gated_rmsnorm_pallas, gated_rmsnorm_reference, rmsnorm_pallas, rmsnorm_reference
from tests.numpy_refs import rel_err


@pytest.mark.parametrize("shape,dtype,out_dtype,tol", [((7, 48), jnp.float32, None, 1e-6),
                                                       ((2, 3, 64), jnp.bfloat16, jnp.float32, 1e-6),
                                                       ((5, 40), jnp.bfloat16, None, 1e-2)])
def test_rmsnorm(rng, interpret, shape, dtype, out_dtype, tol):
    x = jnp.asarray(rng.standard_normal(shape) * 3.0, dtype)
    w = jnp.asarray(rng.standard_normal(shape[-1]), jnp.float32)
    out = rmsnorm_pallas(x, w, eps=1e-5, out_dtype=out_dtype, interpret=interpret)
    ref = rmsnorm_reference(x, w, eps=1e-5, out_dtype=out_dtype)
    assert out.shape == shape and out.dtype == ref.dtype
    assert rel_err(np.asarray(out, np.float32), np.asarray(ref, np.float32)) <= tol
    x64 = np.asarray(x, np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5) * np.asarray(w, np.float64)
    assert rel_err(np.asarray(out, np.float32), want) <= max(tol, 1e-5)


@pytest.mark.parametrize("group_size", [12, 16, 48])
def test_gated_rmsnorm(rng, interpret, group_size):
    y = jnp.asarray(rng.standard_normal((6, 48)), jnp.float32)
    z = jnp.asarray(rng.standard_normal((6, 48)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(48), jnp.float32)
    out = gated_rmsnorm_pallas(y, z, w, group_size=group_size, eps=1e-5, out_dtype=jnp.bfloat16, interpret=interpret)
    ref = gated_rmsnorm_reference(y, z, w, group_size=group_size, eps=1e-5, out_dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    assert rel_err(np.asarray(out, np.float32), np.asarray(ref, np.float32)) <= 1e-2
    out32 = gated_rmsnorm_pallas(y, z, w, group_size=group_size, eps=1e-5, interpret=interpret)
    y64, z64 = np.asarray(y, np.float64), np.asarray(z, np.float64)
    h = (y64 * z64 / (1 + np.exp(-z64))).reshape(6, -1, group_size)
    want = (h / np.sqrt((h ** 2).mean(-1, keepdims=True) + 1e-5)).reshape(6, 48) * np.asarray(w, np.float64)
    assert rel_err(out32, want) <= 1e-5


def test_gated_rmsnorm_reads_gate_columns_in_place(rng, interpret):
    """z_col: the gate is read out of a wider array (the in_proj output), same bits as the cut-out columns."""
    y = jnp.asarray(rng.standard_normal((5, 32)), jnp.float32)
    wide = jnp.asarray(rng.standard_normal((5, 45)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(32), jnp.float32)
    kw = dict(group_size=16, eps=1e-5, interpret=interpret)
    got = gated_rmsnorm_pallas(y, wide, w, z_col=7, **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(gated_rmsnorm_pallas(y, wide[:, 7:39], w, **kw)))
    ref = gated_rmsnorm_reference(y, wide, w, group_size=16, eps=1e-5, z_col=7)
    assert rel_err(got, ref) <= 1e-5
    with pytest.raises(ShapeError, match="z_col"):
        gated_rmsnorm_pallas(y, wide, w, z_col=14, **kw)


def test_registered_and_bad_shapes(interpret):
    for name in ("rmsnorm", "gated_rmsnorm"):
        assert registry.resolve(name, "interpret").impl == "interpret"
    x = jnp.ones((2, 8))
    with pytest.raises(ShapeError, match="weight"):
        rmsnorm_pallas(x, jnp.ones(4), eps=1e-5, interpret=interpret)
    with pytest.raises(ShapeError, match="z"):
        gated_rmsnorm_pallas(x, jnp.ones((2, 4)), jnp.ones(8), group_size=4, eps=1e-5, interpret=interpret)
    with pytest.raises(ValueError, match="group_size"):
        gated_rmsnorm_pallas(x, x, jnp.ones(8), group_size=3, eps=1e-5, interpret=interpret)
