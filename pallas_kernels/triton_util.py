"""Small shared helpers of the Pallas (Triton backend) kernels: argument checks, block sizes, dot precision."""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np
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


def check_row_offset(kernel: str, pool, row_offset, rows=None) -> int:
    """A decode kernel's static row_offset (added to every batch row's pool row) as an int in [0, pool rows);
    else ShapeError. With rows whose values are known (not traced: an eager call, read once), every rows + row_offset
    must be a pool row too: the kernels index the pool directly, where an index past it reads and writes memory
    that is not the pool's, and the references' gather clamps it and their scatter drops it."""
    try:
        offset = None if isinstance(row_offset, bool) else operator.index(row_offset)
    except TypeError:
        offset = None
    if offset is None or not 0 <= offset < pool.shape[0]:
        raise ShapeError(f"{kernel}: row_offset expected an int pool row in [0, {pool.shape[0]}), got {row_offset!r}")
    if (rows is not None and not isinstance(rows, jax.core.Tracer) and getattr(rows, "is_fully_addressable", True)
            and jnp.issubdtype(jnp.result_type(rows), jnp.integer)):
        known = np.asarray(rows).reshape(-1).astype(np.int64) + offset
        bad = known[(known < 0) | (known >= pool.shape[0])]
        if bad.size:
            raise ShapeError(f"{kernel}: rows expected pool rows in [0, {pool.shape[0]}) after row_offset {offset}, "
                             f"got row {int(bad[0])}")
    return offset


def check_count(kernel: str, name: str, value, minimum: int = 1, *, power_of_two: bool = False) -> int:
    """A static size (a chunk length, a block size) as an int >= minimum (a power of two when power_of_two: Triton
    block shapes must be); a bool, float or smaller value is a ShapeError naming kernel and field."""
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or n < minimum or (power_of_two and n & (n - 1)):
        want = f"a power of two >= {minimum}" if power_of_two else f"an int >= {minimum}"
        raise ShapeError(f"{kernel}: {name} expected {want}, got {value!r:.60}")
    return n


def check_blocks(kernel: str, blocks, *, powers_of_two: tuple[str, ...] = (), counts: tuple[str, ...] = (),
                 minimum: dict[str, int] | None = None) -> None:
    """A tuning dataclass's fields (by name): powers_of_two must be powers of two >= 1 (or `minimum[name]`), counts
    ints >= 1 (or `minimum[name]`). Called from the dataclasses' __post_init__, so a bad one fails where it is
    built, never inside a kernel launch (a zero divided by, a negative one broadcast)."""
    minimum = minimum or {}
    for name in powers_of_two:
        check_count(kernel, f"blocks.{name}", getattr(blocks, name), minimum.get(name, 1), power_of_two=True)
    for name in counts:
        check_count(kernel, f"blocks.{name}", getattr(blocks, name), minimum.get(name, 1))


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
