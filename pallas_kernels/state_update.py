"""Mamba-2 recurrent state update for decode: jnp references.

The state pool is passed whole, flattened to rows: state [R, H, P, N] (R = layers * slots), and each
batch row names its pool row. Rows are gathered, advanced one token (or K tokens, keeping the state
after every token for verify and rollback), and scattered back; no other row is touched.
    S = exp(dt' A) S + dt' x B^T,   y = S C + D x      (state math in float32)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import registry
from pallas_kernels.ssd import process_dt


def _step(h, x, dt, A, B, C, D):
    """One token for a batch.  h [Bt, H, P, N] f32, x [Bt, H, P], dt [Bt, H] f32, B/C [Bt, G, N]."""
    H = x.shape[1]
    rep = H // B.shape[1]
    Bh = jnp.repeat(B.astype(jnp.float32), rep, axis=1)                  # [Bt, H, N]
    Ch = jnp.repeat(C.astype(jnp.float32), rep, axis=1)
    xf = x.astype(jnp.float32)
    dA = jnp.exp(jnp.minimum(dt * A.astype(jnp.float32), 0.0))           # [Bt, H]
    h = h * dA[:, :, None, None] + (dt[:, :, None] * xf)[..., None] * Bh[:, :, None, :]
    y = jnp.sum(h * Ch[:, :, None, :], axis=-1)
    if D is not None:
        y = y + D.astype(jnp.float32)[None, :, None] * xf
    return h, y


def state_update_reference(state: jax.Array, rows: jax.Array, x: jax.Array, dt: jax.Array, A: jax.Array,
                           B: jax.Array, C: jax.Array, *, D: jax.Array | None = None,
                           dt_bias: jax.Array | None = None, dt_softplus: bool = True,
                           dt_limit: tuple[float, float] = (0.0, math.inf)) -> tuple[jax.Array, jax.Array]:
    """One token per batch row.  state [R, H, P, N], rows [Bt], x [Bt, H, P], dt [Bt, H], B/C [Bt, G, N].
    Returns (y [Bt, H, P] in x.dtype, new state)."""
    dtp = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    h, y = _step(state[rows].astype(jnp.float32), x, dtp, A, B, C, D)
    return y.astype(x.dtype), state.at[rows].set(h.astype(state.dtype))


def state_update_multi_reference(state: jax.Array, rows: jax.Array, x: jax.Array, dt: jax.Array, A: jax.Array,
                                 B: jax.Array, C: jax.Array, *, D: jax.Array | None = None,
                                 dt_bias: jax.Array | None = None, dt_softplus: bool = True,
                                 dt_limit: tuple[float, float] = (0.0, math.inf)):
    """K tokens per batch row.  x [Bt, K, H, P], dt [Bt, K, H], B/C [Bt, K, G, N].
    Returns (y [Bt, K, H, P], step_states [Bt, K, H, P, N] (state after each token), new state)."""
    dtp = process_dt(dt, dt_bias, dt_softplus, dt_limit)

    def body(h, inp):
        xk, dtk, Bk, Ck = inp
        h, y = _step(h, xk, dtk, A, B=Bk, C=Ck, D=D)
        h = h.astype(state.dtype).astype(jnp.float32)   # the state is stored between tokens
        return h, (y, h)

    swap = lambda a: jnp.swapaxes(a, 0, 1)
    h, (y, hs) = jax.lax.scan(body, state[rows].astype(jnp.float32), (swap(x), swap(dtp), swap(B), swap(C)))
    return swap(y).astype(x.dtype), swap(hs).astype(state.dtype), state.at[rows].set(h.astype(state.dtype))


registry.register("state_update", reference=state_update_reference)
registry.register("state_update_multi", reference=state_update_multi_reference)
