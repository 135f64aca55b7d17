"""Decode GEMVs on Hopper through Pallas Mosaic GPU: the Mosaic arms of `w8a16_gemv` and `w4a16_gemv`.

Both compute out^T = W x^T with the weight tile as the wgmma A operand, widened to bf16 in registers (no
shared-memory round trip), and x^T (16 rows per tile, 8 when M <= 8; zero-filled past M by TMA) as the B operand
in shared memory. Weight tiles stream through a multi-stage TMA pipeline (`emit_pipeline`). At larger M a CTA takes
several 16-row x tiles (`m_tiles`) and issues one m64 x n(16 m_tiles) wgmma per widened weight tile.

  w8a16: E4M3 tile [64, 128] -> bf16 (exact, jnp conversions); one block scale per 128-wide K block, applied in
         float32 to that block's product, so the result equals dequantize-then-matmul up to f32 summation order.
  w4a16: packed E2M1 [64, 128 bytes] per 256-wide K step, loaded in WGMMA_UPCAST_4X layout (8 consecutive bytes
         per thread) and decoded with integer PTX straight into the registers of the same thread's WGMMA A
         fragment, which amounts to a fixed permutation of K (`perm64`); x's columns get the same permutation
         (done by XLA), so the dot product is unchanged. Each 8-byte vector is one scale group, so the E4M3 scales
         are applied during the decode; the global scale multiplies the result.

Launches (`GemvConfig`, defaults from `w8a16_gemv_blocks` / `w4a16_gemv_blocks`): K is split across CTAs until the
SMs are covered (float32 partials added by XLA in a fixed order, `_finish`). Where the row blocks alone fill two
CTAs per SM (in_proj) w8 runs unsplit with two K blocks per pipeline step and splits only the row blocks past a
whole number per SM into K pieces (`tail_split`), so every SM streams about the same bytes; those pieces (and w4's
split halves at in_proj) are added in the kernel by 2-CTA clusters (`_cluster_sum`: CTA 0 adds the other's
float32 partial from its shared memory in the order XLA's sum uses, so both give the same bits).

Weight tiles never depend on M (split-K chosen from (N, K) only, split partials added in a fixed order), and a
wgmma gives each output column the same bits whatever its N (tested on the GPU), so a row's result is
bit-identical whatever the batch. Interpret mode (CPU tests) passes the A operand through shared memory, since the
GPU interpreter's wgmma reads A from shared memory only, decodes with jnp (in the same K order) and adds split
partials in XLA; everything else is shared with the compiled kernel.
Shapes: bf16 x, N % 64 == 0, K % 128 (w8) / K % 512 (w4) == 0 (`supports`); else ShapeError.
Measurements and what was tried: benchmarks/notes/gemv.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.errors import ShapeError
from pallas_kernels.formats import FP8_BLOCK
from pallas_kernels import registry
from pallas_kernels.w4a16 import check_nvfp4_args, w4a16_reference
from pallas_kernels.w8a16 import H200_SMS, _check_w8a16, w8a16_reference

BM = 16            # x rows per tile (the wgmma N dimension); never chosen from M beyond `x_rows`, so rows stay
                   # batch-invariant
X_ROWS_SMALL = 8   # x rows per CTA when M <= 8: an n8 wgmma, half the x bytes of a 16-row tile
ROWS = 64          # wgmma M: weight rows per warpgroup instruction
W8_BK = 128        # K per step of w8a16 (one block scale)
W4_K = 512         # K multiple the w4a16 arm takes (`supports`)
W4_BK = 256        # K per step of w4a16 (128 packed bytes, 16 scale groups)


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """A launch of either GEMV. block_n: weight rows per CTA (64 or 128); stages: pipeline depth; split_k: K splits
    (0 = auto)."""

    block_n: int = 64
    stages: int = 6
    split_k: int = 0
    m_tiles: int = 0          # 16-row x tiles per CTA, one m64 x n(16 m_tiles) wgmma against the widened weight
                              # tile (0: auto, see launch_tiles; 1 = one CTA per 16 rows)
    small_m: bool = True      # at M <= 8: one 8-row x tile (an n8 wgmma) instead of 16 rows; rows bit-identical
    k_blocks: int = 1         # K blocks (w8 128, w4 256 wide) per pipeline step, all their wgmmas issued before one
                              # wait: block j + 1 is widened while block j's wgmma runs (w8 up to 4, w4 2); rows
                              # keep their bits (see resolve_k_blocks)
    reduce: str = "xla"       # split partials added by XLA, or in the kernel through the shared memory of a
                              # cluster of the split CTAs ("cluster": w4 split_k, w8 tail_split pieces; compiled
                              # only, interpret mode adds them in XLA), the same bits
    tail_split: int = 0       # w8 unsplit: the row blocks past a whole number per SM (in_proj: 26 of 290) are
                              # split into this many K pieces, so every SM streams about the same bytes; the
                              # pieces' float32 partials are added in a fixed order (`tail_blocks`)


def _tf(cols_bytes: int, itemsize: int):
    """Tiling + swizzle transforms for a tile whose rows are `cols_bytes` wide (32, 64 or 128 bytes)."""
    sw = min(cols_bytes, 128)
    return plgpu.TilingTransform((8, sw // itemsize)), plgpu.SwizzleTransform(sw)


def auto_split(n_blocks: int, k_steps: int, target: int = 2 * H200_SMS) -> int:
    """Largest power-of-two K split that keeps >= 4 steps per split and <= `target` CTAs."""
    split = 1
    while n_blocks * split * 2 <= target and k_steps % (split * 2) == 0 and k_steps // (split * 2) >= 4:
        split *= 2
    return split


# NVFP4 decode (w4a16): one packed byte (lo nibble = even k, hi = odd k, one scale group) -> one bf16 pair.
# A nibble s|eem becomes the 16-bit lane s << 15 | eem << 6, the bf16 of its E2M1 value * 2^-126 (0.5 -> the
# subnormal 2^-127): the two nibbles of a byte are moved to the low bits of the two lanes (and + shr + prmt, the
# prmt's zero bytes taken as sign replicas of bytes below 0x10), spread by one multiply by 0x1040 (= << 6 | << 12,
# no overlapping bits) and masked. One bf16x2 multiply by the pair's scale * 2^118 (from `_E4M3_TO_BF16X2_SCALE`)
# gives value * scale * 2^-8, exact (2-bit times 4-bit significands, >= 2^-18); the result is scaled by 2^8 at
# the end.
def e2m1x4_to_bf16_asm(scales: tuple[str, ...]) -> str:
    """PTX: packed word $4 (4 bytes) -> bf16 pairs $0..$3 (low nibble first), byte k times the scale pair scales[k]."""
    return """{
.reg .b32 l, h, y, z;
mov.b32 z, 0x80008000;
and.b32 l, $4, 0x0F0F0F0F;
shr.b32 h, $4, 4;
and.b32 h, h, 0x0F0F0F0F;
""" + "".join(f"""prmt.b32 y, l, h, 0x8{4 + k}8{k}; mul.lo.u32 y, y, 0x1040; and.b32 y, y, 0x81C081C0;
fma.rn.bf16x2 ${k}, y, {scales[k]}, z;
""" for k in range(4)) + "}"


_E2M1X8_TO_BF16 = e2m1x4_to_bf16_asm(("$5",) * 4)        # one scale pair for all four bytes (one group)
# An E4M3 scale byte -> (scale, scale) * 2^118 as a bf16 pair, exact: prmt puts the byte in the low half of both
# 16-bit lanes with its sign replicated above; << 4 and a mask leave sign | (b & 0x7f) << 4, the bf16 of value *
# 2^-120 (E4M3 subnormals map to bf16 subnormals), then two multiplies by 2^119.
_E4M3_TO_BF16X2_SCALE = """{
.reg .b32 a, k, z, n;
mov.b32 k, 0x7B007B00;
mov.b32 z, 0x80008000;
mov.b32 n, 0;
prmt.b32 a, $1, n, 0x8080;
shl.b32 a, a, 4;
and.b32 a, a, 0x87F087F0;
fma.rn.bf16x2 a, a, k, z;
fma.rn.bf16x2 $0, a, k, z;
}"""
# The NVFP4 decoders (this GEMV and mgpu_gemm_nvfp4) form e2m1 * 2^-126 times a scale pair * 2^118: their A
# operand is weight * 2^-8, undone with the global scale on the accumulator.
E2M1_A_SHIFT = 2.0 ** 8

# Scales of one 256-wide K step ([64 rows, 16 groups]): thread q of a row holds groups q, 4 + q, 8 + q, 12 + q, the
# groups of the packed bytes it loads in WGMMA_UPCAST_4X layout (byte columns 32c + 8q .. + 8 = group 4c + q).
W4_SCALE_LAYOUT = plgpu.Layout.TILED(
    mgpu_fa.Tiling(((64, 16), (16, 16), (8, 16), (8, 4), (1,))), warp_dims=(-9,), lane_dims=(-3, -2), vector_dim=-1)


def perm64(a):
    """The K permutation of the NVFP4 decoder, on the last axis (a multiple of 64): within each 64-block,
    logical index 8i + 2q + u holds physical index 16q + 2i + u (q < 4, i < 8, u < 2)."""
    *lead, k = a.shape
    return a.reshape(*lead, k // 64, 4, 8, 2).swapaxes(-3, -2).reshape(*lead, k)


def _ptx_e2m1_perm_to_bf16(p, s):
    """Packed bytes [64, 128] (WGMMA_UPCAST_4X) and E4M3 scales [64, 16] (W4_SCALE_LAYOUT) -> bf16 [64, 256]
    = dequantized weight * 2^-8 in WGMMA layout, columns in `perm64` order: byte i of the vector at byte columns
    32c + 8q becomes the pair at columns 8(8c + i) + 2q (same thread and row; no data moves between threads)."""
    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X, W4_SCALE_LAYOUT),
                       return_type=plgpu.ShapeDtypeStruct((ROWS, 256), jnp.bfloat16, plgpu.Layout.WGMMA))
    def decode(ctx, fp, fs):
        from jax.experimental.mosaic import gpu as mgpu
        from jax.experimental.mosaic.gpu import utils as mu
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import arith, llvm, vector
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        bf2 = ir.VectorType.get((2,), ir.BF16Type.get())
        quad = ir.Type.parse("!llvm.struct<(i32, i32, i32, i32)>")
        src, scl = fp.registers, fs.registers              # [1, 4, 1, 1, 2, 1...] vector<8xi8>; [.., 2, .., 4, ..]
        shape = list(src.shape)
        shape[1] *= 8
        regs = np.empty(shape, dtype=object)
        for idx, r in np.ndenumerate(src):
            c, h = idx[1], idx[4]
            sb = arith.extui(i32, mu.bitcast(scl[0, 0, 0, 0, h, 0, 0, c, 0, 0, 0], i8))
            sc = llvm.inline_asm(i32, [sb], _E4M3_TO_BF16X2_SCALE, "=r,r")
            words = mu.bitcast(r, ir.VectorType.get((2,), i32))
            for wi in range(2):
                word = vector.extract(words, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([wi]))
                out = llvm.inline_asm(quad, [word, sc], _E2M1X8_TO_BF16, "=r,=r,=r,=r,r,r")
                for k in range(4):
                    dst = list(idx)
                    dst[1] = 8 * c + 4 * wi + k
                    regs[tuple(dst)] = mu.bitcast(llvm.extractvalue(i32, out, [k]), bf2)
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)
    return decode(p, s)


def _jnp_e2m1_perm(p_ref, s_ref):
    """Interpret-mode twin of `_ptx_e2m1_perm_to_bf16` (same values, same column order), in jnp."""
    p = p_ref[...].astype(jnp.uint16)                                   # [64, 128]
    sc = s_ref[...].astype(jnp.float32) * (16384.0 / E2M1_A_SHIFT)     # [64, 16]; _nibble_f32 is value * 2^-14
    lo, hi = _nibble_f32(p, False), _nibble_f32(p, True)
    w = jnp.stack([lo, hi], axis=-1).reshape(ROWS, 16, 16) * sc[:, :, None]
    return perm64(w.reshape(ROWS, 256)).astype(jnp.bfloat16)


def _mma(acc_ref, a, b_ref, a_smem):
    """acc_ref += a @ b_ref with a from registers, or through `a_smem` in interpret mode."""
    if a_smem is not None:
        a_smem[...] = a
        plgpu.commit_smem()
        a = a_smem
    plgpu.wgmma(acc_ref, a, b_ref)


def _mma_values(a_fns, b_refs, a_smem, n: int):
    """Fresh [64, n] float32 products a_fns[j]() @ b_refs[j], each wgmma issued before the next A operand is built
    (a_fns are called in order), all awaited at the end."""
    def run(*acc_refs):
        for a_fn, b_ref, acc_ref in zip(a_fns, b_refs, acc_refs):
            _mma(acc_ref, a_fn(), b_ref, a_smem)
        return [acc_ref[...] for acc_ref in acc_refs]
    return pl.run_scoped(run, *[plgpu.ACC((ROWS, n), jnp.float32) for _ in a_fns])


def _store_out(accs, o_smem, o_gmem, split, m_blk, n_blk, bn, direct, xr: int = BM):
    """accs: per 64-row group, a [64, xr] tile of out^T (xr: x rows per CTA, see `x_rows`).
    direct: into o_gmem [M, N] through transposed SMEM views (TMA clips rows past M and columns past N;
    16-bit outputs only). Else as float32 out^T partials into o_gmem [split, N, Mp] (summed and transposed by
    the caller)."""
    for g, acc in enumerate(accs):
        rows, cols = pl.ds(g * ROWS, ROWS), pl.ds(0, xr)
        dst = o_smem.at[cols, rows].transpose((1, 0)) if direct else o_smem.at[rows, cols]
        dst[...] = acc.astype(o_smem.dtype)
    plgpu.commit_smem()
    mrows = pl.ds(m_blk * xr, xr)
    if direct:
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[mrows, pl.ds(n_blk * bn, bn)])
    else:
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[split, pl.ds(n_blk * bn, bn), mrows])
    plgpu.wait_smem_to_gmem(0)


def _direct(split: int, out_dtype) -> bool:
    """Whether the output goes straight to [M, N] (no split-K, 16-bit) rather than as float32 partials."""
    return split == 1 and jnp.dtype(out_dtype).itemsize == 2


def _out_spec(M: int, N: int, bn: int, split: int, out_dtype, xr: int = BM):
    """(direct?, out type, SMEM staging tile) for a call with M (padded) rows and xr x rows per CTA; see
    `_store_out`."""
    direct = _direct(split, out_dtype)
    if direct:
        return True, jax.ShapeDtypeStruct((M, N), out_dtype), plgpu.SMEM((xr, bn), out_dtype)
    return False, jax.ShapeDtypeStruct((split, N, pl.cdiv(M, xr) * xr), jnp.float32), plgpu.SMEM((bn, xr), jnp.float32)


def _pad_rows(x):
    """TMA tiles x rows by 8: an M above 8 that is not a multiple of 8 gets zero rows appended."""
    M = x.shape[0]
    return x if M <= 8 or M % 8 == 0 else jnp.pad(x, ((0, -M % 8), (0, 0)))


def supports(kernel: str, N: int, K: int, x_dtype) -> bool:
    """Whether the Mosaic arm of `kernel` ("w8a16_gemv" / "w4a16_gemv") takes these shapes (else ShapeError)."""
    k_multiple = {"w8a16_gemv": W8_BK, "w4a16_gemv": W4_K}[kernel]
    return N % ROWS == 0 and K % k_multiple == 0 and jnp.dtype(x_dtype) == jnp.dtype(jnp.bfloat16)


def _check_dims(name: str, N: int, K: int, k_multiple: int):
    if N % ROWS or K % k_multiple:
        raise ShapeError(f"{name}(mosaic): needs N % 64 == 0 and K % {k_multiple} == 0 (TMA tiles), got N={N}, K={K}; "
                         "use the Triton arm for other shapes")


def _finish(out, direct: bool, M: int, out_dtype):
    """Direct: cut padded rows. Else sum the split-K partials as a chain of elementwise adds (a fixed order
    whatever the shape: a reduce could be emitted with an M-dependent order) and transpose."""
    if direct:
        return out[:M]
    out = out[:, :, :M]
    y = out[0]
    for i in range(1, out.shape[0]):
        y = y + out[i]
    return y.T.astype(out_dtype)


# ---- W8A16 ---------------------------------------------------------------------------------------------------
def _widen8(w_ref):
    """E4M3 [64, 128] SMEM tile (read as 2-byte vectors) -> bf16 A operand in WGMMA layout."""
    w = plgpu.load(w_ref, layout=plgpu.Layout.WGMMA)
    return w.astype(jnp.float32).astype(jnp.bfloat16)      # exact; ptxas 13.0 has no direct e4m3->bf16 cvt


def _w8_kernel(x_gmem, w_gmem, s_gmem, o_gmem, *t_gmem, o_smem, a_smem, ready=None, red_bar=None, bn, steps, stages,
               direct, xr, kb, dp=0, tail=0, cluster=0):
    """One wgmma per 128-wide K block over all m_tiles 16-row x tiles of the CTA (the weight tile is read and
    widened once) into a fresh accumulator, waited for before the block scale is applied; a pipeline step holds
    kb blocks, whose wgmmas are all issued before the wait. A wgmma computes each output column the same way
    whatever its N (rows bit-identical at M = 1, 16, 40 and 256 on the GPU), so a row's result does not depend
    on M. tail > 0: CTAs n < dp take row block n whole; the others piece (n - dp) % tail of the K range of row
    block dp + (n - dp) // tail, as float32 partials into t_gmem [tail, tail rows, Mp]. cluster > 0: the tail
    pieces of one output tile form a cluster and add their partials in the kernel (`_w8_tail_cluster`)."""
    n, m_blk, split = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("s")
    run = functools.partial(_w8_blocks, x_gmem, w_gmem, s_gmem, a_smem, bn=bn, stages=stages, xr=xr, kb=kb)
    store = lambda acc, n_blk: _store_out(acc, o_smem, o_gmem, 0, m_blk, n_blk, bn, direct, xr)
    if not tail:
        _store_out(run(n, m_blk, split * steps, steps=steps), o_smem, o_gmem, split, m_blk, n, bn, direct, xr)
        return
    if cluster:
        return _w8_tail_cluster(run, store, ready, red_bar, m_blk, bn=bn, steps=steps, xr=xr, dp=dp, tail=tail)
    (t_gmem,) = t_gmem

    @pl.when(n < dp)
    def _():
        store(run(n, m_blk, 0, steps=steps), n)

    @pl.when(n >= dp)
    def _():
        t, piece = (n - dp) // tail, (n - dp) % tail
        acc = run(dp + t, m_blk, piece * (steps // tail), steps=steps // tail)
        pl.run_scoped(lambda t_smem: _store_out(acc, t_smem, t_gmem, piece, m_blk, t, bn, False, xr),
                      plgpu.SMEM((bn, xr), jnp.float32))         # in the space the pipeline used


def _w8_tail_cluster(run, store, ready, red_bar, m_blk, *, bn, steps, xr, dp, tail):
    """The tail split reduced in the kernel: clusters of `tail` CTAs; a cluster below dp / tail takes `tail`
    whole row blocks, one per CTA; the others one tail row block, CTA c its K piece c (`_cluster_sum`)."""
    g, c = lax.axis_index("n"), lax.axis_index("c")
    whole = dp // tail

    @pl.when(g < whole)
    def _():
        n = g * tail + c
        store(run(n, m_blk, 0, steps=steps), n)

    @pl.when(g >= whole)
    def _():
        n = dp + g - whole
        acc = run(n, m_blk, c * (steps // tail), steps=steps // tail)
        _cluster_sum(acc, c, tail, ready, red_bar, bn, xr, lambda total: store(total, n))


def _cluster_sum(acc, c, size, ready, red_bar, bn: int, xr: int, store):
    """The `size` CTAs of a cluster (axis "c") hold float32 partials `acc` (per 64-row group, [64, xr]) of one
    output tile. Once every CTA is past its pipeline (`ready`), CTAs c > 0 store theirs into CTA 0's shared memory
    (a [size - 1, bn, xr] buffer in the space the pipelines used, arriving on red_bar), and CTA 0 adds them in
    order of c and stores the total: the order `_finish` adds split partials in, so the same bits as XLA's sum."""
    def reduce(recv):
        plgpu.barrier_arrive(ready)
        plgpu.barrier_wait(ready)

        @pl.when(c > 0)
        def _():
            for grp, a in enumerate(acc):
                plgpu.async_store_smem(a, recv.at[c - 1, pl.ds(grp * ROWS, ROWS)], red_bar, cluster_idx=0,
                                       cluster_dim="c")

        @pl.when(c == 0)
        def _():
            plgpu.barrier_wait(red_bar)
            total = list(acc)
            for j in range(size - 1):
                total = [t + recv[j, pl.ds(grp * ROWS, ROWS)] for grp, t in enumerate(total)]
            store(total)

    sw = next(b for b in (128, 64, 32) if 4 * xr % b == 0)            # the widest swizzle that tiles an xr row
    pl.run_scoped(reduce, plgpu.SMEM((size - 1, bn, xr), jnp.float32, transforms=_tf(sw, 4)))


def _cluster_launch(name: str, size: int, bn: int, xr: int, o_smem, grid: tuple) -> tuple[dict, dict]:
    """plgpu.kernel launch arguments for `_cluster_sum` over `size` split CTAs (the grid's split axis becomes the
    cluster axis "c") and its barriers: every CTA past its pipeline; the partials' stores into CTA 0 (one per
    64-row group of each other CTA: Pallas counts a warpgroup's store as one arrival). Needs a portable cluster
    (<= 8 CTAs) and the receive buffer beside the output staging tile o_smem in shared memory."""
    recv = (size - 1) * bn * xr * 4
    o_smem_bytes = int(np.prod(o_smem.shape)) * jnp.dtype(o_smem.dtype).itemsize
    if size > 8 or recv + o_smem_bytes > GEMV_SMEM:
        raise ShapeError(f"{name}(mosaic): reduce='cluster' needs at most 8 split CTAs and (split - 1) x {bn} x {xr} "
                         f"float32 partials in shared memory ({recv} + {o_smem_bytes} of {GEMV_SMEM} bytes) for a "
                         f"split of {size}; use reduce='xla'")
    launch = dict(grid=(*grid[:2], 1), grid_names=("n", "m", "s"), cluster=(size,), cluster_names=("c",))
    return launch, dict(ready=plgpu.ClusterBarrier(collective_axes=("c",)),
                        red_bar=plgpu.Barrier(num_arrivals=(size - 1) * (bn // ROWS)))


def _w8_blocks(x_gmem, w_gmem, s_gmem, a_smem, n_blk, m_blk, k_first, *, bn, steps, stages, xr, kb):
    """Row block n_blk times x tile m_blk over `steps` pipeline steps from step k_first: per 64-row group, the
    [64, xr] float32 sum of the block-scaled products (see `_w8_kernel`)."""
    s_row = n_blk * bn // FP8_BLOCK                    # bn divides 128: one block-scale row per CTA
    groups = bn // ROWS

    def body(idx, w_smem, x_smem, acc):
        (k,) = idx
        blocks = range(kb)
        s = [s_gmem[s_row, (k_first + k) * kb + j] for j in blocks]
        xt = [x_smem.at[:, pl.ds(j * W8_BK, W8_BK)].transpose((1, 0)) for j in blocks]    # [128, xr]: B operands
        out = []
        for g in range(groups):
            rows = pl.ds(g * ROWS, ROWS)
            widened = [functools.partial(_widen8, w_smem.at[rows, pl.ds(j * W8_BK, W8_BK)]) for j in blocks]
            part = acc[g]
            for prod, sj in zip(_mma_values(widened, xt, a_smem, xr), s):
                part = part + prod * sj
            out.append(part)
        return tuple(out)

    zero = plgpu.layout_cast(jnp.zeros((ROWS, xr), jnp.float32), plgpu.Layout.WGMMA)
    specs = [plgpu.BlockSpec((bn, kb * W8_BK), lambda k: (n_blk, k_first + k), transforms=_tf(W8_BK, 1)),
             plgpu.BlockSpec((xr, kb * W8_BK), lambda k: (m_blk, k_first + k), transforms=_tf(2 * W8_BK, 2))]
    return plgpu.emit_pipeline(body, grid=(steps,), in_specs=specs, max_concurrent_steps=stages,
                               init_carry=(zero,) * groups)(w_gmem, x_gmem)


def _grid(name: str, M: int, N: int, K: int, bk: int, config: GemvConfig):
    """(block_n, n-blocks, m-blocks, K split, K steps per split) of a GEMV launch; the split from (N, K) only."""
    bn = config.block_n
    if K % bk:
        raise ShapeError(f"{name}(mosaic): K={K} is not a multiple of the {bk}-wide pipeline step (k_blocks="
                         f"{config.k_blocks})")
    total = K // bk
    nb, mb = pl.cdiv(N, bn), pl.cdiv(M, BM)
    split = config.split_k or auto_split(nb, total)
    if total % split:
        raise ShapeError(f"{name}(mosaic): split_k={split} does not divide the {total} K steps of {bk}")
    return bn, nb, mb, split, total // split


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def _w8_call(x, w, scale, *, out_dtype, config: GemvConfig, interpret: bool):
    M, K = x.shape
    N = w.shape[0]
    bn, nb, mb, split, steps = _grid("w8a16_gemv", M, N, K, W8_BK * config.k_blocks, config)
    xp = _pad_rows(x)
    mt, stages = launch_tiles("w8a16_gemv", M, N, K, config, out_dtype)
    xr = x_rows(M, mt, config.small_m)
    dp, nt = tail_blocks(nb, config.tail_split) if split == 1 else (nb, 0)
    tail = config.tail_split
    size = tail if nt and config.reduce == "cluster" and not interpret else 0
    direct, out_type, o_smem = _out_spec(xp.shape[0], N, bn, split, out_dtype, xr)
    kernel = functools.partial(_w8_kernel, bn=bn, steps=steps, stages=stages, direct=direct, xr=xr,
                               kb=config.k_blocks)
    scratch = dict(o_smem=o_smem, a_smem=plgpu.SMEM((ROWS, W8_BK), jnp.bfloat16, transforms=_tf(2 * W8_BK, 2))
                   if interpret else None)
    grid = (nb, pl.cdiv(mb, mt), split)
    if nt:
        if steps % tail or (size and dp % tail):
            raise ShapeError(f"w8a16_gemv(mosaic): tail_split={tail} does not divide the {steps} K steps of "
                             f"{W8_BK * config.k_blocks}" + (f" or the {dp} whole row blocks" if size else ""))
        kernel = functools.partial(kernel, dp=dp, tail=tail)
        grid = (dp // tail + nt if size else dp + nt * tail, *grid[1:])
        if not size:
            out_type = (out_type, jax.ShapeDtypeStruct((tail, nt * bn, pl.cdiv(xp.shape[0], xr) * xr), jnp.float32))
    launch = dict(grid=grid, grid_names=("n", "m", "s"))
    if size:              # the tail pieces meet in CTA 0 of each cluster (interpret mode: XLA adds them)
        kernel = functools.partial(kernel, cluster=size)
        launch, barriers = _cluster_launch("w8a16_gemv", size, bn, xr, o_smem, grid)
        scratch.update(barriers)
    f = plgpu.kernel(kernel, out_type=out_type, **launch, scratch_types=scratch, **_interpret_kw(interpret))
    if not nt or size:
        return _finish(f(xp, w, scale), direct, M, out_dtype)
    out, parts = f(xp, w, scale)
    y = _finish(out, direct, M, out_dtype)
    return jnp.concatenate([y[:, :dp * bn], _finish(parts, False, M, out_dtype)], axis=1)


def tail_blocks(n_blocks: int, tail_split: int) -> tuple[int, int]:
    """(row blocks taken whole, row blocks split into `tail_split` K pieces) of an unsplit w8 launch: the blocks
    past the last whole number per SM are split (in_proj: 290 = 264 + 26 over H200_SMS = 132), none without a tail."""
    whole = n_blocks // H200_SMS * H200_SMS
    if not tail_split or not whole or whole == n_blocks:
        return n_blocks, 0
    return whole, n_blocks - whole


# the most x tiles per CTA an auto launch takes (the fastest on the H200, benchmarks/notes/gemv.md)
M_TILES_AUTO = {"w8a16_gemv": 8, "w4a16_gemv": 4}
TILES_STAGES = 2       # pipeline stages of a multi-tile launch: two CTAs per SM
GEMV_SMEM = 220 * 1024  # pipeline stages + output staging of a GEMV CTA (of 227 KB; the rest: barriers)


def launch_tiles(name: str, M: int, N: int, K: int, config: GemvConfig, out_dtype) -> tuple[int, int]:
    """(16-row x tiles per CTA, pipeline stages) of a launch. config.m_tiles as given, or (0) up to
    M_TILES_AUTO[name] of the m-blocks at no more than TILES_STAGES stages, as fit in GEMV_SMEM (the stages' weight and
    x tiles, the output staging), spread evenly over the fewest CTAs."""
    w8 = name == "w8a16_gemv"
    bk = (W8_BK if w8 else W4_BK) * config.k_blocks
    bn, _, mb, split, steps = _grid(name, M, N, K, bk, config)
    stages = min(config.stages, steps) if w8 else config.stages
    w_bytes = bn * (bk if w8 else bk // 2 + bk // 16)       # per stage
    out_bytes = 2 if _direct(split, out_dtype) else 4
    smem = lambda mt, st: st * w_bytes + (st * 2 * bk + out_bytes * bn) * BM * mt
    if config.m_tiles:
        if smem(config.m_tiles, stages) > GEMV_SMEM:
            raise ShapeError(f"{name}(mosaic): config.m_tiles={config.m_tiles} needs {smem(config.m_tiles, stages)} "
                             f"bytes of shared memory with {stages} stages of {bn} rows (at most {GEMV_SMEM}); use "
                             "fewer stages or tiles")
        return config.m_tiles, stages
    mt = min(mb, M_TILES_AUTO[name])
    tile_stages = min(stages, TILES_STAGES)
    while mt > 1 and smem(mt, tile_stages) > GEMV_SMEM:
        mt -= 1
    return (pl.cdiv(mb, pl.cdiv(mb, mt)), tile_stages) if mt > 1 else (1, stages)


def x_rows(M: int, m_tiles: int, small_m: bool = True) -> int:
    """x rows per CTA, the wgmma N: one 8-row tile when M <= 8 (half the x bytes per step of a 16-row tile), else
    16 per x tile. A wgmma computes each output column the same way whatever its N (n8 / n16 / n48 / n128 in the
    GPU tests), so rows keep their bits across the two."""
    return X_ROWS_SMALL if small_m and M <= X_ROWS_SMALL and m_tiles == 1 else BM * m_tiles


def _interpret_kw(interpret) -> dict:
    """interpret: False (compile), True (GPU interpret mode) or an InterpretGPUParams (e.g. race detection)."""
    if not interpret:
        return {}
    return dict(interpret=interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams())


def _check_config(name: str, config: GemvConfig):
    w4 = name == "w4a16_gemv"
    if config.block_n not in (64, 128) or config.stages < (2 if w4 else 1) or config.split_k < 0:
        raise ShapeError(f"{name}(mosaic): config expects block_n in (64, 128), stages >= 1 (w4: >= 2, stages are "
                         f"released one step late), split_k >= 0; got {config}")
    if not 0 <= config.m_tiles <= 16:
        raise ShapeError(f"{name}(mosaic): config.m_tiles expects 0 (auto) to 16; got {config}")
    if not 1 <= config.k_blocks <= (2 if w4 else 4):
        raise ShapeError(f"{name}(mosaic): config.k_blocks expects 1 to 4 (w4: 2; Mosaic finds no bank-conflict-free "
                         f"scale load for a 64-byte scale row); got {config}")
    if not 0 <= config.tail_split <= 16 or (config.tail_split and w4):
        raise ShapeError(f"{name}(mosaic): config.tail_split expects 0 (off) to 16, and only for w8; got {config}")
    if config.reduce not in ("cluster", "xla") or (config.reduce == "cluster" and (
            config.tail_split > 8 or config.split_k > 8 or (not w4 and config.split_k != 1))):
        raise ShapeError(f"{name}(mosaic): config.reduce expects 'xla' or 'cluster' (a portable cluster: split_k and "
                         f"tail_split <= 8; w8: the tail pieces of an unsplit launch, split_k=1); got {config}")


def _check_x_bf16(name: str, x):
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.bfloat16):
        raise ShapeError(f"{name}(mosaic): x expected bfloat16 (the wgmma B operand), got {jnp.dtype(x.dtype).name}; "
                         "use the Triton arm for other activation dtypes")


def w8a16_gemv_blocks(N: int, K: int) -> GemvConfig:
    """64 rows x 2 stages. When the row blocks alone give two CTAs per SM, no K split (the output goes straight to
    bf16, no split-K sum) and two K blocks per step, the blocks past two per SM in two K halves added in 2-CTA
    clusters; else a K split until ~4.5 CTAs per SM (out_proj: 8). Timings: benchmarks/notes/gemv.md."""
    nb, steps = pl.cdiv(N, ROWS), K // W8_BK
    base = GemvConfig(block_n=64, stages=2)
    if nb >= 2 * H200_SMS and steps % 2 == 0:
        tail = 2 if steps % 4 == 0 else 0                 # halves of whole steps at one and at two blocks per step
        return dataclasses.replace(base, split_k=1, k_blocks=2, tail_split=tail, reduce="cluster" if tail else "xla")
    return dataclasses.replace(base, split_k=auto_split(nb, steps, target=int(4.5 * H200_SMS)))


def resolve_k_blocks(config: GemvConfig, M: int) -> GemvConfig:
    """config as launched at M rows: auto m_tiles with several x tiles per CTA (M > 16) takes one K block per step
    (two blocks with 4-8 tiles were slower). k_blocks keeps every row's operations and their order, so rows stay
    bit-identical across the two (checked on the GPU)."""
    if config.k_blocks > 1 and config.m_tiles == 0 and pl.cdiv(M, BM) > 1:
        return dataclasses.replace(config, k_blocks=1)
    return config


def w8a16_gemv_mosaic(x, w, scale, *, out_dtype=None, interpret: bool = False, config: GemvConfig | None = None):
    """Decode GEMV, Mosaic GPU arm; same call and result as `w8a16_reference` (bf16 x, N % 64 == 0,
    K % 128 == 0)."""
    _check_w8a16("w8a16_gemv", x, w, scale)
    _check_x_bf16("w8a16_gemv", x)
    N, K = w.shape
    _check_dims("w8a16_gemv", N, K, W8_BK)
    config = resolve_k_blocks(config or w8a16_gemv_blocks(N, K), x.shape[0])
    _check_config("w8a16_gemv", config)
    return _w8_call(x, w, scale, out_dtype=jnp.dtype(out_dtype or x.dtype), config=config, interpret=interpret)


# ---- W4A16 (NVFP4) -------------------------------------------------------------------------------------------
def _nibble_f32(p16, high: bool):
    """uint16 register tile of packed bytes -> f32 e2m1 value * 2^-14 of the low or high nibble (exact):
    the code's sign goes to bit 15 and its 3 magnitude bits to bits 11:9 of an f16."""
    n = p16 >> 4 if high else p16
    bits = ((n & 8) << 12) | ((n & 7) << 9)
    return lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _w4_kernel(x_gmem, p_gmem, s_gmem, g_gmem, o_gmem, o_smem, a_smem, ready=None, red_bar=None, *, bn, steps,
               stages, direct, interpret, xr, kb, cluster=0):
    """NVFP4 GEMV: scales are multiplied in during the decode, so one accumulator per 64 rows (over all m_tiles x
    tiles of the CTA, one wgmma against the decoded tile) runs over all K.
    Each step waits for its own wgmmas (wait_group 0) before the next step's decode rewrites the A registers:
    PTX makes touching an in-flight wgmma's A registers undefined, and the loop body writes the same registers
    every step (a wait_group(1) version gave wrong, M-dependent rows on the GPU whenever ptxas did not serialize
    the wgmmas itself). Stages are released one step late (delay_release=1). cluster > 0: the split-K CTAs of a
    tile form a cluster and add their partials in the kernel (`_cluster_sum`)."""
    n_blk, m_blk, split = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("s")
    if cluster:
        split = lax.axis_index("c")
    k_first = split * steps
    groups = bn // ROWS

    def scoped(*accs):                                                # per 64-row group: [64, xr]
        def body(idx, p_smem, s_smem, x_smem):
            for j in range(kb):
                xt = x_smem.at[:, pl.ds(j * W4_BK, W4_BK)].transpose((1, 0))            # [256, xr]
                for g in range(groups):
                    rows = pl.ds(g * ROWS, ROWS)
                    p_j, s_j = p_smem.at[rows, pl.ds(j * 128, 128)], s_smem.at[rows, pl.ds(j * 16, 16)]
                    if interpret:
                        a = _jnp_e2m1_perm(p_j, s_j)
                    else:
                        a = _ptx_e2m1_perm_to_bf16(plgpu.load(p_j, layout=plgpu.Layout.WGMMA_UPCAST_4X),
                                                   plgpu.load(s_j, layout=W4_SCALE_LAYOUT))
                    _mma(accs[g], a, xt, a_smem)
            plgpu.wgmma_wait(0)                                       # A registers and x stage free again

        spec = lambda shape, tf, row: plgpu.BlockSpec(shape, lambda k: (row, k_first + k), transforms=tf,
                                                       delay_release=1)
        plgpu.emit_pipeline(body, grid=(steps,), in_specs=[spec((bn, kb * W4_BK // 2), _tf(128, 1), n_blk),
                                                           spec((bn, kb * W4_BK // 16), (), n_blk),
                                                           spec((xr, kb * W4_BK), _tf(128, 2), m_blk)],
                            max_concurrent_steps=stages)(p_gmem, s_gmem, x_gmem)
        return tuple(acc[...] for acc in accs)

    acc = pl.run_scoped(scoped, *[plgpu.ACC((ROWS, xr), jnp.float32) for _ in range(groups)])
    gs = g_gmem[0] * E2M1_A_SHIFT
    acc = [a * gs for a in acc]
    if cluster:
        _cluster_sum(acc, split, cluster, ready, red_bar, bn, xr,
                     lambda total: _store_out(total, o_smem, o_gmem, 0, m_blk, n_blk, bn, direct, xr))
    else:
        _store_out(acc, o_smem, o_gmem, split, m_blk, n_blk, bn, direct, xr)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def _w4_call(x, packed, scale, global_scale, *, out_dtype, config: GemvConfig, interpret: bool):
    M, K = x.shape
    N = packed.shape[0]
    bn, nb, mb, split, steps = _grid("w4a16_gemv", M, N, K, W4_BK * config.k_blocks, config)
    xp = perm64(_pad_rows(x))                          # the decoded tiles' columns arrive in this order
    mt, stages = launch_tiles("w4a16_gemv", M, N, K, config, out_dtype)
    xr = x_rows(M, mt, config.small_m)
    size = split if split > 1 and config.reduce == "cluster" and not interpret else 0
    direct, out_type, o_smem = _out_spec(xp.shape[0], N, bn, 1 if size else split, out_dtype, xr)
    kernel = functools.partial(_w4_kernel, bn=bn, steps=steps, stages=stages, direct=direct,
                               interpret=bool(interpret), xr=xr, kb=config.k_blocks, cluster=size)
    scratch = dict(o_smem=o_smem, a_smem=plgpu.SMEM((ROWS, W4_BK), jnp.bfloat16, transforms=_tf(128, 2))
                   if interpret else None)
    grid = (nb, pl.cdiv(mb, mt), split)
    launch = dict(grid=grid, grid_names=("n", "m", "s"))
    if size:              # the split-K partials meet in CTA 0 of each cluster (interpret mode: XLA adds them)
        launch, barriers = _cluster_launch("w4a16_gemv", size, bn, xr, o_smem, grid)
        scratch.update(barriers)
    f = plgpu.kernel(kernel, out_type=out_type, **launch, scratch_types=scratch, **_interpret_kw(interpret))
    g = jnp.asarray(global_scale, jnp.float32).reshape(1)
    return _finish(f(xp, packed, scale, g), direct, M, out_dtype)


def w4a16_gemv_blocks(N: int, K: int, M: int = 1) -> GemvConfig:
    """The launch at M rows: 64-row tiles; split 2 x 4 stages when the rows alone fill two CTAs per SM (in_proj),
    the halves added in 2-CTA clusters up to M = 64 and by XLA above (the same bits); else 3 stages and the auto
    split (out_proj: 4, summed by XLA). Timings: benchmarks/notes/gemv.md."""
    nb, steps = pl.cdiv(N, ROWS), K // W4_BK
    if nb >= 2 * H200_SMS and steps % 2 == 0:
        return GemvConfig(block_n=64, stages=4, split_k=2, reduce="cluster" if M <= 64 else "xla")
    return GemvConfig(block_n=64, stages=3, split_k=auto_split(nb, steps))


def w4a16_gemv_mosaic(x, packed, scale, global_scale, *, out_dtype=None, interpret: bool = False,
                      config: GemvConfig | None = None):
    """Decode GEMV on NVFP4 weights, Mosaic GPU arm; same call and result as `w4a16_reference`
    (bf16 x, N % 64 == 0, K % 512 == 0)."""
    check_nvfp4_args("w4a16_gemv", x, packed, scale, global_scale, transposed=False)
    _check_x_bf16("w4a16_gemv", x)
    N, K = packed.shape[0], 2 * packed.shape[1]
    _check_dims("w4a16_gemv", N, K, W4_K)
    config = resolve_k_blocks(config or w4a16_gemv_blocks(N, K, x.shape[0]), x.shape[0])
    _check_config("w4a16_gemv", config)
    return _w4_call(x, packed, scale, global_scale, out_dtype=jnp.dtype(out_dtype or x.dtype), config=config,
                    interpret=interpret)


# Registered beside the Triton arms; shapes the Mosaic arms do not take go to the Triton arm (registry). Mosaic is
# the GPU default of both: faster than the Triton arms at the 8B shapes on the H200 (benchmarks/notes/gemv.md).
registry.register("w8a16_gemv", reference=w8a16_reference, mosaic=w8a16_gemv_mosaic, gpu_default="mosaic",
                  mosaic_supports=lambda x, w, scale, **_: supports("w8a16_gemv", *w.shape, x.dtype))
registry.register("w4a16_gemv", reference=w4a16_reference, mosaic=w4a16_gemv_mosaic, gpu_default="mosaic",
                  mosaic_supports=lambda x, packed, *_, **__: supports("w4a16_gemv", packed.shape[0],
                                                                        2 * packed.shape[1], x.dtype))
