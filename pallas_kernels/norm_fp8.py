"""RMSNorm and the gated group RMSNorm with E4M3 output: the norm in front of a projection served by an
FP8-matrix-unit arm (fp8_gemm_t, w8a16_gemm_pipelined, w8a8_gemv) quantizes its own output, so the arm skips its
activation-quantization pass (one read of x and one write of E4M3 + scales; benchmarks/notes/quant_prefill.md).
`add_rmsnorm_fp8` is the decode block boundary's form (norms.add_rmsnorm): the previous block's split partials
added to the residual stream, then this RMSNorm and its quantization, in one kernel.

Results are `Fp8Activations`: exactly what the unfused path gives, i.e. the norm's output rounded to its
output dtype (bf16), then quantized per row (`per_block=False`) or per row per 128 columns (`True`) with
formats' formulas. One program holds whole rows (every group) in registers: read once, write once.

The gated norm also quantizes per row per norm group (`per_group=True`; the FP8 GEMM rescales its accumulator
at each group boundary): then a program needs only its own [rows, group] tile, so the grid runs over (groups,
row blocks) like the bf16 gated norm (norms._norm_kernel) instead of over whole rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.formats import (E4M3_MAX, FP8_BLOCK, Fp8Activations, quantize_rows_fp8,
                                              quantize_rows_fp8_blocks)
from pallas_kernels import registry
from pallas_kernels.errors import ShapeError
from pallas_kernels.norms import (add_rmsnorm_reference, check_residual, gated_rmsnorm_reference, residual_sum,
                                  rmsnorm_reference)
from pallas_kernels.split_partials import SplitPartials
from pallas_kernels.triton_util import check_floating, check_shape, compiler_params, next_pow2

@dataclasses.dataclass(frozen=True)
class NormFp8Blocks:
    """rows_elems: elements per program (rows = rows_elems // width); warps; loop: normalise group by group in
    [rows, group] tiles (no 3-D reshape of the whole row; used when the groups are few and whole 128-column
    blocks), else one [rows, width] tile reshaped to [rows, groups, group].
    group_rows_elems, group_warps, groups_first: elements per program (rows = group_rows_elems // group), warps
    and grid order of the per-group kernel (`per_group=True`): grid (groups, row blocks) as the bf16 gated norm
    (consecutive programs read consecutive groups of the same rows), else (row blocks, groups)."""
    rows_elems: int = 8192
    warps: int = 8
    loop: bool = True
    group_rows_elems: int = 4096
    group_warps: int = 4
    groups_first: bool = True


# The fastest of a sweep on the H200 at in_proj's width 4096, about the bf16 RMSNorm's time
# (benchmarks/notes/quant_prefill.md).
NORM_FP8_BLOCKS = NormFp8Blocks(rows_elems=4096, warps=4, loop=True)


def _quantize(y, group: int | None) -> Fp8Activations:
    """y quantized per row (group None) or per row per `group` columns."""
    y2 = y.reshape(-1, y.shape[-1])
    if group is None:
        return Fp8Activations(*quantize_rows_fp8(y2), jnp.dtype(y.dtype))
    return Fp8Activations(*quantize_rows_fp8_blocks(y2, group), jnp.dtype(y.dtype), group)


def rmsnorm_fp8_reference(x, weight, *, eps: float, per_block: bool, out_dtype=None) -> Fp8Activations:
    """rmsnorm_reference, rounded to out_dtype, then quantized to E4M3.  x [M, D] -> Fp8Activations."""
    return _quantize(rmsnorm_reference(x, weight, eps=eps, out_dtype=out_dtype), FP8_BLOCK if per_block else None)


def add_rmsnorm_fp8_reference(hidden, partials: SplitPartials, weight, *, eps: float, per_block: bool,
                              out_dtype=None) -> tuple[jax.Array, Fp8Activations]:
    """(h, rmsnorm_fp8(h)) with h = hidden + the partials' sum (norms.add_rmsnorm_reference's h): the residual
    stream after a block and the next block's input for an FP8-matrix-unit projection."""
    h, _ = add_rmsnorm_reference(hidden, partials, weight, eps=eps)
    return h, rmsnorm_fp8_reference(h, weight, eps=eps, per_block=per_block, out_dtype=out_dtype)


def gated_rmsnorm_fp8_reference(y, z, weight, *, group_size: int, eps: float, per_block: bool = False,
                                out_dtype=None, per_group: bool = False) -> Fp8Activations:
    """gated_rmsnorm_reference, rounded to out_dtype, then quantized to E4M3 (per row, per row per 128 columns,
    or per row per norm group).  y, z [M, I] -> Fp8Activations."""
    _check_per_group("gated_rmsnorm_fp8", group_size, per_block, per_group)
    g = gated_rmsnorm_reference(y, z, weight, group_size=group_size, eps=eps, out_dtype=out_dtype)
    return _quantize(g, group_size if per_group else FP8_BLOCK if per_block else None)


def _check_per_group(name: str, group_size: int, per_block: bool, per_group: bool) -> None:
    if per_group and per_block:
        raise ValueError(f"{name}: per_group and per_block exclude each other (one scale per row per norm group, "
                         f"or per row per {FP8_BLOCK} columns)")
    if per_group and (group_size <= 0 or group_size % FP8_BLOCK):
        raise ValueError(f"{name}: per_group needs group_size a positive multiple of {FP8_BLOCK} (the FP8 GEMM's "
                         f"K tile), got group_size {group_size}")


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supports(width: int, group_size: int, per_block: bool, per_group: bool = False) -> bool:
    """Shapes the Pallas kernel takes: width (16..16384) and group a power of two; per_block: whole 128-column
    blocks; per_group (gated norm only): a power-of-two group, a multiple of 128 up to 16384, dividing the
    width (any number of groups)."""
    if per_group:
        return (not per_block and _pow2(group_size) and group_size % FP8_BLOCK == 0 and group_size <= 16384
                and width % group_size == 0)
    return (_pow2(width) and _pow2(group_size) and width % group_size == 0 and 16 <= width <= 16384
            and (not per_block or width % FP8_BLOCK == 0))


def _scale(amax):
    return jnp.where(amax > 0, amax / E4M3_MAX, 1.0)


def _e4m3(v):
    return jnp.clip(v, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


def _normed_tile(x_ref, z_ref, w_ref, rows, cols, rm, *, GS, eps, gated, cdt):
    """One [BM, GS] norm group of x (gated by z): normalised, times the weight, rounded to the output dtype
    (the norm's output), as float32."""
    f32 = jnp.float32
    h = plgpu.load(x_ref.at[rows[:, None], cols[None, :]], mask=rm, other=0.0).astype(f32)           # [BM, GS]
    if gated:
        z = plgpu.load(z_ref.at[rows[:, None], cols[None, :]], mask=rm, other=0.0).astype(f32)
        h = h * (z * jax.nn.sigmoid(z))
    return _normed(h, w_ref, cols, GS=GS, eps=eps, cdt=cdt)


def _normed(h, w_ref, cols, *, GS, eps, cdt):
    """h [BM, GS] float32 normalised per row, times the weight, rounded to the output dtype, as float32."""
    var = jnp.sum(h * h, axis=1) / GS
    w = plgpu.load(w_ref.at[cols]).astype(jnp.float32)
    return (h * jax.lax.rsqrt(var + eps)[:, None] * w[None, :]).astype(cdt).astype(jnp.float32)


def _kernel_loop(x_ref, z_ref, w_ref, q_ref, s_ref, *, M, W, GS, BM, eps, gated, per_block, cdt):
    """Group by group: each [BM, GS] tile normalised and rounded to the output dtype, kept in registers; then
    per row (amax over every tile) or per 128-column block (within each tile) scaled and stored."""
    rows = pl.program_id(0) * BM + jnp.arange(BM)
    rm = (rows < M)[:, None]
    tiles = []
    for g in range(W // GS):
        cols = g * GS + jnp.arange(GS)
        tiles.append((cols, _normed_tile(x_ref, z_ref, w_ref, rows, cols, rm, GS=GS, eps=eps, gated=gated,
                                         cdt=cdt)))
    _store_quantized(q_ref, s_ref, rows, rm, tiles, M=M, BM=BM, GS=GS, per_block=per_block)


def _store_quantized(q_ref, s_ref, rows, rm, tiles, *, M, BM, GS, per_block):
    """The norm's output tiles [(cols, [BM, GS] float32)] scaled per row (amax over every tile) or per 128-column
    block and stored as E4M3, with their scales."""
    if per_block:
        nb = GS // FP8_BLOCK
        for g, (cols, v) in enumerate(tiles):
            vb = v.reshape(BM, nb, FP8_BLOCK)
            scale = _scale(jnp.max(jnp.abs(vb), axis=2))                                             # [BM, nb]
            plgpu.store(q_ref.at[rows[:, None], cols[None, :]], _e4m3((vb / scale[:, :, None]).reshape(BM, GS)),
                        mask=rm)
            blocks = g * nb + jnp.arange(nb)
            plgpu.store(s_ref.at[rows[:, None], blocks[None, :]], scale, mask=rm)
        return
    amax = jnp.max(jnp.abs(tiles[0][1]), axis=1)
    for _, v in tiles[1:]:
        amax = jnp.maximum(amax, jnp.max(jnp.abs(v), axis=1))
    scale = _scale(amax)                                                                             # [BM]
    for cols, v in tiles:
        plgpu.store(q_ref.at[rows[:, None], cols[None, :]], _e4m3(v / scale[:, None]), mask=rm)
    plgpu.store(s_ref.at[rows], scale, mask=rows < M)


def _add_kernel(x_ref, p_ref, w_ref, h_ref, q_ref, s_ref, *, M, W, S, BM, eps, per_block, cdt, halves):
    """BM rows: h = x + (the partials' sum in split order, rounded), stored; then `_kernel_loop`'s plain norm on h
    (one [BM, W] tile, the same launch: the same row sums) and its quantization."""
    rows = pl.program_id(0) * BM + jnp.arange(BM)
    cols = jnp.arange(W)
    rm = (rows < M)[:, None]
    h = residual_sum(x_ref, p_ref, h_ref, (rows[:, None], cols[None, :]), rm, S=S, halves=halves)
    tiles = [(cols, _normed(h, w_ref, cols, GS=W, eps=eps, cdt=cdt))]
    _store_quantized(q_ref, s_ref, rows, rm, tiles, M=M, BM=BM, GS=W, per_block=per_block)


def _kernel(x_ref, z_ref, w_ref, q_ref, s_ref, *, M, W, GS, BM, eps, gated, per_block, cdt):
    """One [BM, W] tile, reshaped to [BM, W/GS, GS] for the group norm."""
    f32 = jnp.float32
    rows = pl.program_id(0) * BM + jnp.arange(BM)
    cols = jnp.arange(W)
    m = (rows < M)[:, None] & (cols < W)[None, :]
    h = plgpu.load(x_ref.at[rows[:, None], cols[None, :]], mask=m, other=0.0).astype(f32)         # [BM, W]
    if gated:
        z = plgpu.load(z_ref.at[rows[:, None], cols[None, :]], mask=m, other=0.0).astype(f32)
        h = h * (z * jax.nn.sigmoid(z))
    hg = h.reshape(BM, W // GS, GS)
    var = jnp.sum(hg * hg, axis=2) / GS                                                          # [BM, G]
    out = (hg * jax.lax.rsqrt(var + eps)[:, :, None]).reshape(BM, W)
    v = (out * plgpu.load(w_ref.at[cols]).astype(f32)[None, :]).astype(cdt).astype(f32)          # the norm's output
    if per_block:
        vb = v.reshape(BM, W // FP8_BLOCK, FP8_BLOCK)
        amax = jnp.max(jnp.abs(vb), axis=2)                                                      # [BM, W/128]
        scale = _scale(amax)
        q = (vb / scale[:, :, None]).reshape(BM, W)
        blocks = jnp.arange(W // FP8_BLOCK)
        plgpu.store(s_ref.at[rows[:, None], blocks[None, :]], scale, mask=(rows < M)[:, None])
    else:
        amax = jnp.max(jnp.abs(v), axis=1)                                                       # [BM]
        scale = _scale(amax)
        q = v / scale[:, None]
        plgpu.store(s_ref.at[rows], scale, mask=rows < M)
    plgpu.store(q_ref.at[rows[:, None], cols[None, :]], _e4m3(q), mask=m)


def _group_kernel(y_ref, z_ref, w_ref, q_ref, s_ref, *, M, GS, BM, eps, cdt, groups_first):
    """One [BM, GS] tile (norm group g of row block i): gate, normalise, weight, round to the output dtype,
    then one scale per row: q [BM, GS] and column g of s."""
    g, i = (pl.program_id(0), pl.program_id(1)) if groups_first else (pl.program_id(1), pl.program_id(0))
    rows = i * BM + jnp.arange(BM)
    cols = g * GS + jnp.arange(GS)
    rm = (rows < M)[:, None]
    v = _normed_tile(y_ref, z_ref, w_ref, rows, cols, rm, GS=GS, eps=eps, gated=True, cdt=cdt)      # [BM, GS]
    scale = _scale(jnp.max(jnp.abs(v), axis=1))                                                      # [BM]
    plgpu.store(q_ref.at[rows[:, None], cols[None, :]], _e4m3(v / scale[:, None]), mask=rm)
    plgpu.store(s_ref.at[rows, g], scale, mask=rows < M)


def _group_rows(M: int, GS: int, nb: NormFp8Blocks) -> int:
    """Rows per program of the per-group kernel: a power of two, at most group_rows_elems // GS (>= 1) and no
    more than M needs."""
    bm = max(1, min(next_pow2(M), nb.group_rows_elems // GS))
    return 1 << (bm.bit_length() - 1)


@functools.partial(jax.jit, static_argnames=("group_size", "eps", "out_dtype", "interpret", "nb"))
def _group_call(y, z, weight, *, group_size, eps, out_dtype, interpret, nb):
    M, W = y.shape
    BM = _group_rows(M, group_size, nb)
    kernel = functools.partial(_group_kernel, M=M, GS=group_size, BM=BM, eps=eps, cdt=out_dtype,
                               groups_first=nb.groups_first)
    grid = (W // group_size, pl.cdiv(M, BM))
    q, s = pl.pallas_call(
        kernel, grid=grid if nb.groups_first else grid[::-1],
        out_shape=[jax.ShapeDtypeStruct((M, W), jnp.float8_e4m3fn),
                   jax.ShapeDtypeStruct((M, W // group_size), jnp.float32)],
        compiler_params=compiler_params(nb.group_warps), interpret=interpret, name="gated_rmsnorm_fp8_groups",
    )(y, z, weight)
    return Fp8Activations(q, s, jnp.dtype(out_dtype), group=group_size)


def _loops(W: int, GS: int, per_block: bool, nb: NormFp8Blocks) -> bool:
    return nb.loop and W // GS <= 16 and (not per_block or GS % FP8_BLOCK == 0)


@functools.partial(jax.jit, static_argnames=("group_size", "eps", "out_dtype", "gated", "per_block", "interpret",
                                             "nb"))
def _call(x, z, weight, *, group_size, eps, out_dtype, gated, per_block, interpret, nb):
    M, W = x.shape
    BM = max(1, nb.rows_elems // W)
    body = _kernel_loop if _loops(W, group_size, per_block, nb) else _kernel
    kernel = functools.partial(body, M=M, W=W, GS=group_size, BM=BM, eps=eps, gated=gated,
                               per_block=per_block, cdt=out_dtype)
    s_shape = (M, W // FP8_BLOCK) if per_block else (M,)
    q, s = pl.pallas_call(
        kernel, grid=(pl.cdiv(M, BM),),
        out_shape=[jax.ShapeDtypeStruct((M, W), jnp.float8_e4m3fn), jax.ShapeDtypeStruct(s_shape, jnp.float32)],
        compiler_params=compiler_params(nb.warps), interpret=interpret,
        name="gated_rmsnorm_fp8" if gated else "rmsnorm_fp8",
    )(x, x if z is None else z, weight)
    return Fp8Activations(q, s, jnp.dtype(out_dtype))


def _check(name: str, x, z, weight, group_size: int, per_block: bool, per_group: bool = False):
    _check_per_group(name, group_size, per_block, per_group)
    check_floating(name, "x" if z is None else "y", x)
    if x.ndim != 2:
        raise ValueError(f"{name}: {'x' if z is None else 'y'} must be [M, width], got {list(x.shape)}")
    if z is not None:
        check_shape(name, "z", z, x.shape)
    check_shape(name, "weight", weight, (x.shape[-1],))
    if per_group and not supports(x.shape[-1], group_size, per_block, per_group):
        raise ValueError(f"{name}: the per-group Pallas kernel takes a power-of-two group_size (128..16384) that "
                         f"divides the width, got width {x.shape[-1]}, group_size {group_size}; use the unfused norm")
    if not per_group and not supports(x.shape[-1], group_size, per_block):
        raise ValueError(f"{name}: the Pallas kernel takes a power-of-two width (16..16384; a multiple of 128 with "
                         f"per_block) and group size, got width {x.shape[-1]}, group {group_size}, per_block "
                         f"{per_block}; use the unfused norm")


def rmsnorm_fp8_pallas(x, weight, *, eps: float, per_block: bool, out_dtype=None, interpret: bool = False,
                       nb: NormFp8Blocks | None = None):
    """The Pallas RMSNorm with E4M3 output; same call and results as `rmsnorm_fp8_reference`."""
    _check("rmsnorm_fp8", x, None, weight, x.shape[-1], per_block)
    return _call(x, None, weight, group_size=x.shape[-1], eps=float(eps), out_dtype=jnp.dtype(out_dtype or x.dtype),
                 gated=False, per_block=per_block, interpret=interpret, nb=nb or NORM_FP8_BLOCKS)


def add_rmsnorm_fp8_pallas(hidden, partials: SplitPartials, weight, *, eps: float, per_block: bool, out_dtype=None,
                           interpret: bool = False) -> tuple[jax.Array, Fp8Activations]:
    """The residual add + RMSNorm with E4M3 output in one kernel; same call as `add_rmsnorm_fp8_reference`, and
    bitwise its unfused composition (the partials' chain sum, the residual add, then `rmsnorm_fp8_pallas` with
    the default blocks)."""
    check_residual("add_rmsnorm_fp8", hidden, partials, weight)
    _check("add_rmsnorm_fp8", hidden, None, weight, hidden.shape[-1], per_block)
    if not _loops(hidden.shape[-1], hidden.shape[-1], per_block, NORM_FP8_BLOCKS):
        raise ShapeError("add_rmsnorm_fp8: the fused kernel follows rmsnorm_fp8's one-tile launch, which the "
                         f"blocks {NORM_FP8_BLOCKS} do not take")
    return _add_call(hidden, partials.values, weight, eps=float(eps), out_dtype=jnp.dtype(out_dtype or hidden.dtype),
                     per_block=per_block, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("eps", "out_dtype", "per_block", "interpret"))
def _add_call(hidden, values, weight, *, eps, out_dtype, per_block, interpret):
    M, W = hidden.shape
    BM = max(1, NORM_FP8_BLOCKS.rows_elems // W)          # rmsnorm_fp8's launch (`_call`): the same row sums
    kernel = functools.partial(_add_kernel, M=M, W=W, S=values.shape[-3], BM=BM, eps=eps, per_block=per_block,
                               cdt=out_dtype, halves=values.dtype == jnp.uint16)
    s_shape = (M, W // FP8_BLOCK) if per_block else (M,)
    h, q, s = pl.pallas_call(
        kernel, grid=(pl.cdiv(M, BM),),
        out_shape=[jax.ShapeDtypeStruct((M, W), hidden.dtype), jax.ShapeDtypeStruct((M, W), jnp.float8_e4m3fn),
                   jax.ShapeDtypeStruct(s_shape, jnp.float32)],
        compiler_params=compiler_params(NORM_FP8_BLOCKS.warps), interpret=interpret, name="add_rmsnorm_fp8",
    )(hidden, values, weight)
    return h, Fp8Activations(q, s, jnp.dtype(out_dtype))


def gated_rmsnorm_fp8_pallas(y, z, weight, *, group_size: int, eps: float, per_block: bool = False,
                             out_dtype=None, interpret: bool = False, nb: NormFp8Blocks | None = None,
                             per_group: bool = False):
    """The Pallas gated group RMSNorm with E4M3 output; same call and results as `gated_rmsnorm_fp8_reference`.
    per_group: one program per [rows, group] tile (grid over groups and row blocks), one scale per row per group."""
    _check("gated_rmsnorm_fp8", y, z, weight, group_size, per_block, per_group)
    if per_group:
        return _group_call(y, z, weight, group_size=group_size, eps=float(eps),
                           out_dtype=jnp.dtype(out_dtype or y.dtype), interpret=interpret, nb=nb or NORM_FP8_BLOCKS)
    return _call(y, z, weight, group_size=group_size, eps=float(eps), out_dtype=jnp.dtype(out_dtype or y.dtype),
                 gated=True, per_block=per_block, interpret=interpret, nb=nb or NORM_FP8_BLOCKS)


registry.register("rmsnorm_fp8", reference=rmsnorm_fp8_reference, pallas=rmsnorm_fp8_pallas)
registry.register("add_rmsnorm_fp8", reference=add_rmsnorm_fp8_reference, pallas=add_rmsnorm_fp8_pallas)
registry.register("gated_rmsnorm_fp8", reference=gated_rmsnorm_fp8_reference, pallas=gated_rmsnorm_fp8_pallas)
