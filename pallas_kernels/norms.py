"""RMSNorm and the gated group RMSNorm of the Mamba-2 mixer: jnp references.

Both normalise in float32 and multiply by the weight in float32 before casting to the output dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import registry


def rmsnorm_reference(x: jax.Array, weight: jax.Array, *, eps: float, out_dtype=None) -> jax.Array:
    """y = x / sqrt(mean(x^2) + eps) * weight over the last axis.  x [..., D], weight [D]."""
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    y = xf * jax.lax.rsqrt(var + eps)
    return (y * weight.astype(jnp.float32)).astype(out_dtype or x.dtype)


def gated_rmsnorm_reference(y: jax.Array, z: jax.Array, weight: jax.Array, *, group_size: int, eps: float,
                            out_dtype=None) -> jax.Array:
    """Gate then normalise per group: rmsnorm_group(y * silu(z)) * weight.  y, z [..., I], weight [I]."""
    width = y.shape[-1]
    if width % group_size:
        raise ValueError(f"gated_rmsnorm: group_size {group_size} does not divide the width {width}")
    h = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    hg = h.reshape(*h.shape[:-1], width // group_size, group_size)
    var = jnp.mean(hg * hg, axis=-1, keepdims=True)
    h = (hg * jax.lax.rsqrt(var + eps)).reshape(h.shape)
    return (h * weight.astype(jnp.float32)).astype(out_dtype or y.dtype)


registry.register("rmsnorm", reference=rmsnorm_reference)
registry.register("gated_rmsnorm", reference=gated_rmsnorm_reference)
