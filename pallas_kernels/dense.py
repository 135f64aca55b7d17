"""Dense (BF16 / F32) projection y = x W^T: jnp reference.

W is stored [N, K] as in the checkpoint. The reference is batch invariant: a row's result does not
depend on the other rows (XLA:CPU routes a single row to a GEMV that sums in another order, so a
single row is computed as the first of two).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import registry


def dense_matmul_reference(x: jax.Array, w: jax.Array, *, out_dtype=None) -> jax.Array:
    """x [M, K], w [N, K] -> [M, N], float32 accumulation, cast to out_dtype (default x.dtype)."""
    M = x.shape[0]
    xp = jnp.concatenate([x, x], axis=0) if M == 1 else x
    y = jax.lax.dot_general(xp, w.astype(x.dtype), (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return y[:M].astype(out_dtype or x.dtype)


registry.register("dense_matmul", reference=dense_matmul_reference)
