"""RMSNorm and the gated group RMSNorm of the Mamba-2 mixer: jnp references and Pallas kernels.

Both normalise in float32 and multiply by the weight in float32 before casting to the output dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import registry
from pallas_kernels.triton_util import check_columns, check_floating, check_shape, columns, compiler_params, next_pow2


def rmsnorm_reference(x: jax.Array, weight: jax.Array, *, eps: float, out_dtype=None) -> jax.Array:
    """y = x / sqrt(mean(x^2) + eps) * weight over the last axis.  x [..., D], weight [D]."""
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    y = xf * jax.lax.rsqrt(var + eps)
    return (y * weight.astype(jnp.float32)).astype(out_dtype or x.dtype)


def gated_rmsnorm_reference(y: jax.Array, z: jax.Array, weight: jax.Array, *, group_size: int, eps: float,
                            out_dtype=None, z_col: int | None = None) -> jax.Array:
    """Gate then normalise per group: rmsnorm_group(y * silu(z)) * weight.  y, z [..., I], weight [I].
    With z_col, z [..., W] holds the gate in its columns [z_col, z_col + I) (the Mamba-2 in_proj output)."""
    width = y.shape[-1]
    if width % group_size:
        raise ValueError(f"gated_rmsnorm: group_size {group_size} does not divide the width {width}")
    z = columns(z, z_col, width)
    h = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    hg = h.reshape(*h.shape[:-1], width // group_size, group_size)
    var = jnp.mean(hg * hg, axis=-1, keepdims=True)
    h = (hg * jax.lax.rsqrt(var + eps)).reshape(h.shape)
    return (h * weight.astype(jnp.float32)).astype(out_dtype or y.dtype)


# ---- Pallas (Triton backend) ---------------------------------------------------------------------------------
# One program normalises BM rows of one group (the plain RMSNorm is one group of the whole width) held in
# registers: read once, write once. Width up to 16384 per group in one block.


def _norm_kernel(x_ref, z_ref, w_ref, o_ref, *, M, W, GS, BM, BG, eps, gated, z_col):
    g, i = pl.program_id(0), pl.program_id(1)
    f32 = jnp.float32
    rows = i * BM + jnp.arange(BM)
    cols = g * GS + jnp.arange(BG)
    cm = jnp.arange(BG) < GS
    m = (rows < M)[:, None] & cm[None, :]
    h = plgpu.load(x_ref.at[rows[:, None], cols[None, :]], mask=m, other=0.0).astype(f32)
    if gated:
        z = plgpu.load(z_ref.at[rows[:, None], z_col + cols[None, :]], mask=m, other=0.0).astype(f32)
        h = h * (z * jax.nn.sigmoid(z))
    var = jnp.sum(h * h, axis=1) / GS
    out = h * jax.lax.rsqrt(var + eps)[:, None]
    w = plgpu.load(w_ref.at[cols], mask=cm, other=0.0).astype(f32)
    plgpu.store(o_ref.at[rows[:, None], cols[None, :]], (out * w[None, :]).astype(o_ref.dtype), mask=m)


@functools.partial(jax.jit, static_argnames=("group_size", "eps", "out_dtype", "gated", "interpret", "z_col"))
def _norm(x, z, weight, *, group_size, eps, out_dtype, gated, interpret, z_col=0):
    W = x.shape[-1]
    x2 = x.reshape(-1, W)
    M = x2.shape[0]
    BG = next_pow2(group_size)
    if BG > 16384:
        raise ValueError(f"rmsnorm: group width {group_size} is over the kernel's 16384")
    BM = max(1, min(next_pow2(M), 4096 // BG))
    kernel = functools.partial(_norm_kernel, M=M, W=W, GS=group_size, BM=BM, BG=BG, eps=eps, gated=gated,
                               z_col=z_col)
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((M, W), out_dtype), grid=(W // group_size, pl.cdiv(M, BM)),
        compiler_params=compiler_params(4 if BM * BG <= 4096 else 8), interpret=interpret, name="rmsnorm",
    )(x2, x2 if z is None else z.reshape(M, z.shape[-1]), weight)
    return out.reshape(x.shape)


def rmsnorm_pallas(x: jax.Array, weight: jax.Array, *, eps: float, out_dtype=None,
                   interpret: bool = False) -> jax.Array:
    """The Pallas RMSNorm; same call and results as `rmsnorm_reference`."""
    check_floating("rmsnorm", "x", x)
    check_shape("rmsnorm", "weight", weight, (x.shape[-1],))
    return _norm(x, None, weight, group_size=x.shape[-1], eps=float(eps),
                 out_dtype=jnp.dtype(out_dtype or x.dtype), gated=False, interpret=interpret)


def gated_rmsnorm_pallas(y: jax.Array, z: jax.Array, weight: jax.Array, *, group_size: int, eps: float,
                         out_dtype=None, z_col: int | None = None, interpret: bool = False) -> jax.Array:
    """The Pallas gated group RMSNorm; same call and results as `gated_rmsnorm_reference` (z's columns read
    in place when z_col is given)."""
    width = y.shape[-1]
    if width % group_size:
        raise ValueError(f"gated_rmsnorm: group_size {group_size} does not divide the width {width}")
    check_floating("gated_rmsnorm", "y", y)
    check_columns("gated_rmsnorm", "z", z, y.shape[:-1], z_col, width)
    check_shape("gated_rmsnorm", "weight", weight, (width,))
    return _norm(y, z, weight, group_size=group_size, eps=float(eps), out_dtype=jnp.dtype(out_dtype or y.dtype),
                 gated=True, interpret=interpret, z_col=z_col or 0)


registry.register("rmsnorm", reference=rmsnorm_reference, pallas=rmsnorm_pallas)
registry.register("gated_rmsnorm", reference=gated_rmsnorm_reference, pallas=gated_rmsnorm_pallas)
