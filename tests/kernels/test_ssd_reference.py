"""The chunked SSD reference against an independent float64 token recurrence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ssd
from pallas_kernels.ssd import ssd_scan_batched
from tests.numpy_refs import rel_err, ssm_recurrence

# jitted once per shape: op-by-op dispatch of the reference costs seconds per call on the CPU
ssd_scan_reference = jax.jit(ssd.ssd_scan_reference, static_argnames=(
    "chunk_size", "dt_softplus", "dt_limit", "return_chunk_states", "precision"))

H, P, G, N = 4, 8, 2, 16


def _inputs(rng, T, S=1):
    x = rng.standard_normal((T, H, P)).astype(np.float32)
    dt = rng.uniform(-4.0, 1.0, (T, H)).astype(np.float32)
    A = -np.exp(rng.uniform(-1.0, 1.5, H)).astype(np.float32)
    B = rng.standard_normal((T, G, N)).astype(np.float32)
    C = rng.standard_normal((T, G, N)).astype(np.float32)
    D = rng.standard_normal(H).astype(np.float32)
    dt_bias = rng.uniform(-1.0, 1.0, H).astype(np.float32)
    h0 = rng.standard_normal((S, H, P, N)).astype(np.float32)
    return x, dt, A, B, C, D, dt_bias, h0


# T = 1 (one token, one part-filled chunk), 37 (a tail after whole chunks of 16, less than one chunk of 48 / 100)
# and 128 (whole chunks of 16, a tail after chunks of 48 and of 100) cover every chunking path of the reference at
# each chunk size; 300 and 513 (more and longer chunks of the same paths) run with --run-slow.
@pytest.mark.parametrize("T", [1, 37, 128, pytest.param(300, marks=pytest.mark.slow),
                               pytest.param(513, marks=pytest.mark.slow)])
@pytest.mark.parametrize("chunk", [16, 48, 100])
@pytest.mark.parametrize("with_init", [False, True])
def test_chunked_matches_float64_recurrence(rng, T, chunk, with_init):
    x, dt, A, B, C, D, dt_bias, h0 = _inputs(rng, T)
    out = ssd_scan_reference(jnp.asarray(x), jnp.asarray(dt), jnp.asarray(A), jnp.asarray(B), jnp.asarray(C),
                             chunk_size=chunk, D=jnp.asarray(D), dt_bias=jnp.asarray(dt_bias),
                             initial_states=jnp.asarray(h0) if with_init else None)
    y_ref, h_ref = ssm_recurrence(x, dt, A, B, C, D, dt_bias, h0=h0[0] if with_init else None)
    assert out.y.dtype == jnp.float32 and out.final_states.shape == (1, H, P, N)
    assert rel_err(out.y, y_ref) <= 1e-5
    assert rel_err(out.final_states[0], h_ref) <= 1e-5


def test_varlen_matches_each_sequence(rng):
    lens = [5, 0, 70, 33, 1]
    T = sum(lens) + 3                       # three trailing pad rows
    x, dt, A, B, C, D, dt_bias, h0 = _inputs(rng, T, S=len(lens))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    out = ssd_scan_reference(*(jnp.asarray(a) for a in (x, dt, A, B, C)), chunk_size=16, D=jnp.asarray(D),
                             dt_bias=jnp.asarray(dt_bias), initial_states=jnp.asarray(h0),
                             cu_seqlens=jnp.asarray(cu), return_chunk_states=True)
    for s, L in enumerate(lens):
        sl = slice(cu[s], cu[s + 1])
        y_ref, h_ref = ssm_recurrence(x[sl], dt[sl], A, B[sl], C[sl], D, dt_bias, h0=h0[s])
        if L:
            assert rel_err(out.y[sl], y_ref) <= 1e-5
        assert rel_err(out.final_states[s], h_ref) <= 1e-5
    assert np.all(np.asarray(out.y[cu[-1]:]) == 0)
    # chunk states: each valid row equals the recurrence state at its end position
    cs = out.chunk_states
    checked = 0
    for c in np.flatnonzero(np.asarray(cs.valid)):
        s, e = int(cs.seq[c]), int(cs.end_pos[c])
        sl = slice(cu[s], cu[s] + e)
        _, h_ref = ssm_recurrence(x[sl], dt[sl], A, B[sl], C[sl], D, dt_bias, h0=h0[s])
        assert rel_err(cs.states[c], h_ref) <= 1e-5
        checked += 1
    assert checked == sum(-(-L // 16) for L in lens)


def test_dt_limit_and_long_decay_stay_finite(rng):
    T = 400
    x, dt, A, B, C, D, dt_bias, _ = _inputs(rng, T)
    dt = np.full_like(dt, 30.0)              # softplus ~ 30: exp(dt * A) underflows hard
    out = ssd_scan_reference(*(jnp.asarray(a) for a in (x, dt, A, B, C)), chunk_size=128,
                             dt_limit=(0.0, 0.5))
    y_ref, _ = ssm_recurrence(x, dt, A, B, C, dt_limit=(0.0, 0.5))
    assert np.all(np.isfinite(np.asarray(out.y)))
    assert rel_err(out.y, y_ref) <= 1e-5


def test_equal_length_batch(rng):
    Bt, L = 3, 50
    x, dt, A, B, C, D, dt_bias, h0 = _inputs(rng, Bt * L, S=Bt)
    r = lambda a: jnp.asarray(a.reshape(Bt, L, *a.shape[1:]))
    out = ssd_scan_batched(ssd_scan_reference, r(x), r(dt), jnp.asarray(A), r(B), r(C), chunk_size=32,
                           D=jnp.asarray(D), dt_bias=jnp.asarray(dt_bias), initial_states=jnp.asarray(h0))
    assert out.y.shape == (Bt, L, H, P)
    for b in range(Bt):
        sl = slice(b * L, (b + 1) * L)
        y_ref, h_ref = ssm_recurrence(x[sl], dt[sl], A, B[sl], C[sl], D, dt_bias, h0=h0[b])
        assert rel_err(out.y[b], y_ref) <= 1e-5
        assert rel_err(out.final_states[b], h_ref) <= 1e-5
