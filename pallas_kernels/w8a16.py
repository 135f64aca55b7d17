"""W8A16 projections: bf16 activations x FP8 E4M3 weights [N, K] with f32 scales per 128x128 block.

    y = x @ (w * scale[n // 128, k // 128])^T          (float32 accumulation)

Kernels (registry names):
  w8a16_gemv            decode: rows tiled by 16, each weight tile read once; split-K when N alone
                        gives too few programs to fill the GPU.
  w8a16_gemm            prefill: E4M3 tiles widened to bf16 in the kernel, bf16 matrix units.
  w8a16_gemm_pipelined  prefill on the FP8 matrix units: activations are quantized per row per
                        128 columns to E4M3 first (pallas_kernels.fp8_gemm), so the result is that of
                        the quantized activations (its reference does the same quantization).
  w8a8_gemv             decode on the FP8 matrix units, the same quantization of the activations (the Mosaic
                        arm: pallas_kernels/mgpu_gemv_w8.py; the Triton arm is w8a16_gemm_pipelined's).
Tile configs depend on (N, K) only, never on M, so a row's result does not depend on the batch.
Shared tile helpers of the quantized kernels live here too.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import epilogues
from pallas_kernels.errors import ShapeError
from pallas_kernels.formats import FP8_BLOCK, block_grid, expand_block_scale, fp8_dequantized
from pallas_kernels import registry
from pallas_kernels.split_partials import SplitPartials, chain_sum, check_unreduced, of_output
from pallas_kernels.triton_util import compiler_params, dot, dot_dtype, next_pow2

H200_SMS = 132


# ---- shared helpers --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class QuantBlocks:
    """Tile config of a quantized projection kernel (powers of two; block_k counts weight elements)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = False      # compute out^T = W x^T: the weight tile is the matrix units' A operand


def matmul_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w[N, K]^T in float32 (IEEE, no TF32); a single row is computed as the first of two,
    so XLA:CPU's GEMV path (another summation order) never makes a row depend on the batch size."""
    M = x.shape[0]
    xp = jnp.concatenate([x, x], axis=0) if M == 1 else x
    y = jax.lax.dot_general(xp.astype(jnp.float32), w.astype(jnp.float32), (((1,), (1,)), ((), ())),
                            precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y[:M]


def check_activations(kernel: str, x, K: int) -> None:
    if getattr(x, "ndim", 0) != 2 or x.shape[1] != K:
        raise ShapeError(f"{kernel}: x expected shape [M, {K}], got {list(getattr(x, 'shape', ()))}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ShapeError(f"{kernel}: x expected a floating dtype, got {x.dtype}")


def check_array(kernel: str, name: str, a, dtype, shape) -> None:
    if tuple(a.shape) != tuple(shape) or jnp.dtype(a.dtype) != jnp.dtype(dtype):
        raise ShapeError(f"{kernel}: {name} expected {jnp.dtype(dtype).name}{list(shape)}, "
                         f"got {jnp.dtype(a.dtype).name}{list(a.shape)}")


def gemv_split_k(n_programs: int, k_steps: int, target: int = 2 * H200_SMS) -> int:
    """Largest power-of-two split of the K loop that keeps >= 4 steps per split and does not
    overshoot `target` programs (two per SM keeps a load in flight while the other computes)."""
    split = 1
    while n_programs * split * 2 <= target and k_steps % (split * 2) == 0 and k_steps // (split * 2) >= 4:
        split *= 2
    return split


def fit_blocks(blk: QuantBlocks, M: int, K: int, k_unit: int = 1) -> QuantBlocks:
    """Shrink block_m to the rows present (>= 16, the smallest matrix-unit tile) and block_k to K."""
    bm = min(blk.block_m, next_pow2(M, 16))
    bk = min(blk.block_k, next_pow2(K, 16 * k_unit))
    return dataclasses.replace(blk, block_m=bm, block_k=bk)


def row_tile(tiles_ref, pid_m, bm: int, M: int):
    """(first row, row mask, weight index prefix) of m-tile pid_m. Plain: consecutive tiles of bm rows.
    Grouped (tiles_ref [3, tiles] int32: expert, first row, rows): the tile lies inside one expert's rows,
    so its weights are w[expert]; an empty tile (0 rows) masks everything."""
    if tiles_ref is None:
        m0 = pid_m * bm
        return m0, (m0 + jnp.arange(bm)) < M, ()
    e, m0, rows = tiles_ref[0, pid_m], tiles_ref[1, pid_m], tiles_ref[2, pid_m]
    return m0, jnp.arange(bm) < rows, (e,)


def grid_ids(num_m: int):
    """(n-block, m-block) of this program: m varies fastest so programs in flight share weight tiles."""
    pid = pl.program_id(0)
    return pid // num_m, pid % num_m


def finish_split(out: jax.Array, M: int, out_dtype) -> jax.Array:
    """Sum the split-K partials [split, Mp, N] as a chain of elementwise adds (one order whatever the shape:
    a reduce may be emitted with an M-dependent order) and cut the padding rows."""
    return chain_sum(SplitPartials(out), M).astype(out_dtype)


# ---- reference -----------------------------------------------------------------------------------------
def w8a16_reference(x: jax.Array, w: jax.Array, scale: jax.Array, *, out_dtype=None,
                    epilogue: str | None = None, unreduced: bool = False):
    """Dequantize then matmul, then the epilogue (`epilogues`) on the float32 result.  x [M, K], w E4M3 [N, K],
    scale f32 [ceil(N/128), ceil(K/128)] -> [M, N]; unreduced: the float32 result as one SplitPartials."""
    epilogues.check("w8a16", epilogue)
    check_unreduced("w8a16", unreduced, epilogue, out_dtype)
    N, K = w.shape
    wd = w.astype(jnp.float32) * expand_block_scale(scale, N, K)
    if unreduced:
        return of_output(matmul_f32(x, wd))
    return epilogues.apply(matmul_f32(x, wd), epilogue).astype(out_dtype or x.dtype)


def _check_w8a16(kernel, x, w, scale):
    if w.ndim != 2 or jnp.dtype(w.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise ShapeError(f"{kernel}: w expected float8_e4m3fn [N, K], got {jnp.dtype(w.dtype).name}{list(w.shape)}")
    N, K = w.shape
    check_activations(kernel, x, K)
    check_array(kernel, "scale", scale, jnp.float32, block_grid(N, K))


# ---- Pallas kernel -------------------------------------------------------------------------------------
def _w8a16_kernel(*refs, M, N, K, bm, bn, bk, k_split, num_m, cdt, swap, grouped):
    """One [bm, bn] output tile over one K split: widen E4M3 -> bf16 (exact), matrix units, scale per block.
    grouped: a tiles_ref comes first and w / scale carry a leading expert axis (see `row_tile`)."""
    tiles_ref, (x_ref, w_ref, s_ref, o_ref) = (refs[0], refs[1:]) if grouped else (None, refs)
    pid_n, pid_m = grid_ids(num_m)
    split = pl.program_id(1)
    n0 = pid_n * bn
    m0, m_mask, ex = row_tile(tiles_ref, pid_m, bm, M)
    n_mask = (n0 + jnp.arange(bn)) < N
    s_row = n0 // FP8_BLOCK                       # bn divides 128: the tile sits in one block row
    k_first = split * k_split
    ragged_k = K % bk != 0

    def body(i, acc):
        k0 = k_first + i * bk
        if ragged_k:
            k_mask = (k0 + jnp.arange(bk)) < K
            xm, wm = m_mask[:, None] & k_mask[None, :], n_mask[:, None] & k_mask[None, :]
        else:
            xm, wm = m_mask[:, None], n_mask[:, None]
        x = plgpu.load(x_ref.at[pl.ds(m0, bm), pl.ds(k0, bk)], mask=xm, other=0.0).astype(cdt)
        w = plgpu.load(w_ref.at[(*ex, pl.ds(n0, bn), pl.ds(k0, bk))], mask=wm, other=0.0).astype(cdt)
        part = dot(w, x, trans_b=True) if swap else dot(x, w, trans_b=True)     # [bn, bm] / [bm, bn] f32
        return acc + part * s_ref[(*ex, s_row, k0 // FP8_BLOCK)]

    acc = jax.lax.fori_loop(0, k_split // bk, body, jnp.zeros((bn, bm) if swap else (bm, bn), jnp.float32))
    store_tile(o_ref, split, acc, m0, n0, m_mask, n_mask, swap)


def store_tile(o_ref, split, acc, m0, n0, m_mask, n_mask, swap):
    """Write a [bm, bn] tile (or its transpose [bn, bm] when swap) of o_ref[split]."""
    bm, bn = m_mask.shape[0], n_mask.shape[0]
    split = jnp.asarray(split, jnp.int32)
    if swap:
        rows, cols = m0 + jnp.arange(bm), n0 + jnp.arange(bn)
        plgpu.store(o_ref.at[split, rows[None, :], cols[:, None]], acc.astype(o_ref.dtype),
                    mask=n_mask[:, None] & m_mask[None, :])
    else:
        plgpu.store(o_ref.at[split, pl.ds(m0, bm), pl.ds(n0, bn)], acc.astype(o_ref.dtype),
                    mask=m_mask[:, None] & n_mask[None, :])


@functools.partial(jax.jit, static_argnames=("out_dtype", "blocks", "interpret", "name", "unreduced"))
def _w8a16_call(x, w, scale, tiles=None, *, out_dtype, blocks: QuantBlocks, interpret: bool, name: str,
                unreduced: bool = False):
    """tiles: None, or the grouped form's row tiles [3, tiles] (w [E, N, K], scale [E, ...]). unreduced (with a
    float32 out_dtype): the split partials [split, M, N] as SplitPartials."""
    M, K = x.shape
    N = w.shape[-2]
    bm, bn, bk, split = blocks.block_m, blocks.block_n, blocks.block_k, blocks.split_k
    if FP8_BLOCK % bn or FP8_BLOCK % bk:
        raise ShapeError(f"{name}: block_n={bn} and block_k={bk} must divide the 128-wide scale blocks")
    num_m, num_n = pl.cdiv(M, bm) if tiles is None else tiles.shape[1], pl.cdiv(N, bn)
    if pl.cdiv(K, bk) % split:
        raise ShapeError(f"{name}: split_k={split} does not divide the {pl.cdiv(K, bk)} K steps of {bk}")
    k_split = pl.cdiv(K, bk) // split * bk
    out_t = jnp.float32 if split > 1 else out_dtype
    kernel = functools.partial(_w8a16_kernel, M=M, N=N, K=K, bm=bm, bn=bn, bk=bk, k_split=k_split, num_m=num_m,
                               cdt=dot_dtype(x.dtype), swap=blocks.swap, grouped=tiles is not None)
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((split, M, N), out_t), grid=(num_m * num_n, split),
        compiler_params=compiler_params(blocks.num_warps, blocks.num_stages), interpret=interpret, name=name,
    )(*(() if tiles is None else (tiles,)), x, w, scale)
    return SplitPartials(out) if unreduced else finish_split(out, M, out_dtype)


# Defaults from the H200 sweep (benchmarks/notes/quant.md): the weight tile as the B operand
# (swap=False) and 32-row tiles unless N is too small to fill the GPU without splitting K.
GEMV_SWAP = False


def gemv_block_n(N: int) -> int:
    return 32 if pl.cdiv(N, 32) >= 2 * H200_SMS else 64


def w8a16_gemv_blocks(N: int, K: int) -> QuantBlocks:
    bn, bk = gemv_block_n(N), 128
    split = gemv_split_k(pl.cdiv(N, bn), pl.cdiv(K, bk))
    return QuantBlocks(block_m=16, block_n=bn, block_k=bk, split_k=split, num_warps=4, num_stages=4, swap=GEMV_SWAP)


def w8a16_gemm_blocks(N: int, K: int) -> QuantBlocks:
    return QuantBlocks(block_m=64, block_n=128, block_k=64, split_k=1, num_warps=4, num_stages=4)


def w8a16_gemv_pallas(x, w, scale, *, out_dtype=None, epilogue: str | None = None, interpret: bool = False,
                      blocks: QuantBlocks | None = None, unreduced: bool = False):
    """Decode GEMV (any M, rows tiled by 16); same call and result as `w8a16_reference` (the epilogue by XLA on
    the float32 output; unreduced: the split partials)."""
    _check_w8a16("w8a16_gemv", x, w, scale)
    epilogues.check("w8a16_gemv", epilogue)
    check_unreduced("w8a16_gemv", unreduced, epilogue, out_dtype)
    blk = fit_blocks(blocks or w8a16_gemv_blocks(*w.shape), x.shape[0], w.shape[1])
    out_dtype = jnp.dtype(jnp.float32 if unreduced else out_dtype or x.dtype)
    y = _w8a16_call(x, w, scale, out_dtype=jnp.float32 if epilogue else out_dtype, blocks=blk,
                    interpret=interpret, name="w8a16_gemv", unreduced=unreduced)
    return y if unreduced else epilogues.apply(y, epilogue).astype(out_dtype)


def w8a16_gemm_pallas(x, w, scale, *, out_dtype=None, interpret: bool = False, blocks: QuantBlocks | None = None):
    """Prefill GEMM on the bf16 matrix units; same call and result as `w8a16_reference`."""
    _check_w8a16("w8a16_gemm", x, w, scale)
    blk = fit_blocks(blocks or w8a16_gemm_blocks(*w.shape), x.shape[0], w.shape[1])
    return _w8a16_call(x, w, scale, out_dtype=jnp.dtype(out_dtype or x.dtype), blocks=blk,
                       interpret=interpret, name="w8a16_gemm")


# ---- FP8 matrix-unit GEMM (activations quantized per row per 128 columns) ------------------------------
def w8a16_pipelined_reference(x, w, scale, *, out_dtype=None):
    """Quantize x per row per 128 columns to E4M3, dequantize both operands, matmul in float32."""
    _check_w8a16("w8a16_gemm_pipelined", x, w, scale)
    return w8a16_reference(fp8_dequantized(x, FP8_BLOCK), w, scale, out_dtype=out_dtype or x.dtype)


def w8a16_gemm_pipelined_pallas(x, w, scale, *, out_dtype=None, interpret: bool = False,
                                blocks: QuantBlocks | None = None):
    from pallas_kernels.fp8_gemm import fp8_block_gemm
    _check_w8a16("w8a16_gemm_pipelined", x, w, scale)
    return fp8_block_gemm(x, w, scale, out_dtype=out_dtype, interpret=interpret, blocks=blocks)


def w8a8_gemv_reference(x, w, scale, *, out_dtype=None, epilogue: str | None = None, unreduced: bool = False):
    """Decode on the FP8 matrix units: x quantized per row per 128 columns to E4M3 (or Fp8Activations as their
    producer quantized them), both operands dequantized, matmul in float32, then the epilogue."""
    _check_w8a16("w8a8_gemv", x, w, scale)
    return w8a16_reference(fp8_dequantized(x, FP8_BLOCK), w, scale, out_dtype=out_dtype or (
        jnp.float32 if unreduced else x.dtype), epilogue=epilogue, unreduced=unreduced)


def w8a8_gemv_pallas(x, w, scale, *, out_dtype=None, epilogue: str | None = None, interpret: bool = False,
                     unreduced: bool = False):
    """Triton arm of w8a8_gemv: w8a16_gemm_pipelined's block-scaled FP8 GEMM, the epilogue on its float32 output
    (unreduced: that output as one SplitPartials)."""
    epilogues.check("w8a8_gemv", epilogue)
    check_unreduced("w8a8_gemv", unreduced, epilogue, out_dtype)
    y = w8a16_gemm_pipelined_pallas(x, w, scale, out_dtype=jnp.float32, interpret=interpret)
    return of_output(y) if unreduced else epilogues.apply(y, epilogue).astype(out_dtype or x.dtype)


registry.register("w8a16_gemv", reference=w8a16_reference, pallas=w8a16_gemv_pallas)
registry.register("w8a16_gemm", reference=w8a16_reference, pallas=w8a16_gemm_pallas)
registry.register("w8a16_gemm_pipelined", reference=w8a16_pipelined_reference, pallas=w8a16_gemm_pipelined_pallas)
registry.register("w8a8_gemv", reference=w8a8_gemv_reference, pallas=w8a8_gemv_pallas)
for _name in ("w8a16_gemv", "w8a16_gemm", "w8a16_gemm_pipelined", "w8a8_gemv"):   # gradients to the activations only
    registry.register(_name, grad_wrt=registry.ACTIVATIONS)
