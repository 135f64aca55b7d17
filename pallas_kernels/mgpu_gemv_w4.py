"""W4A16 (NVFP4) decode GEMV on Hopper, the Mosaic GPU arm of `w4a16_gemv` (design: pallas_kernels/mgpu_gemv.py),
and the register-level NVFP4 decoder it shares with the prefill GEMM (mgpu_gemm_nvfp4.py).

Packed E2M1 tiles are loaded in WGMMA_UPCAST_4X layout and decoded with integer PTX straight into the registers of
the same thread's WGMMA A fragment, a fixed permutation of K (`perm64`) that x's columns get too; the E4M3 group
scales are applied during the decode and the global scale on the accumulator.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import epilogues, registry
from pallas_kernels.mgpu_gemv import (ROWS, W4_BK, W4_K, GemvConfig, _check_config, _check_dims, _check_x_bf16,
                                      _cluster_launch, _cluster_sum, _finish, _grid, _interpret_kw, _mma, _out_spec,
                                      _pad_rows, _store_out, _tf, auto_split, launch_tiles, resolve_k_blocks,
                                      supports, x_rows)
from pallas_kernels.split_partials import check_unreduced
from pallas_kernels.w4a16 import check_nvfp4_args, w4a16_reference
from pallas_kernels.w8a16 import H200_SMS


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


def _nibble_f32(p16, high: bool):
    """uint16 register tile of packed bytes -> f32 e2m1 value * 2^-14 of the low or high nibble (exact):
    the code's sign goes to bit 15 and its 3 magnitude bits to bits 11:9 of an f16."""
    n = p16 >> 4 if high else p16
    bits = ((n & 8) << 12) | ((n & 7) << 9)
    return lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _w4_kernel(x_gmem, p_gmem, s_gmem, g_gmem, o_gmem, o_smem, a_smem, ready=None, red_bar=None, *, bn, steps,
               stages, direct, interpret, xr, kb, epilogue=None, cluster=0):
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
                     lambda total: _store_out(total, o_smem, o_gmem, 0, m_blk, n_blk, bn, direct, xr, epilogue))
    else:
        _store_out(acc, o_smem, o_gmem, split, m_blk, n_blk, bn, direct, xr, epilogue)


@functools.partial(jax.jit, static_argnames=("out_dtype", "epilogue", "config", "interpret", "unreduced"))
def _w4_call(x, packed, scale, global_scale, *, out_dtype, epilogue, config: GemvConfig, interpret: bool,
             unreduced: bool = False):
    M, K = x.shape
    N = packed.shape[0]
    bn, nb, mb, split, steps = _grid("w4a16_gemv", M, N, K, W4_BK * config.k_blocks, config)
    xp = perm64(_pad_rows(x))                          # the decoded tiles' columns arrive in this order
    mt, stages = launch_tiles("w4a16_gemv", M, N, K, config, out_dtype)
    xr = x_rows(M, mt, config.small_m)
    size = split if split > 1 and config.reduce == "cluster" and not interpret else 0
    direct, out_type, o_smem = _out_spec(xp.shape[0], N, bn, 1 if size else split, out_dtype, xr)
    kernel = functools.partial(_w4_kernel, bn=bn, steps=steps, stages=stages, direct=direct,
                               interpret=bool(interpret), xr=xr, kb=config.k_blocks, epilogue=epilogue, cluster=size)
    scratch = dict(o_smem=o_smem, a_smem=plgpu.SMEM((ROWS, W4_BK), jnp.bfloat16, transforms=_tf(128, 2))
                   if interpret else None)
    grid = (nb, pl.cdiv(mb, mt), split)
    launch = dict(grid=grid, grid_names=("n", "m", "s"))
    if size:              # the split-K partials meet in CTA 0 of each cluster (interpret mode: XLA adds them)
        launch, barriers = _cluster_launch("w4a16_gemv", size, bn, xr, o_smem, grid)
        scratch.update(barriers)
    f = plgpu.kernel(kernel, out_type=out_type, **launch, scratch_types=scratch, **_interpret_kw(interpret))
    g = jnp.asarray(global_scale, jnp.float32).reshape(1)
    return _finish(f(xp, packed, scale, g), direct, M, out_dtype, epilogue, unreduced)


def w4a16_gemv_blocks(N: int, K: int, M: int = 1) -> GemvConfig:
    """The launch at M rows: 64-row tiles; split 2 x 4 stages when the rows alone fill two CTAs per SM (in_proj),
    the halves added in 2-CTA clusters up to M = 64 and by XLA above (the same bits); else 3 stages and the auto
    split (out_proj: 4, summed by XLA). Timings: benchmarks/notes/gemv.md."""
    nb, steps = pl.cdiv(N, ROWS), K // W4_BK
    if nb >= 2 * H200_SMS and steps % 2 == 0:
        return GemvConfig(block_n=64, stages=4, split_k=2, reduce="cluster" if M <= 64 else "xla")
    return GemvConfig(block_n=64, stages=3, split_k=auto_split(nb, steps))


def w4a16_gemv_mosaic(x, packed, scale, global_scale, *, out_dtype=None, epilogue: str | None = None,
                      interpret: bool = False, config: GemvConfig | None = None, unreduced: bool = False):
    """Decode GEMV on NVFP4 weights, Mosaic GPU arm; same call and result as `w4a16_reference`
    (bf16 x, N % 64 == 0, K % 512 == 0); the epilogue in the kernel where it stores the output dtype straight
    away."""
    check_nvfp4_args("w4a16_gemv", x, packed, scale, global_scale, transposed=False)
    epilogues.check("w4a16_gemv", epilogue)
    check_unreduced("w4a16_gemv", unreduced, epilogue, out_dtype)
    _check_x_bf16("w4a16_gemv", x)
    N, K = packed.shape[0], 2 * packed.shape[1]
    _check_dims("w4a16_gemv", N, K, W4_K)
    config = resolve_k_blocks(config or w4a16_gemv_blocks(N, K, x.shape[0]), x.shape[0])
    _check_config("w4a16_gemv", config)
    return _w4_call(x, packed, scale, global_scale, out_dtype=jnp.dtype(jnp.float32 if unreduced else out_dtype or
                                                                         x.dtype),
                    epilogue=epilogue, config=config, interpret=interpret, unreduced=unreduced)


# Registered beside the Triton arm; shapes the Mosaic arm does not take go to the Triton arm (registry). Mosaic is
# the GPU default: faster than the Triton arm at the 8B shapes on the H200 (benchmarks/notes/gemv.md).
registry.register("w4a16_gemv", reference=w4a16_reference, mosaic=w4a16_gemv_mosaic, gpu_default="mosaic",
                  mosaic_supports=lambda x, packed, *_, **__: supports("w4a16_gemv", packed.shape[0],
                                                                        2 * packed.shape[1], x.dtype))
