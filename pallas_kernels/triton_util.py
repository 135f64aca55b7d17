"""Small shared helpers of the Pallas (Triton backend) kernels: argument checks, block sizes, dot precision."""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.errors import ShapeError


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum): Triton block shapes must be powers of two."""
    n = max(int(n), minimum)
    return 1 << (n - 1).bit_length()


def check_shape(kernel: str, name: str, value, shape: tuple) -> None:
    """Raise ShapeError unless value.shape matches shape (None = any size)."""
    got = tuple(getattr(value, "shape", ()))
    if len(got) != len(shape) or any(w is not None and w != g for w, g in zip(shape, got)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ShapeError(f"{kernel}: {name} expected shape {want}, got {list(got)}")


def check_row_offset(kernel: str, pool, row_offset) -> int:
    """A decode kernel's static row_offset (added to every batch row's pool row) as an int in [0, pool rows);
    else ShapeError."""
    try:
        offset = None if isinstance(row_offset, bool) else operator.index(row_offset)
    except TypeError:
        offset = None
    if offset is None or not 0 <= offset < pool.shape[0]:
        raise ShapeError(f"{kernel}: row_offset expected an int pool row in [0, {pool.shape[0]}), got {row_offset!r}")
    return offset


def columns(x, col: int | None, n: int):
    """Columns [col, col + n) of x's last axis (x itself when col is None): what a kernel given `col` reads in
    place, for the references."""
    return x if col is None else x[..., col:col + n]


def check_columns(kernel: str, name: str, value, lead: tuple, col: int | None, n: int) -> None:
    """value [*lead, n]; or, given col, [*lead, W] with its columns [col, col + n) inside W."""
    if col is None:
        return check_shape(kernel, name, value, (*lead, n))
    check_shape(kernel, name, value, (*lead, None))
    if not 0 <= col <= value.shape[-1] - n:
        raise ShapeError(f"{kernel}: {name} has {value.shape[-1]} columns; {name}_col {col} + {n} does not fit")


def check_floating(kernel: str, name: str, value) -> None:
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise ShapeError(f"{kernel}: {name} expected a floating dtype, got {value.dtype}")


def dot_dtype(dtype) -> jnp.dtype:
    """Operand dtype of the in-kernel matmuls: 16-bit inputs stay 16-bit (f32 accumulation), else f32."""
    dtype = jnp.dtype(dtype)
    return dtype if dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else jnp.dtype(jnp.float32)


def dot(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """2-D matmul with f32 accumulation; f32 operands use IEEE f32 (not TF32) so f32 results stay f32-exact."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    lhs = 0 if trans_a else 1
    rhs = 1 if trans_b else 0
    return jax.lax.dot_general(a, b, (((lhs,), (rhs,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def softplus(v: jax.Array) -> jax.Array:
    """log(1 + e^v) from primitives Triton lowers (no logaddexp); exact to f32 rounding."""
    return jnp.where(v > 20.0, v, jnp.log1p(jnp.exp(jnp.minimum(v, 20.0))))


def compiler_params(num_warps: int | None, num_stages: int | None = None):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
