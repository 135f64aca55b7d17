"""RMSNorm, the gated group RMSNorm of the Mamba-2 mixer, and the residual add + RMSNorm between two blocks:
jnp references and Pallas kernels.

Each normalises in float32 and multiplies by the weight in float32 before casting to the output dtype.
`add_rmsnorm` opens a block in decode: it adds the previous block's output projection (its split-K partials, as
the GEMV left them: split_partials.py) to the residual stream and normalises the sum, in one kernel where the
unfused step takes two (the partials' sum + residual add, then the norm); the same bits as that composition.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import registry
from pallas_kernels.split_partials import SplitPartials, chain_sum, check_partials, load_sum
from pallas_kernels.errors import ShapeError
from pallas_kernels.triton_util import check_columns, check_floating, check_shape, columns, compiler_params, next_pow2


def rmsnorm_reference(x: jax.Array, weight: jax.Array, *, eps: float, out_dtype=None) -> jax.Array:
    """y = x / sqrt(mean(x^2) + eps) * weight over the last axis.  x [..., D], weight [D]."""
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    y = xf * jax.lax.rsqrt(var + eps)
    return (y * weight.astype(jnp.float32)).astype(out_dtype or x.dtype)


def add_rmsnorm_reference(hidden: jax.Array, partials: SplitPartials, weight: jax.Array, *, eps: float,
                          out_dtype=None) -> tuple[jax.Array, jax.Array]:
    """(h, rmsnorm(h)) with h = hidden + the partials' sum (in split order, rounded to hidden's dtype): the
    residual stream after a block and the next block's normalised input.  hidden [M, D], partials [S, R >= M, D]."""
    h = hidden + chain_sum(partials, hidden.shape[0]).astype(hidden.dtype)
    return h, rmsnorm_reference(h, weight, eps=eps, out_dtype=out_dtype)


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


def _launch(M: int, BG: int) -> tuple[int, dict]:
    """(rows per program, compiler params) of a norm over groups BG wide (padded to a power of two). Shared by
    every norm kernel: Triton's row sum follows the tile's shape and warps, so one launch gives one order."""
    BM = max(1, min(next_pow2(M), 4096 // BG))
    return BM, compiler_params(4 if BM * BG <= 4096 else 8)


def _normalized(h, w_ref, cols, cm, GS, eps):
    """h [BM, BG] float32 (zero past the group) normalised per row over GS columns, times the weight (float32)."""
    var = jnp.sum(h * h, axis=1) / GS
    out = h * jax.lax.rsqrt(var + eps)[:, None]
    w = plgpu.load(w_ref.at[cols], mask=cm, other=0.0).astype(jnp.float32)
    return out * w[None, :]


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
    out = _normalized(h, w_ref, cols, cm, GS, eps)
    plgpu.store(o_ref.at[rows[:, None], cols[None, :]], out.astype(o_ref.dtype), mask=m)


@functools.partial(jax.jit, static_argnames=("group_size", "eps", "out_dtype", "gated", "interpret", "z_col"))
def _norm(x, z, weight, *, group_size, eps, out_dtype, gated, interpret, z_col=0):
    W = x.shape[-1]
    x2 = x.reshape(-1, W)
    M = x2.shape[0]
    BG = next_pow2(group_size)
    if BG > 16384:
        raise ValueError(f"rmsnorm: group width {group_size} is over the kernel's 16384")
    BM, params = _launch(M, BG)
    kernel = functools.partial(_norm_kernel, M=M, W=W, GS=group_size, BM=BM, BG=BG, eps=eps, gated=gated,
                               z_col=z_col)
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((M, W), out_dtype), grid=(W // group_size, pl.cdiv(M, BM)),
        compiler_params=params, interpret=interpret, name="rmsnorm",
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


def residual_sum(x_ref, p_ref, h_ref, at, m, *, S: int, halves: bool):
    """In a kernel: h = x + (p_0 + p_1 + ... in split order, rounded to x's dtype) at the tile `at` (mask m),
    stored to h_ref; returns h as float32. The partials as split_partials.py lays them out (halves: uint16)."""
    y = load_sum(p_ref, at, m, splits=S, halves=halves)
    x = plgpu.load(x_ref.at[at], mask=m, other=0.0)
    h = (x.astype(jnp.float32) + y.astype(x.dtype).astype(jnp.float32)).astype(h_ref.dtype)
    plgpu.store(h_ref.at[at], h, mask=m)
    return h.astype(jnp.float32)


def check_residual(name: str, hidden: jax.Array, partials: SplitPartials, weight: jax.Array) -> None:
    """The arguments of a residual add + norm: hidden [M, D] floating, weight [D], partials float32 [S, R >= M, D]
    or uint16 halves [2, S, R, D]; D at most 16384."""
    check_floating(name, "hidden", hidden)
    if hidden.ndim != 2:
        raise ShapeError(f"{name}: hidden expected [M, D], got shape {tuple(hidden.shape)}")
    M, D = hidden.shape
    check_shape(name, "weight", weight, (D,))
    check_partials(name, "partials", partials, M, D)
    if next_pow2(D) > 16384:
        raise ShapeError(f"{name}: width {D} is over the kernel's 16384")


def _add_norm_kernel(x_ref, p_ref, w_ref, h_ref, o_ref, *, M, D, S, BM, BD, eps, halves):
    """BM rows whole: h = x + bf16(p_0 + p_1 + ... in split order), stored, then normalised as `_norm_kernel`."""
    rows = pl.program_id(0) * BM + jnp.arange(BM)
    cols = jnp.arange(BD)
    cm = cols < D
    m = (rows < M)[:, None] & cm[None, :]
    at = (rows[:, None], cols[None, :])
    h = residual_sum(x_ref, p_ref, h_ref, at, m, S=S, halves=halves)
    out = _normalized(h, w_ref, cols, cm, D, eps)
    plgpu.store(o_ref.at[at], out.astype(o_ref.dtype), mask=m)


@functools.partial(jax.jit, static_argnames=("eps", "out_dtype", "interpret"))
def _add_norm(hidden, values, weight, *, eps, out_dtype, interpret):
    M, D = hidden.shape
    halves = values.dtype == jnp.uint16
    BD = next_pow2(D)
    BM, params = _launch(M, BD)          # the plain norm's launch: the same row sums, the same bits
    kernel = functools.partial(_add_norm_kernel, M=M, D=D, S=values.shape[-3], BM=BM, BD=BD, eps=eps,
                               halves=halves)
    return pl.pallas_call(
        kernel, out_shape=(jax.ShapeDtypeStruct((M, D), hidden.dtype), jax.ShapeDtypeStruct((M, D), out_dtype)),
        grid=(pl.cdiv(M, BM),), compiler_params=params, interpret=interpret, name="add_rmsnorm",
    )(hidden, values, weight)


def add_rmsnorm_pallas(hidden: jax.Array, partials: SplitPartials, weight: jax.Array, *, eps: float, out_dtype=None,
                       interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The Pallas residual add + RMSNorm; same call as `add_rmsnorm_reference`, and bitwise the unfused
    composition it fuses (the partials' chain sum, the residual add, then `rmsnorm_pallas`)."""
    check_residual("add_rmsnorm", hidden, partials, weight)
    return _add_norm(hidden, partials.values, weight, eps=float(eps), out_dtype=jnp.dtype(out_dtype or hidden.dtype),
                     interpret=interpret)


registry.register("rmsnorm", reference=rmsnorm_reference, pallas=rmsnorm_pallas)
registry.register("add_rmsnorm", reference=add_rmsnorm_reference, pallas=add_rmsnorm_pallas)
registry.register("gated_rmsnorm", reference=gated_rmsnorm_reference, pallas=gated_rmsnorm_pallas)
