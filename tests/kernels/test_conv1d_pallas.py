"""The Pallas causal conv1d (varlen forward and decode update) against the references and a float64 loop."""

import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.errors import KernelUnavailableError, ShapeError
from pallas_kernels import registry
from pallas_kernels.conv1d import (ConvBlocks, causal_conv1d_pallas, causal_conv1d_reference,
                                   causal_conv1d_update_multi_pallas, causal_conv1d_update_multi_reference,
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
def test_update_in_place_on_pool_rows(rng, interpret, state_dtype):
    R, C, K = 7, 40, 4
    rows = jnp.asarray([5, 0, 3], jnp.int32)
    x = jnp.asarray(rng.standard_normal((3, C)), jnp.float32)
    pool = jnp.asarray(rng.standard_normal((R, C, K - 1)), state_dtype)
    w, b = jnp.asarray(rng.standard_normal((C, K)), jnp.float32), jnp.asarray(rng.standard_normal(C), jnp.float32)
    y, new = causal_conv1d_update_pallas(pool, rows, x, w, b, interpret=interpret, blocks=SMALL)
    y_ref, new_ref = causal_conv1d_update_reference(pool, rows, x, w, b)
    assert np.all(np.isfinite(np.asarray(y))) and new.dtype == state_dtype
    assert rel_err(y, y_ref) <= 1e-6
    np.testing.assert_array_equal(np.asarray(new, np.float32), np.asarray(new_ref, np.float32))
    untouched = [r for r in range(R) if r not in (5, 0, 3)]
    np.testing.assert_array_equal(np.asarray(new, np.float32)[untouched], np.asarray(pool, np.float32)[untouched])
    for i, r in enumerate((5, 0, 3)):          # each row against the float64 loop
        y64, st64 = causal_conv(np.asarray(x)[i:i + 1], w, b, np.asarray(pool, np.float64)[r])
        assert rel_err(np.asarray(y)[i:i + 1], y64) <= 1e-6
        np.testing.assert_allclose(np.asarray(new, np.float64)[r], st64, rtol=1e-2 if state_dtype != jnp.float32 else 0)


def test_update_8b_shapes(rng, interpret):
    """The Nemotron-H-8B conv (10,240 channels, K = 4, a bfloat16 pool) as a layer calls it: default blocks, x read
    in place from the in_proj output, a row offset, the padding row skipped; rows not named keep their NaN."""
    C, K, R, offset = 8192 + 2 * 8 * 128, 4, 12, 6
    slots = jnp.asarray([0, 4, 5, 2, 5], jnp.int32)                            # pool rows 6, 10, 11 (padding), 8
    zx = jnp.asarray(rng.standard_normal((5, 8192 + C + 128)), jnp.bfloat16)
    pool = jnp.full((R, C, K - 1), jnp.nan, jnp.bfloat16)
    pool = pool.at[jnp.asarray([6, 8, 10])].set(jnp.asarray(rng.standard_normal((3, C, K - 1)), jnp.bfloat16))
    w, b = jnp.asarray(rng.standard_normal((C, K)), jnp.bfloat16), jnp.asarray(rng.standard_normal(C), jnp.bfloat16)
    kw = dict(x_col=8192, skip_row=R - 1, row_offset=offset)
    y, new = causal_conv1d_update_pallas(pool, slots, zx, w, b, interpret=interpret, **kw)
    y_ref, new_ref = causal_conv1d_update_reference(pool, slots, zx, w, b, **kw)
    np.testing.assert_array_equal(np.asarray(new, np.float32), np.asarray(new_ref, np.float32))
    assert np.isnan(np.asarray(new, np.float32)[[0, 1, 2, 3, 4, 5, 7, 9, 11]]).all()
    live = [0, 1, 3]
    assert np.all(np.isfinite(np.asarray(y, np.float32)[live]))
    np.testing.assert_allclose(np.asarray(y, np.float32)[live], np.asarray(y_ref, np.float32)[live], rtol=1e-2,
                               atol=1e-2)


@pytest.mark.parametrize("K", [2, 3, 4])
def test_update_multi_keeps_every_step(rng, interpret, K):
    """k tokens per row in one launch: y and the state after each token equal k one-token updates. Conv widths
    whose window (K - 1 entries per channel) fills the kernel's [channels, next_pow2(K)] tile to different depths."""
    R, C, k = 6, 24, 3
    rows = jnp.asarray([4, 1], jnp.int32)
    x = jnp.asarray(rng.standard_normal((2, k, C)), jnp.float32)
    pool = jnp.asarray(rng.standard_normal((R, C, K - 1)), jnp.float32)
    w, b = jnp.asarray(rng.standard_normal((C, K)), jnp.float32), jnp.asarray(rng.standard_normal(C), jnp.float32)
    y, steps, new = causal_conv1d_update_multi_pallas(pool, rows, x, w, b, interpret=interpret, blocks=SMALL)
    y_ref, steps_ref, new_ref = causal_conv1d_update_multi_reference(pool, rows, x, w, b)
    assert steps.shape == (2, k, C, K - 1)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(steps), np.asarray(steps_ref))
    np.testing.assert_array_equal(np.asarray(new), np.asarray(new_ref))
    one = pool
    for t in range(k):
        yt, one = causal_conv1d_update_pallas(one, rows, x[:, t], w, b, interpret=interpret, blocks=SMALL)
        np.testing.assert_allclose(np.asarray(yt), np.asarray(y[:, t]), rtol=1e-6, atol=1e-6)  # XLA:CPU may fuse FMAs apart
        np.testing.assert_array_equal(np.asarray(one)[np.asarray(rows)], np.asarray(steps[:, t]))
    for i, r in enumerate((4, 1)):
        y64, st64 = causal_conv(np.asarray(x)[i], w, b, np.asarray(pool, np.float64)[r])
        assert rel_err(np.asarray(y)[i], y64) <= 1e-6
        np.testing.assert_allclose(np.asarray(new, np.float64)[r], st64, rtol=0)


@pytest.mark.parametrize("multi", [False, True])
def test_update_skip_row_is_neither_read_nor_written(rng, interpret, multi):
    """skip_row (the padding row, named twice): its window stays bitwise as it was (NaN here, so a read would show),
    its rows run from a zero window, and the live rows get what they get without skip_row (their new windows bit
    for bit; y to an ulp: XLA:CPU may contract the interpreted taps into FMAs differently)."""
    R, C, K, k = 6, 24, 4, 3
    rows = jnp.asarray([4, R - 1, 1, R - 1], jnp.int32)
    x = jnp.asarray(rng.standard_normal((4, k, C) if multi else (4, C)), jnp.float32)
    pool = jnp.asarray(rng.standard_normal((R, C, K - 1)), jnp.float32).at[R - 1].set(jnp.nan)
    w, b = jnp.asarray(rng.standard_normal((C, K)), jnp.float32), jnp.asarray(rng.standard_normal(C), jnp.float32)
    kernel, reference = ((causal_conv1d_update_multi_pallas, causal_conv1d_update_multi_reference) if multi
                         else (causal_conv1d_update_pallas, causal_conv1d_update_reference))
    got = kernel(pool, rows, x, w, b, skip_row=R - 1, interpret=interpret, blocks=SMALL)
    plain = kernel(pool, rows, x, w, b, interpret=interpret, blocks=SMALL)
    ref = reference(pool, rows, x, w, b, skip_row=R - 1)
    zero = reference(pool.at[R - 1].set(0.0), rows, x, w, b)
    for g, p, r, z in zip(got, plain, ref, zero):
        g, p, r, z = (np.asarray(v) for v in (g, p, r, z))
        if g.shape[0] == R:                                        # the pool
            assert np.isnan(g[R - 1]).all() and np.isnan(r[R - 1]).all()
            np.testing.assert_array_equal(g[:R - 1], p[:R - 1])
            np.testing.assert_array_equal(g[:R - 1], r[:R - 1])
        else:                                                      # y (and the per-token windows)
            np.testing.assert_allclose(g[[0, 2]], p[[0, 2]], rtol=1e-6, atol=1e-6)
            assert np.all(np.isfinite(g))
            np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(g[[1, 3]], z[[1, 3]], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("multi", [False, True])
def test_update_row_offset_is_added_to_every_row(rng, interpret, multi):
    """row_offset (a layer's block of the flattened pool): (slots, offset) gives bitwise what slots + offset gives,
    with skip_row naming an offset row, in the kernel and the reference; a row_offset outside the pool raises."""
    R, C, K, k = 8, 24, 4, 3
    slots, offset = jnp.asarray([0, 3, 2, 3], jnp.int32), 4              # rows 4, 7 (padding), 6, 7
    x = jnp.asarray(rng.standard_normal((4, k, C) if multi else (4, C)), jnp.float32)
    pool = jnp.asarray(rng.standard_normal((R, C, K - 1)), jnp.float32)
    w, b = jnp.asarray(rng.standard_normal((C, K)), jnp.float32), jnp.asarray(rng.standard_normal(C), jnp.float32)
    kernel, reference = ((causal_conv1d_update_multi_pallas, causal_conv1d_update_multi_reference) if multi
                         else (causal_conv1d_update_pallas, causal_conv1d_update_reference))
    for fn, extra in ((kernel, dict(interpret=interpret, blocks=SMALL)), (reference, {})):
        got = fn(pool, slots, x, w, b, row_offset=offset, skip_row=R - 1, **extra)
        want = fn(pool, slots + offset, x, w, b, skip_row=R - 1, **extra)
        for g, v in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(v))
        new = np.asarray(got[-1])
        np.testing.assert_array_equal(new[[0, 1, 2, 3, 5, 7]], np.asarray(pool)[[0, 1, 2, 3, 5, 7]])
        assert not np.array_equal(new[[4, 6]], np.asarray(pool)[[4, 6]])
        for bad in (R, -1, 2.0, None):
            with pytest.raises(ShapeError, match="row_offset"):
                fn(pool, slots, x, w, b, row_offset=bad, **extra)


@pytest.mark.parametrize("multi", [False, True])
def test_update_reads_columns_in_place(rng, interpret, multi):
    """With x_col the update reads its channels out of a wider array (the in_proj output): the same bits as the
    update on the cut-out columns, and the reference agrees."""
    R, C, K, col, W = 6, 24, 4, 5, 40
    rows = jnp.asarray([4, 1], jnp.int32)
    lead = (2, 3) if multi else (2,)
    wide = jnp.asarray(rng.standard_normal((*lead, W)), jnp.float32)
    pool = jnp.asarray(rng.standard_normal((R, C, K - 1)), jnp.float32)
    w, b = jnp.asarray(rng.standard_normal((C, K)), jnp.float32), jnp.asarray(rng.standard_normal(C), jnp.float32)
    fn, ref = ((causal_conv1d_update_multi_pallas, causal_conv1d_update_multi_reference) if multi
               else (causal_conv1d_update_pallas, causal_conv1d_update_reference))
    got = fn(pool, rows, wide, w, b, x_col=col, interpret=interpret, blocks=SMALL)
    want = fn(pool, rows, wide[..., col:col + C], w, b, interpret=interpret, blocks=SMALL)
    assert got[0].shape == (*lead, C)
    for g, v, r in zip(got, want, ref(pool, rows, wide, w, b, x_col=col)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(v))
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6)
    with pytest.raises(ShapeError, match="x_col"):
        fn(pool, rows, wide, w, b, x_col=W - C + 1, interpret=interpret)


def test_registered_and_bad_shapes(rng, interpret):
    for name in ("causal_conv1d", "causal_conv1d_update", "causal_conv1d_update_multi"):
        assert registry.resolve(name, "interpret").impl == "interpret"
    x, w = jnp.ones((5, 8)), jnp.ones((8, 4))
    with pytest.raises(ShapeError, match="weight"):
        causal_conv1d_pallas(x, w[:4], interpret=interpret)
    with pytest.raises(ShapeError, match="initial_states"):
        causal_conv1d_pallas(x, w, initial_states=jnp.ones((1, 8, 2)), interpret=interpret)
    rows = jnp.arange(5, dtype=jnp.int32)
    with pytest.raises(ShapeError, match="pool"):
        causal_conv1d_update_pallas(jnp.ones((5, 8, 2)), rows, x, w, interpret=interpret)
    with pytest.raises(ShapeError, match="rows"):
        causal_conv1d_update_pallas(jnp.ones((9, 8, 3)), rows[:4], x, w, interpret=interpret)
    with pytest.raises(ShapeError, match="x"):
        causal_conv1d_update_multi_pallas(jnp.ones((9, 8, 3)), rows, x, w, interpret=interpret)
    for conv in (lambda: causal_conv1d_reference(x, w, activation="relu"),
                 lambda: causal_conv1d_update_pallas(jnp.ones((9, 8, 3)), rows, x, w, activation="relu",
                                                     interpret=interpret)):
        with pytest.raises(KernelUnavailableError, match="conv1d: no kernel for activation 'relu'"):
            conv()
