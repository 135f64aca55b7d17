"""Shared pieces of the SSD kernel tests (Triton and Mosaic GPU arms): random inputs, the call, the comparison
against the reference (unwritten rows poisoned as NaN fail it)."""

import jax
import jax.numpy as jnp
import numpy as np

from tests.numpy_refs import rel_err


def ssd_inputs(rng, T, S, H, P, G, N, dtype):
    a = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)
    return dict(
        x=a(T, H, P), dt=jnp.asarray(rng.uniform(-4.0, 1.0, (T, H)), jnp.float32),
        A=jnp.asarray(-np.exp(rng.uniform(-1.0, 1.5, H)), jnp.float32), B=a(T, G, N), C=a(T, G, N),
        D=jnp.asarray(rng.standard_normal(H), jnp.float32), dt_bias=jnp.asarray(rng.uniform(-1, 1, H), jnp.float32),
        initial_states=jnp.asarray(rng.standard_normal((S, H, P, N)), jnp.float32))


def cu_seqlens(lens):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)


def call_ssd(fn, inp, **kw):
    i = dict(inp)
    return fn(i.pop("x"), i.pop("dt"), i.pop("A"), i.pop("B"), i.pop("C"), **i, **kw)


def compare_ssd(out, ref, tol, chunks=False):
    y = np.asarray(out.y, np.float32)
    assert out.y.dtype == ref.y.dtype and out.final_states.dtype == jnp.float32
    assert np.all(np.isfinite(y)), "y has unwritten (NaN) or non-finite rows"
    assert np.all(np.isfinite(np.asarray(out.final_states))), "final states not all written"
    assert rel_err(y, ref.y) <= tol
    assert rel_err(out.final_states, ref.final_states) <= tol
    if chunks:
        v = np.asarray(ref.chunk_states.valid)
        np.testing.assert_array_equal(np.asarray(out.chunk_states.valid), v)
        np.testing.assert_array_equal(np.asarray(out.chunk_states.seq)[v], np.asarray(ref.chunk_states.seq)[v])
        np.testing.assert_array_equal(np.asarray(out.chunk_states.end_pos), np.asarray(ref.chunk_states.end_pos))
        assert rel_err(out.chunk_states.states[v], ref.chunk_states.states[v]) <= tol
        assert np.all(np.asarray(out.chunk_states.states)[~v] == 0)   # written, not left as poison


def check_offsets_past_4gib(rng, scan, reference, shape: dict, tol: float) -> None:
    """x and y over 4 GiB (GPU): the second sequence lies past element 2**31 and must match its own scan."""
    H, P, G, N = shape["H"], shape["P"], shape["G"], shape["N"]
    tail = 300
    T = (1 << 31) // (H * P) + 2 * tail
    kx, kb, kc, kd = jax.random.split(jax.random.key(int(rng.integers(2**31))), 4)
    x = jax.random.normal(kx, (T, H, P), jnp.bfloat16)
    B = jax.random.normal(kb, (T, G, N), jnp.bfloat16)
    C = jax.random.normal(kc, (T, G, N), jnp.bfloat16)
    dt = jax.random.uniform(kd, (T, H), jnp.bfloat16, -4.0, 1.0)
    A = jnp.asarray(-np.exp(rng.uniform(-1.0, 1.5, H)), jnp.float32)
    h0 = jnp.asarray(rng.standard_normal((2, H, P, N)), jnp.float32)
    cu = jnp.asarray([0, T - tail, T], jnp.int32)
    out = scan(x, dt, A, B, C, chunk_size=128, initial_states=h0, cu_seqlens=cu)
    ref = reference(x[T - tail:], dt[T - tail:], A, B[T - tail:], C[T - tail:], chunk_size=128,
                    initial_states=h0[1:])
    assert rel_err(out.y[T - tail:], ref.y) <= tol
    assert rel_err(out.final_states[1], ref.final_states[0]) <= tol
