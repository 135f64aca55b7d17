"""Grouped (MoE) quantized matmuls: the row-tile map, the references against float64 numpy per group, the
Pallas kernels (interpret mode on the CPU, compiled on a GPU) against the references."""

import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.errors import ShapeError
from metrale_jax.weights import quant_formats as qf
from pallas_kernels import grouped, registry
from tests.numpy_refs import rel_err

E, N, K = 4, 96, 160              # ragged on purpose: N and K are not multiples of the tiles
SIZES = [3, 0, 21, 1]             # an empty expert, one tile-crossing group; M = 25 with 0 trailing rows


def _experts(rng, n=N, k=K):
    return [(rng.standard_normal((n, k)) * rng.uniform(0.1, 3.0, (n, 1))).astype(np.float32) for _ in range(E)]


def _fp8(rng):
    qs = [qf.quantize_fp8_block(w) for w in _experts(rng)]
    return jnp.asarray(np.stack([q for q, _ in qs])), jnp.asarray(np.stack([s for _, s in qs]))


def _nvfp4(rng):
    qs = [qf.quantize_nvfp4(w) for w in _experts(rng)]
    return tuple(jnp.asarray(np.stack([a[i] for a in qs])) for i in range(3))


def _numpy(x, dense, sizes):
    """float64 per group; rows past the groups 0."""
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    out, r = np.zeros((x.shape[0], dense.shape[1])), 0
    for e, s in enumerate(sizes):
        out[r:r + s] = x[r:r + s] @ dense[e].T
        r += s
    return out


def test_group_tiles_cover_each_group_once(rng):
    sizes = rng.integers(0, 40, 6)
    M = int(sizes.sum()) + 5
    tiles = np.asarray(grouped.group_tiles(jnp.asarray(sizes, jnp.int32), M, 16))
    assert tiles.shape == (3, -(-M // 16) + 6)
    covered = np.full(M, -1)
    for e, r0, rows in tiles.T:
        assert 0 <= rows <= 16
        assert np.all(covered[r0:r0 + rows] == -1)
        covered[r0:r0 + rows] = e
    want = np.concatenate([np.full(s, e) for e, s in enumerate(sizes)] + [np.full(5, -1)])
    np.testing.assert_array_equal(covered, want)


def test_references_against_numpy(rng):
    sizes = jnp.asarray(SIZES, jnp.int32)
    x = jnp.asarray(rng.standard_normal((sum(SIZES) + 2, K)), jnp.bfloat16)
    q, s = _fp8(rng)
    dense = np.stack([np.asarray(qf.dequantize_fp8_block(np.asarray(q[e]), np.asarray(s[e])), np.float64)
                      for e in range(E)])
    y = grouped.w8a16_grouped_reference(x, q, s, sizes)
    assert y.dtype == jnp.float32 and rel_err(y, _numpy(x, dense, SIZES)) < 1e-6
    assert np.all(np.asarray(y)[sum(SIZES):] == 0)
    p, sc, g = _nvfp4(rng)
    dense = np.stack([np.asarray(qf.dequantize_nvfp4(np.asarray(p[e]), np.asarray(sc[e]), np.asarray(g[e])),
                                 np.float64) for e in range(E)])
    assert rel_err(grouped.w4a16_grouped_reference(x, p, sc, g, sizes), _numpy(x, dense, SIZES)) < 1e-6


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-5)])
def test_w8a16_grouped_kernel(rng, interpret, dtype, tol):
    sizes = jnp.asarray(SIZES, jnp.int32)
    x = jnp.asarray(rng.standard_normal((sum(SIZES) + 3, K)), dtype)
    q, s = _fp8(rng)
    y = grouped.w8a16_grouped_pallas(x, q, s, sizes, interpret=interpret)
    ref = grouped.w8a16_grouped_reference(x, q, s, sizes)
    assert np.all(np.isfinite(np.asarray(y)))         # interpret mode starts outputs as NaN: every row written
    assert rel_err(y, ref) <= tol


def test_w4a16_grouped_kernel(rng, interpret):
    sizes = jnp.asarray(SIZES, jnp.int32)
    x = jnp.asarray(rng.standard_normal((sum(SIZES), K)), jnp.bfloat16)
    p, sc, g = _nvfp4(rng)
    y = grouped.w4a16_grouped_pallas(x, p, sc, g, sizes, interpret=interpret)
    assert np.all(np.isfinite(np.asarray(y)))
    assert rel_err(y, grouped.w4a16_grouped_reference(x, p, sc, g, sizes)) <= 1e-5


def test_rows_do_not_depend_on_the_other_groups(rng, interpret):
    """A group's rows give the same bits whatever the other groups hold (decode batches vary)."""
    q, s = _fp8(rng)
    x = jnp.asarray(rng.standard_normal((30, K)), jnp.bfloat16)
    a = grouped.w8a16_grouped_pallas(x[:6], q, s, jnp.asarray([0, 0, 6, 0], jnp.int32), interpret=interpret)
    b = grouped.w8a16_grouped_pallas(jnp.concatenate([x[6:30], x[:6]]), q, s, jnp.asarray([17, 7, 6, 0], jnp.int32),
                                     interpret=interpret)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[24:30])


def test_registered_and_bad_arguments(rng):
    for name in ("w8a16_grouped", "w4a16_grouped"):
        assert registry.resolve(name, "interpret").impl == "interpret"
        assert registry.resolve(name, "auto", platform="gpu").impl == "pallas"
    q, s = _fp8(rng)
    x = jnp.ones((4, K), jnp.bfloat16)
    sizes = jnp.asarray([1, 1, 1, 1], jnp.int32)
    with pytest.raises(ShapeError, match="group_sizes"):
        grouped.w8a16_grouped_reference(x, q, s, sizes[:3])
    with pytest.raises(ShapeError, match="scale"):
        grouped.w8a16_grouped_pallas(x, q, s[:, :, :1], sizes, interpret=True)
    with pytest.raises(ShapeError, match="x expected"):
        grouped.w8a16_grouped_pallas(x[:, :8], q, s, sizes, interpret=True)
    p, sc, g = _nvfp4(rng)
    with pytest.raises(ShapeError, match="global_scale"):
        grouped.w4a16_grouped_reference(x, p, sc, g[:1], sizes)
