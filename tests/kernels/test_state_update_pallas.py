"""The Pallas decode state update against the jnp reference: gathered/scattered pool rows, the rest untouched."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.errors import ShapeError
from pallas_kernels import registry
from pallas_kernels.state_update import (UpdateBlocks, state_update_multi_pallas, state_update_multi_reference,
                                         state_update_multi_xbc_pallas, state_update_multi_xbc_reference,
                                         state_update_pallas, state_update_reference, state_update_xbc_pallas,
                                         state_update_xbc_reference)
from tests.numpy_refs import rel_err

R, H, P, G, N = 9, 4, 8, 2, 16
PAD = R - 1


def _args(rng, lead, state_dtype=jnp.float32, dtype=jnp.float32, N=N):
    a = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    state = jnp.asarray(rng.standard_normal((R, H, P, N)), state_dtype)
    return state, dict(x=a(*lead, H, P), dt=jnp.asarray(rng.uniform(-3.0, 1.0, (*lead, H)), dtype),
                       A=jnp.asarray(-np.exp(rng.uniform(-1.0, 1.5, H)), jnp.float32), B=a(*lead, G, N),
                       C=a(*lead, G, N)), dict(D=jnp.asarray(rng.standard_normal(H), jnp.float32),
                                               dt_bias=jnp.asarray(rng.uniform(-1, 1, H), jnp.float32))


def _untouched(new, old, rows):
    keep = np.setdiff1d(np.arange(R), np.append(np.asarray(rows), PAD))
    np.testing.assert_array_equal(np.asarray(new)[keep], np.asarray(old)[keep])   # bitwise


@pytest.mark.parametrize("state_dtype,dtype,tol", [(jnp.float32, jnp.float32, 1e-4),
                                                   (jnp.float32, jnp.bfloat16, 1e-2),
                                                   (jnp.bfloat16, jnp.bfloat16, 1e-2)])
def test_one_token(rng, interpret, state_dtype, dtype, tol):
    rows = jnp.asarray([4, PAD, 1, PAD, 6], jnp.int32)          # two padded rows share the padding row
    state, a, kw = _args(rng, (5,), state_dtype, dtype)
    y_ref, s_ref = state_update_reference(state, rows, **a, **kw)
    y, s = state_update_pallas(state, rows, **a, **kw, interpret=interpret)
    assert y.dtype == dtype and s.dtype == state_dtype and s.shape == state.shape
    assert np.all(np.isfinite(np.asarray(y, np.float32)))        # interpret mode starts y as NaN
    live = np.asarray([0, 2, 4])
    assert rel_err(np.asarray(y, np.float32)[live], np.asarray(y_ref, np.float32)[live]) <= tol
    assert rel_err(np.asarray(s, np.float32)[[4, 1, 6]], np.asarray(s_ref, np.float32)[[4, 1, 6]]) <= tol
    _untouched(s, state, rows)


@pytest.mark.parametrize("blocks", [None, UpdateBlocks(block_p=4, num_warps=2)])
def test_k_tokens(rng, interpret, blocks):
    rows = jnp.asarray([7, 0, 3], jnp.int32)
    state, a, kw = _args(rng, (3, 4), N=12)                      # N padded to 16 in the kernel
    state = state[..., :12]
    ref = state_update_multi_reference(state, rows, **a, **kw)
    out = state_update_multi_pallas(state, rows, **a, **kw, interpret=interpret, blocks=blocks)
    for o, r in zip(out, ref):
        assert o.shape == r.shape and np.all(np.isfinite(np.asarray(o)))
        assert rel_err(o, r) <= 1e-4
    _untouched(out[2], state, rows)
    # the last per-token state is the state written back
    np.testing.assert_array_equal(np.asarray(out[1])[:, -1], np.asarray(out[2])[np.asarray(rows)])


def test_no_optional_arguments(rng, interpret):
    rows = jnp.asarray([2, 5], jnp.int32)
    state, a, _ = _args(rng, (2,))
    kw = dict(dt_softplus=False, dt_limit=(0.01, 0.3))
    a["dt"] = jnp.abs(a["dt"])
    y_ref, s_ref = state_update_reference(state, rows, **a, **kw)
    y, s = state_update_pallas(state, rows, **a, **kw, interpret=interpret)
    assert rel_err(y, y_ref) <= 1e-4 and rel_err(s, s_ref) <= 1e-4


def test_registered():
    for name in ("state_update", "state_update_multi", "state_update_xbc", "state_update_multi_xbc"):
        assert registry.resolve(name, "interpret").impl == "interpret"
        assert registry.resolve(name, "auto", platform="gpu").impl == "pallas"


def test_bad_shapes_raise(rng, interpret):
    rows = jnp.asarray([1, 2], jnp.int32)
    state, a, kw = _args(rng, (2,))
    with pytest.raises(ShapeError, match="x"):
        state_update_pallas(state, rows, **{**a, "x": a["x"][:, :, :3]}, interpret=interpret)
    with pytest.raises(ShapeError, match="rows"):
        state_update_pallas(state, rows[:1], **a, interpret=interpret)
    _, m, _ = _args(rng, (2, 3))
    with pytest.raises(ShapeError, match="dt"):
        state_update_multi_pallas(state, rows, **{**m, "dt": m["dt"][:, :2]}, interpret=interpret)


def _packed(rng, a, lead, dt_col):
    """a's x, B, C packed as the conv output lays them out, and dt inside a wider array at dt_col."""
    flat = lambda v: v.reshape(*lead, -1)
    xbc = jnp.concatenate([flat(a["x"]), flat(a["B"]), flat(a["C"])], axis=-1)
    pad = lambda n: jnp.asarray(rng.standard_normal((*lead, n)), a["dt"].dtype)
    return xbc, jnp.concatenate([pad(dt_col), a["dt"], pad(3)], axis=-1)


@pytest.mark.parametrize("multi", [False, True])
def test_packed_operands_read_in_place(rng, interpret, multi):
    """The xbc forms read x, B, C from the packed conv output and dt from its columns: the same bits as the
    unpacked kernel, and the reference cuts the same operands."""
    rows = jnp.asarray([4, 0, 6], jnp.int32)
    lead = (3, 2) if multi else (3,)
    state, a, kw = _args(rng, lead)
    xbc, wide = _packed(rng, a, lead, dt_col=5)
    plain, packed = ((state_update_multi_pallas, state_update_multi_xbc_pallas) if multi
                     else (state_update_pallas, state_update_xbc_pallas))
    ref_fn = state_update_multi_xbc_reference if multi else state_update_xbc_reference
    got = packed(state, rows, xbc, wide, a["A"], dt_col=5, **kw, interpret=interpret)
    want = plain(state, rows, **a, **kw, interpret=interpret)
    ref = ref_fn(state, rows, xbc, wide, a["A"], dt_col=5, **kw)
    for g, w, r in zip(got, want, ref):
        assert g.shape == w.shape and np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        assert rel_err(g, r) <= 1e-4
    _untouched(got[-1], state, rows)
    if not multi:                                                 # dt on its own ([Bt, H], no dt_col)
        y, _ = state_update_xbc_pallas(state, rows, xbc, a["dt"], a["A"], **kw, interpret=interpret)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(want[0]))


@pytest.mark.parametrize("multi", [False, True])
def test_decay_rates_from_a_log(rng, interpret, multi):
    """A_log in place of A: the kernel computes A = -exp(A_log) itself, matching the reference given A and A_log."""
    rows = jnp.asarray([4, 0, 6], jnp.int32)
    lead = (3, 2) if multi else (3,)
    state, a, kw = _args(rng, lead)
    A_log = jnp.asarray(rng.uniform(-1.0, 2.5, H), jnp.float32)
    xbc, wide = _packed(rng, a, lead, dt_col=5)
    packed, ref_fn = ((state_update_multi_xbc_pallas, state_update_multi_xbc_reference) if multi
                      else (state_update_xbc_pallas, state_update_xbc_reference))
    got = packed(state, rows, xbc, wide, dt_col=5, A_log=A_log, **kw, interpret=interpret)
    from_log = ref_fn(state, rows, xbc, wide, dt_col=5, A_log=A_log, **kw)
    given = ref_fn(state, rows, xbc, wide, -jnp.exp(A_log), dt_col=5, **kw)
    for g, r, w in zip(got, from_log, given):
        assert np.all(np.isfinite(np.asarray(g)))
        np.testing.assert_array_equal(np.asarray(r), np.asarray(w))
        assert rel_err(g, r) <= 1e-4
    _untouched(got[-1], state, rows)
    for bad in (dict(A=a["A"], A_log=A_log), dict()):
        with pytest.raises(ShapeError, match="A_log"):
            packed(state, rows, xbc, wide, dt_col=5, **bad, interpret=interpret)
        with pytest.raises(ShapeError, match="A_log"):
            ref_fn(state, rows, xbc, wide, dt_col=5, **bad)


def test_packed_bad_shapes_raise(rng, interpret):
    rows = jnp.asarray([1, 2], jnp.int32)
    state, a, kw = _args(rng, (2,))
    xbc, wide = _packed(rng, a, (2,), dt_col=5)
    with pytest.raises(ShapeError, match="xbc"):
        state_update_xbc_pallas(state, rows, xbc[:, :-1], a["dt"], a["A"], interpret=interpret)
    with pytest.raises(ShapeError, match="dt_col"):
        state_update_xbc_pallas(state, rows, xbc, wide, a["A"], dt_col=wide.shape[1] - H + 1, interpret=interpret)
    with pytest.raises(ShapeError, match="dt"):
        state_update_xbc_pallas(state, rows, xbc, wide, a["A"], interpret=interpret)     # wide dt, no dt_col
    with pytest.raises(ShapeError, match="rows"):
        state_update_xbc_pallas(state, rows[:1], xbc, a["dt"], a["A"], interpret=interpret)


@pytest.mark.gpu
def test_donated_pool_is_updated_in_place(rng):
    """Under jit with the pool donated, the output pool is the input's buffer: no copy of the pool."""
    state, a, kw = _args(rng, (3,))
    state = jnp.tile(state, (64, 1, 1, 1))                        # 576 rows: a copy would be visible
    rows = jnp.asarray([5, 300, 17], jnp.int32)
    before = np.asarray(state)
    ptr = state.unsafe_buffer_pointer()
    step = jax.jit(functools.partial(state_update_pallas, **kw), donate_argnums=0)
    y, new = step(state, rows, **a)
    assert new.unsafe_buffer_pointer() == ptr
    y_ref, s_ref = state_update_reference(jnp.asarray(before), rows, **a, **kw)
    assert rel_err(new, s_ref) <= 1e-4 and rel_err(y, y_ref) <= 1e-4
    keep = np.setdiff1d(np.arange(before.shape[0]), np.asarray(rows))
    np.testing.assert_array_equal(np.asarray(new)[keep], before[keep])


@pytest.mark.parametrize("multi", [False, True])
def test_skip_row_is_neither_read_nor_written(rng, interpret, multi):
    """skip_row (the padding row, named by two batch rows here): its state stays bitwise as it was, its rows run from
    a zero state (finite padding: the reference's zero-state update), and the live rows get what they get without
    skip_row (to an ulp: XLA:CPU may contract the interpreted update into FMAs differently); the reference does the
    same."""
    rows = jnp.asarray([4, PAD, 1, PAD], jnp.int32)
    lead = (4, 3) if multi else (4,)
    state, a, kw = _args(rng, lead)
    state = state.at[PAD].set(jnp.nan)                            # a read of the padding row would show
    kernel, reference = ((state_update_multi_pallas, state_update_multi_reference) if multi
                         else (state_update_pallas, state_update_reference))
    got = kernel(state, rows, **a, **kw, skip_row=PAD, interpret=interpret)
    plain = kernel(state, rows, **a, **kw, interpret=interpret)
    ref = reference(state, rows, **a, **kw, skip_row=PAD)
    zero = reference(state.at[PAD].set(0.0), rows, **a, **kw)     # the padding rows' outputs from a zero state
    live, pad = np.asarray([0, 2]), np.asarray([1, 3])
    for g, p, r, z in zip(got, plain, ref, zero):
        g, p, r, z = (np.asarray(v, np.float32) for v in (g, p, r, z))
        if g.shape[0] == R:                                        # the pool
            assert rel_err(g[[4, 1]], p[[4, 1]]) <= 1e-6
            assert np.isnan(g[PAD]).all() and np.isnan(r[PAD]).all()
            assert rel_err(g[[4, 1]], r[[4, 1]]) <= 1e-4
            _untouched(g, np.asarray(state, np.float32), rows)
        else:                                                      # y (and the per-token states)
            assert rel_err(g[live], p[live]) <= 1e-6
            assert np.all(np.isfinite(g)) and rel_err(g[pad], z[pad]) <= 1e-4 and rel_err(g, r) <= 1e-4


@pytest.mark.parametrize("multi", [False, True])
def test_row_offset_is_added_to_every_row(rng, interpret, multi):
    """row_offset (a layer's block of the flattened pool): the kernel and the reference with (slots, offset) give
    bitwise what they give with the rows slots + offset; skip_row names the offset row; a row_offset outside the
    pool raises."""
    slots, offset = jnp.asarray([1, 3, 0, 3], jnp.int32), 5           # rows 6, 8 (= PAD), 5, 8
    lead = (4, 2) if multi else (4,)
    state, a, kw = _args(rng, lead)
    kernel, reference = ((state_update_multi_pallas, state_update_multi_reference) if multi
                         else (state_update_pallas, state_update_reference))
    for fn, extra in ((kernel, dict(interpret=interpret)), (reference, {})):
        got = fn(state, slots, **a, **kw, row_offset=offset, skip_row=PAD, **extra)
        want = fn(state, slots + offset, **a, **kw, skip_row=PAD, **extra)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
        pool = np.asarray(got[-1] if not multi else got[2])
        _untouched(pool, np.asarray(state), slots + offset)
        assert not np.array_equal(pool[[6, 5]], np.asarray(state)[[6, 5]])      # the offset rows were written
        for bad in (R, -1, 1.0, True):
            with pytest.raises(ShapeError, match="row_offset"):
                fn(state, slots, **a, **kw, row_offset=bad, **extra)
