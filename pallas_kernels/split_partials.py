"""Split-K partial sums of a decode GEMV, handed on unreduced to a kernel that adds them itself.

A GEMV whose K is split over CTAs writes one float32 partial per split; the sum of the partials in split order
(a chain of elementwise adds: the same bits whatever the shape) is the output. A consumer that reads them anyway
(the residual add + RMSNorm after an output projection, `norms.add_rmsnorm`; decode attention's new keys and
values, `attention.decode_attention`) takes the partials instead of the sum, saving the sum's kernel; in a kernel
`load_sum` adds them as `chain_sum` does. Two layouts, both row-major:

  float32 [S, R, N]:        the Triton arms' partials (S = 1: an unsplit launch's float32 output)
  uint16  [2, S, R, N]:     the Mosaic arms' partials as the high and low 16 bits of each float32 (a transposed
                            32-bit store to shared memory does not lower; two 16-bit ones do)

R >= M rows (padding rows past M are never read by a consumer).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.errors import ShapeError


class SplitPartials(NamedTuple):
    """values: float32 [S, R, N] or uint16 halves [2, S, R, N] (see the module docstring)."""
    values: jax.Array

    @property
    def halves(self) -> bool:
        return self.values.dtype == jnp.uint16

    @property
    def splits(self) -> int:
        return self.values.shape[-3]

    @property
    def rows(self) -> int:
        return self.values.shape[-2]

    @property
    def width(self) -> int:
        return self.values.shape[-1]


def join_halves(hi: jax.Array, lo: jax.Array) -> jax.Array:
    """The float32 whose high / low 16 bits are hi / lo (uint16, any shape)."""
    return lax.bitcast_convert_type((hi.astype(jnp.uint32) << 16) | lo.astype(jnp.uint32), jnp.float32)


def split_halves(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(high, low) 16 bits of float32 x as uint16: the inverse of `join_halves`."""
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    return (bits >> 16).astype(jnp.uint16), bits.astype(jnp.uint16)


def partial(p: SplitPartials, s: int) -> jax.Array:
    """Split s's float32 partial [R, N]."""
    return join_halves(p.values[0, s], p.values[1, s]) if p.halves else p.values[s]


def chain_sum(p: SplitPartials, M: int) -> jax.Array:
    """The output rows [M, N] in float32: partial 0 + partial 1 + ... in split order."""
    y = partial(p, 0)[:M]
    for s in range(1, p.splits):
        y = y + partial(p, s)[:M]
    return y


def load_sum(ref, at: tuple, mask, *, splits: int, halves: bool) -> jax.Array:
    """In a Pallas Triton kernel: the partials ref (SplitPartials.values) at the tile `at` (the indices after the
    split axes: row, column), summed in split order in float32, as `chain_sum` sums them (0 where masked)."""
    def part(s):
        if halves:
            hi, lo = (plgpu.load(ref.at[half, s, *at], mask=mask, other=0) for half in range(2))
            return join_halves(hi, lo)
        return plgpu.load(ref.at[s, *at], mask=mask, other=0.0)

    y = part(0)
    for s in range(1, splits):
        y = y + part(s)
    return y


def check_partials(kernel: str, name: str, p: SplitPartials, rows: int, width: int) -> None:
    """p: float32 [S, R >= rows, width] or uint16 halves [2, S, R, width], else a ShapeError naming the argument."""
    v = p.values
    lead = (2,) if p.halves else ()
    if (v.dtype not in (jnp.float32, jnp.uint16) or v.ndim != len(lead) + 3 or v.shape[:len(lead)] != lead
            or v.shape[-3] < 1 or v.shape[-2] < rows or v.shape[-1] != width):
        raise ShapeError(f"{kernel}: {name} expected float32 [S, R >= {rows}, {width}] or uint16 halves "
                         f"[2, S, R, {width}] (split partials), got {v.dtype} {tuple(v.shape)}")


def of_output(y: jax.Array) -> SplitPartials:
    """A finished float32 output [M, N] as one partial (an unsplit launch, or one reduced in the kernel)."""
    return SplitPartials(y.astype(jnp.float32)[None])


def check_unreduced(kernel: str, unreduced: bool, epilogue, out_dtype) -> None:
    """An unreduced call hands on float32 partials: no epilogue (it applies to the sum), no other output dtype."""
    if unreduced and (epilogue is not None or (out_dtype is not None and jnp.dtype(out_dtype) != jnp.float32)):
        raise ShapeError(f"{kernel}: unreduced=True returns float32 split partials: it takes no epilogue and "
                         f"out_dtype float32 (or none); got epilogue={epilogue!r}, out_dtype={out_dtype}")
