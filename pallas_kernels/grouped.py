"""Grouped (MoE) quantized matmuls: rows of x sorted by expert, each group times its own expert's weights.

    y[r] = x[r] @ W[e(r)]^T      rows r of group e: sum(group_sizes[:e]) <= r < sum(group_sizes[:e+1])

the `jax.lax.ragged_dot_general` of the routed experts, with the experts' weights kept quantized:
  w8a16_grouped   block-FP8 experts: w E4M3 [E, N, K], scale f32 [E, ceil(N/128), ceil(K/128)]
  w4a16_grouped   NVFP4 experts: packed uint8 [E, N, K/2], scale E4M3 [E, N, K/16], global f32 [E]
Rows past sum(group_sizes) come out 0. Output float32 [M, N]. The Pallas kernels are the w8a16 / w4a16
ones with a row-tile map: each tile of block_m rows lies inside one group (`group_tiles`), so a tile
reads one expert's weights; tiles never depend on the other groups' sizes beyond their position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.errors import ShapeError
from pallas_kernels.formats import NVFP4_GROUP, block_grid, dequantize_nvfp4, expand_block_scale
from pallas_kernels import registry
from pallas_kernels.w4a16 import W4Blocks, _w4_call
from pallas_kernels.w8a16 import QuantBlocks, _w8a16_call, check_activations, check_array, fit_blocks


def ragged_matmul_f32(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [M, K] (rows sorted by group) @ w[e]^T for w [E, N, K], in float32 (IEEE)."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))
    return jax.lax.ragged_dot_general(x.astype(jnp.float32), w.astype(jnp.float32), group_sizes, dims,
                                      precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def group_tiles(group_sizes: jax.Array, M: int, block_m: int) -> jax.Array:
    """Row tiles that never straddle two groups: [3, tiles] int32 (expert, first row, rows in the tile).
    A group of s rows takes ceil(s / block_m) tiles, so cdiv(M, block_m) + min(E, M) tiles always suffice
    (a static count); the unused ones have 0 rows."""
    E = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    count = -(-sizes // block_m)                                  # tiles per group
    tile_end = jnp.cumsum(count)
    row_start = jnp.cumsum(sizes) - sizes
    t = jnp.arange(pl.cdiv(M, block_m) + min(E, M), dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), E - 1).astype(jnp.int32)
    local = t - (tile_end[g] - count[g])                         # tile index inside its group
    rows = jnp.where(t < tile_end[-1], jnp.clip(sizes[g] - local * block_m, 0, block_m), 0)
    return jnp.stack([g, row_start[g] + local * block_m, rows]).astype(jnp.int32)


def _zero_past_groups(y: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Rows past the last group belong to no tile (never written): 0, as ragged_dot gives."""
    return jnp.where((jnp.arange(y.shape[0]) < group_sizes.sum())[:, None], y, 0)


def _check_groups(kernel: str, group_sizes, E: int, M: int) -> None:
    if getattr(group_sizes, "shape", None) != (E,) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ShapeError(f"{kernel}: group_sizes expected an integer [{E}] (one size per expert), got "
                         f"{jnp.dtype(group_sizes.dtype).name}{list(getattr(group_sizes, 'shape', ()))}")


# ---- block FP8 -----------------------------------------------------------------------------------------
def _check_w8(kernel, x, w, scale, group_sizes):
    if w.ndim != 3 or jnp.dtype(w.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise ShapeError(f"{kernel}: w expected float8_e4m3fn [E, N, K], got {jnp.dtype(w.dtype).name}{list(w.shape)}")
    E, N, K = w.shape
    check_activations(kernel, x, K)
    check_array(kernel, "scale", scale, jnp.float32, (E, *block_grid(N, K)))
    _check_groups(kernel, group_sizes, E, x.shape[0])


def w8a16_grouped_reference(x, w, scale, group_sizes, *, out_dtype=jnp.float32):
    """Dequantize every expert, then the ragged matmul in float32."""
    _check_w8("w8a16_grouped", x, w, scale, group_sizes)
    E, N, K = w.shape
    wd = w.astype(jnp.float32) * jax.vmap(lambda s: expand_block_scale(s, N, K))(scale)
    return ragged_matmul_f32(x, wd, group_sizes).astype(out_dtype)


def grouped_blocks(N: int, K: int, nvfp4: bool) -> QuantBlocks:
    """Tiles from the expert shape only: 16-row tiles (a decode step routes few rows to each expert)."""
    bn = 64 if N >= 64 else 32
    if nvfp4:
        return W4Blocks(block_m=16, block_n=bn, block_k=128, num_warps=4, num_stages=3, decode="asm")
    return QuantBlocks(block_m=16, block_n=bn, block_k=128, num_warps=4, num_stages=3)


def w8a16_grouped_pallas(x, w, scale, group_sizes, *, out_dtype=jnp.float32, interpret: bool = False,
                         blocks: QuantBlocks | None = None):
    """Pallas form of `w8a16_grouped_reference` (the w8a16 kernel over a group row-tile map)."""
    _check_w8("w8a16_grouped", x, w, scale, group_sizes)
    E, N, K = w.shape
    blk = fit_blocks(blocks or grouped_blocks(N, K, nvfp4=False), 16, K)
    tiles = group_tiles(group_sizes, x.shape[0], blk.block_m)
    y = _w8a16_call(x, w, scale, tiles, out_dtype=jnp.dtype(out_dtype), blocks=blk, interpret=interpret,
                    name="w8a16_grouped")
    return _zero_past_groups(y, group_sizes)


# ---- NVFP4 ---------------------------------------------------------------------------------------------
def _check_w4(kernel, x, packed, scale, global_scale, group_sizes):
    if packed.ndim != 3 or jnp.dtype(packed.dtype) != jnp.dtype(jnp.uint8):
        raise ShapeError(f"{kernel}: packed expected uint8 [E, N, K/2], got "
                         f"{jnp.dtype(packed.dtype).name}{list(packed.shape)}")
    E, N, half = packed.shape
    K = 2 * half
    if K % NVFP4_GROUP:
        raise ShapeError(f"{kernel}: K = {K} is not a multiple of {NVFP4_GROUP}")
    check_activations(kernel, x, K)
    check_array(kernel, "scale", scale, jnp.float8_e4m3fn, (E, N, K // NVFP4_GROUP))
    check_array(kernel, "global_scale", global_scale, jnp.float32, (E,))
    _check_groups(kernel, group_sizes, E, x.shape[0])


def w4a16_grouped_reference(x, packed, scale, global_scale, group_sizes, *, out_dtype=jnp.float32):
    """Dequantize every expert, then the ragged matmul in float32."""
    _check_w4("w4a16_grouped", x, packed, scale, global_scale, group_sizes)
    wd = jax.vmap(dequantize_nvfp4)(packed, scale, global_scale)
    return ragged_matmul_f32(x, wd, group_sizes).astype(out_dtype)


def w4a16_grouped_pallas(x, packed, scale, global_scale, group_sizes, *, out_dtype=jnp.float32,
                         interpret: bool = False, blocks: W4Blocks | None = None):
    """Pallas form of `w4a16_grouped_reference` (the w4a16 kernel over a group row-tile map)."""
    _check_w4("w4a16_grouped", x, packed, scale, global_scale, group_sizes)
    E, N, half = packed.shape
    blk = fit_blocks(blocks or grouped_blocks(N, 2 * half, nvfp4=True), 16, 2 * half, k_unit=2)
    tiles = group_tiles(group_sizes, x.shape[0], blk.block_m)
    y = _w4_call(x, packed, scale, global_scale, tiles, out_dtype=jnp.dtype(out_dtype), blocks=blk,
                 interpret=interpret, transposed=False, name="w4a16_grouped")
    return _zero_past_groups(y, group_sizes)


registry.register("w8a16_grouped", reference=w8a16_grouped_reference, pallas=w8a16_grouped_pallas)
registry.register("w4a16_grouped", reference=w4a16_grouped_reference, pallas=w4a16_grouped_pallas)
for _name in ("w8a16_grouped", "w4a16_grouped"):   # gradients to the activations only
    registry.register(_name, grad_wrt=registry.ACTIVATIONS)
