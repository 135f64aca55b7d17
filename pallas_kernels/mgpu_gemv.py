"""Decode GEMVs on Hopper through Pallas Mosaic GPU: the Mosaic arms of `w8a16_gemv` and `w4a16_gemv`.

Both compute out^T = W x^T with the weight tile as the wgmma A operand, widened to bf16 in registers
(no shared-memory round trip), and x^T (16 rows, zero-filled past M by TMA) as the B operand in shared
memory. Weight tiles stream through a multi-stage TMA pipeline (`emit_pipeline`).

  w8a16: E4M3 tile [64, 128] -> bf16 (exact); one block scale per 128-wide K step, applied in float32
         to that step's product, so the result equals dequantize-then-matmul up to f32 summation order.
  w4a16: packed E2M1 [64, 256 bytes] per 512-wide K step, as two planes (low nibbles = even k, high =
         odd k) multiplied with the even / odd columns of x. The E4M3 group scales are expanded to the
         plane's register layout by a small wgmma (scales [64, 32] x a 0/1 expansion matrix), then
         e2m1 * scale is formed exactly in bf16; the global scale multiplies the result.
Widening (GemvConfig.widen): jnp conversions, or inline PTX through `plgpu.inline_mgpu` (GPU only).
Defaults from the H200 runs of 2026-11-30 (benchmarks/notes/quant.md): w8 jnp, w4 PTX.

Tiles never depend on M (x rows in tiles of 16, split-K chosen from (N, K) only, split partials added in a
fixed order), so a row's result is meant to be bit-identical whatever the batch. Interpret mode (CPU tests)
passes the A operand through shared memory, since the GPU interpreter's wgmma reads A from shared memory
only, and always widens with jnp; everything else is shared with the compiled kernel.
Shapes: bf16 x, N % 64 == 0, K % 128 (w8) / K % 512 (w4) == 0 (`supports`); else ShapeError.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from metrale_jax.errors import ShapeError
from metrale_jax.weights.quant_formats import FP8_BLOCK
from pallas_kernels import registry
from pallas_kernels.w4a16 import check_nvfp4_args, w4a16_reference
from pallas_kernels.w8a16 import H200_SMS, _check_w8a16, w8a16_reference

BM = 16            # x rows per tile (the wgmma N dimension); fixed so that rows are batch-invariant
ROWS = 64          # wgmma M: weight rows per warpgroup instruction
W8_BK = 128        # K per step of w8a16 (one block scale)
W4_BK = 512        # K per step of w4a16 (256 packed bytes, 32 scale groups)


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """block_n: weight rows per CTA (64 or 128); stages: pipeline depth; split_k: K splits (0 = auto)."""

    block_n: int = 64
    stages: int = 6
    split_k: int = 0
    load: str = "upcast"      # 8-bit tiles read from SMEM as 4-byte vectors + one shuffle, or "direct" (2 bytes)
    widen: str = "jnp"        # weights -> bf16 by jnp conversions ("jnp") or inline PTX ("ptx"); interpret: jnp


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


def _load_8bit(ref, how: str):
    """An 8-bit [64, c] SMEM tile -> registers in WGMMA layout (the A operand's): read as 4-byte vectors and
    shuffled once ("upcast"), or read as 2-byte vectors in place ("direct")."""
    if how == "direct":
        return plgpu.load(ref, layout=plgpu.Layout.WGMMA)
    return plgpu.layout_cast(plgpu.load(ref, layout=plgpu.Layout.WGMMA_UPCAST_2X), plgpu.Layout.WGMMA)


# ---- register-level widening through inline PTX (GPU only; interpret mode uses the jnp forms) ----------------
# E4M3 pair -> bf16 pair, exact, with half the conversion-pipe work of E4M3 -> f16 -> f32 -> bf16: the hardware
# cvt gives an f16 pair; an f16 from E4M3 is normal with 7 zero low mantissa bits, so moving its magnitude
# right by 3 bits reads as a bf16 of value * 2^-112, and one bf16x2 multiply by 2^112 (exact) restores it.
_E4M3_TO_BF16 = """{
.reg .b32 h, m, k, z;
mov.b32 k, 0x77807780;
mov.b32 z, 0x80008000;
cvt.rn.f16x2.e4m3x2 h, $1;
shr.b32 m, h, 3;
and.b32 m, m, 0x0FFF0FFF;
and.b32 h, h, 0x80008000;
or.b32 h, h, m;
fma.rn.bf16x2 $0, h, k, z;
}"""
# Two packed E2M1 bytes + their bf16 scale pair -> (low nibbles, high nibbles) as bf16 pairs, exact: a code's
# sign goes to bit 15 and its 3 magnitude bits to bits 8:6 of a 16-bit lane, i.e. a bf16 of value * 2^-126
# (code 1 the subnormal 2^-127); a bf16x2 multiply by 2^126 and one by the scale restore it (both exact).
_E2M1_TO_BF16 = """{
.reg .b32 t, u, a, b, k, z, n;
mov.b32 k, 0x7E807E80;
mov.b32 z, 0x80008000;
mov.b32 n, 0;
cvt.u32.u16 t, $2;
prmt.b32 t, t, n, 0x4140;
shr.b32 u, t, 4;
shl.b32 a, t, 12; and.b32 a, a, 0x80008000; shl.b32 b, t, 6; and.b32 b, b, 0x01C001C0; or.b32 a, a, b;
fma.rn.bf16x2 a, a, k, z; fma.rn.bf16x2 $0, a, $3, z;
shl.b32 a, u, 12; and.b32 a, a, 0x80008000; shl.b32 b, u, 6; and.b32 b, b, 0x01C001C0; or.b32 a, a, b;
fma.rn.bf16x2 a, a, k, z; fma.rn.bf16x2 $1, a, $3, z;
}"""


def _ptx_e4m3_to_bf16(w):
    """E4M3 [64, c] in WGMMA layout -> bf16 [64, c] (same layout) through `_E4M3_TO_BF16` per register."""
    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct(w.shape, jnp.bfloat16, plgpu.Layout.WGMMA))
    def widen(ctx, fa):
        from jax.experimental.mosaic import gpu as mgpu
        from jax.experimental.mosaic.gpu import utils as mu
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import llvm
        i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
        bf2 = ir.VectorType.get((2,), ir.BF16Type.get())
        regs = np.empty_like(fa.registers)
        for idx, r in np.ndenumerate(fa.registers):
            out = llvm.inline_asm(i32, [mu.bitcast(r, i16)], _E4M3_TO_BF16, "=r,h")
            regs[idx] = mu.bitcast(out, bf2)
        return mgpu.FragmentedArray(_registers=regs, _layout=fa.layout, _is_signed=None)
    return widen(w)


def _ptx_e2m1_to_bf16(p, s_bf16):
    """Packed bytes [64, c] (uint8) and bf16 scales [64, c] (both WGMMA layout) -> (lo, hi) bf16 planes."""
    ty = plgpu.ShapeDtypeStruct(p.shape, jnp.bfloat16, plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA), return_type=(ty, ty))
    def decode(ctx, fp, fs):
        from jax.experimental.mosaic import gpu as mgpu
        from jax.experimental.mosaic.gpu import utils as mu
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import llvm
        i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
        bf2 = ir.VectorType.get((2,), ir.BF16Type.get())
        pair = ir.Type.parse("!llvm.struct<(i32, i32)>")
        lo, hi = np.empty_like(fp.registers), np.empty_like(fp.registers)
        for idx, r in np.ndenumerate(fp.registers):
            out = llvm.inline_asm(pair, [mu.bitcast(r, i16), mu.bitcast(fs.registers[idx], i32)], _E2M1_TO_BF16,
                                  "=r,=r,h,r")
            lo[idx] = mu.bitcast(llvm.extractvalue(i32, out, [0]), bf2)
            hi[idx] = mu.bitcast(llvm.extractvalue(i32, out, [1]), bf2)
        return (mgpu.FragmentedArray(_registers=lo, _layout=fp.layout, _is_signed=None),
                mgpu.FragmentedArray(_registers=hi, _layout=fp.layout, _is_signed=None))
    return decode(p, s_bf16)


def _mma(acc_ref, a, b_ref, a_smem):
    """acc_ref += a @ b_ref with a from registers, or through `a_smem` in interpret mode."""
    if a_smem is not None:
        a_smem[...] = a
        plgpu.commit_smem()
        a = a_smem
    plgpu.wgmma(acc_ref, a, b_ref)


def _mma_value(a, b_ref, a_smem, n: int):
    """A fresh [64, n] float32 product a @ b_ref (waits for it)."""
    def run(acc_ref):
        _mma(acc_ref, a, b_ref, a_smem)
        return acc_ref[...]
    return pl.run_scoped(run, plgpu.ACC((ROWS, n), jnp.float32))


def _store_out(accs, o_smem, o_gmem, split, m_blk, n_blk, bn, direct):
    """accs: [64, BM] tiles of out^T. direct: into o_gmem [M, N] through transposed SMEM views (TMA clips
    rows past M and columns past N; 16-bit outputs only). Else as float32 out^T partials into
    o_gmem [split, N, Mp] (summed and transposed by the caller)."""
    for g, acc in enumerate(accs):
        rows = pl.ds(g * ROWS, ROWS)
        dst = o_smem.at[:, rows].transpose((1, 0)) if direct else o_smem.at[rows]
        dst[...] = acc.astype(o_smem.dtype)
    plgpu.commit_smem()
    if direct:
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[pl.ds(m_blk * BM, BM), pl.ds(n_blk * bn, bn)])
    else:
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[split, pl.ds(n_blk * bn, bn), pl.ds(m_blk * BM, BM)])
    plgpu.wait_smem_to_gmem(0)


def _out_spec(M: int, N: int, bn: int, split: int, out_dtype):
    """(direct?, out type, SMEM staging tile) for a call with M (padded) rows; see `_store_out`."""
    direct = split == 1 and jnp.dtype(out_dtype).itemsize == 2
    if direct:
        return True, jax.ShapeDtypeStruct((M, N), out_dtype), plgpu.SMEM((BM, bn), out_dtype)
    return False, jax.ShapeDtypeStruct((split, N, pl.cdiv(M, BM) * BM), jnp.float32), plgpu.SMEM((bn, BM), jnp.float32)


def _pad_rows(x):
    """TMA tiles x rows by 8: an M above 8 that is not a multiple of 8 gets zero rows appended."""
    M = x.shape[0]
    return x if M <= 8 or M % 8 == 0 else jnp.pad(x, ((0, -M % 8), (0, 0)))


def supports(kernel: str, N: int, K: int, x_dtype) -> bool:
    """Whether the Mosaic arm of `kernel` ("w8a16_gemv" / "w4a16_gemv") takes these shapes (else ShapeError)."""
    k_multiple = {"w8a16_gemv": W8_BK, "w4a16_gemv": W4_BK}[kernel]
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
def _w8_kernel(x_gmem, w_gmem, s_gmem, o_gmem, o_smem, a_smem, *, bn, steps, stages, direct, load, widen):
    n_blk, m_blk, split = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("s")
    k_first = split * steps
    s_row = n_blk * bn // FP8_BLOCK                    # bn divides 128: one block-scale row per CTA
    groups = bn // ROWS

    def body(idx, w_smem, x_smem, acc):
        (k,) = idx
        s = s_gmem[s_row, k_first + k]
        xt = x_smem.transpose((1, 0))                   # [128, BM]: the B operand
        out = []
        for g in range(groups):
            w = _load_8bit(w_smem.at[pl.ds(g * ROWS, ROWS)], load)
            if widen == "ptx":
                a = _ptx_e4m3_to_bf16(w)
            else:                                              # exact; ptxas 13.0 has no direct e4m3->bf16 cvt
                a = w.astype(jnp.float32).astype(jnp.bfloat16)
            out.append(acc[g] + _mma_value(a, xt, a_smem, BM) * s)
        return tuple(out)

    zero = plgpu.layout_cast(jnp.zeros((ROWS, BM), jnp.float32), plgpu.Layout.WGMMA)
    acc = plgpu.emit_pipeline(
        body, grid=(steps,),
        in_specs=[plgpu.BlockSpec((bn, W8_BK), lambda k: (n_blk, k_first + k), transforms=_tf(W8_BK, 1)),
                  plgpu.BlockSpec((BM, W8_BK), lambda k: (m_blk, k_first + k), transforms=_tf(2 * W8_BK, 2))],
        max_concurrent_steps=stages, init_carry=(zero,) * groups)(w_gmem, x_gmem)
    _store_out(acc, o_smem, o_gmem, split, m_blk, n_blk, bn, direct)


def _grid(name: str, M: int, N: int, K: int, bk: int, config: GemvConfig):
    """(block_n, n-blocks, m-blocks, K split, K steps per split) of a GEMV launch; the split from (N, K) only."""
    bn = config.block_n
    total = pl.cdiv(K, bk)
    nb, mb = pl.cdiv(N, bn), pl.cdiv(M, BM)
    split = config.split_k or auto_split(nb, total)
    if total % split:
        raise ShapeError(f"{name}(mosaic): split_k={split} does not divide the {total} K steps of {bk}")
    return bn, nb, mb, split, total // split


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def _w8_call(x, w, scale, *, out_dtype, config: GemvConfig, interpret: bool):
    M, K = x.shape
    N = w.shape[0]
    bn, nb, mb, split, steps = _grid("w8a16_gemv", M, N, K, W8_BK, config)
    xp = _pad_rows(x)
    direct, out_type, o_smem = _out_spec(xp.shape[0], N, bn, split, out_dtype)
    kernel = functools.partial(_w8_kernel, bn=bn, steps=steps, stages=min(config.stages, steps), direct=direct,
                               load=config.load, widen="jnp" if interpret else config.widen)
    f = plgpu.kernel(
        kernel, out_type=out_type, grid=(nb, mb, split), grid_names=("n", "m", "s"),
        scratch_types=dict(o_smem=o_smem,
                           a_smem=plgpu.SMEM((ROWS, W8_BK), jnp.bfloat16, transforms=_tf(2 * W8_BK, 2))
                           if interpret else None),
        **_interpret_kw(interpret))
    return _finish(f(xp, w, scale), direct, M, out_dtype)


def _interpret_kw(interpret) -> dict:
    """interpret: False (compile), True (GPU interpret mode) or an InterpretGPUParams (e.g. race detection)."""
    if not interpret:
        return {}
    return dict(interpret=interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams())


def _check_config(name: str, config: GemvConfig):
    if config.block_n not in (64, 128) or config.stages < 1 or config.split_k < 0 or config.load not in (
            "upcast", "direct") or config.widen not in ("ptx", "jnp"):
        raise ShapeError(f"{name}(mosaic): config expects block_n in (64, 128), stages >= 1, split_k >= 0, "
                         f"load 'upcast' or 'direct', widen 'ptx' or 'jnp'; "
                         f"got {config}")


def _check_x_bf16(name: str, x):
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.bfloat16):
        raise ShapeError(f"{name}(mosaic): x expected bfloat16 (the wgmma B operand), got {jnp.dtype(x.dtype).name}; "
                         "use the Triton arm for other activation dtypes")


def w8a16_gemv_blocks(N: int, K: int) -> GemvConfig:
    """H200 2026-11-30 (benchmarks/notes/quant.md): jnp widening beat the PTX recipe (27.5 vs 33.2 us, in_proj)."""
    return GemvConfig(block_n=64, stages=6, widen="jnp")


def w8a16_gemv_mosaic(x, w, scale, *, out_dtype=None, interpret: bool = False, config: GemvConfig | None = None):
    """Decode GEMV, Mosaic GPU arm; same call and result as `w8a16_reference` (bf16 x, N % 64 == 0,
    K % 128 == 0)."""
    _check_w8a16("w8a16_gemv", x, w, scale)
    _check_x_bf16("w8a16_gemv", x)
    N, K = w.shape
    _check_dims("w8a16_gemv", N, K, W8_BK)
    config = config or w8a16_gemv_blocks(N, K)
    _check_config("w8a16_gemv", config)
    return _w8_call(x, w, scale, out_dtype=jnp.dtype(out_dtype or x.dtype), config=config, interpret=interpret)


# ---- W4A16 (NVFP4) -------------------------------------------------------------------------------------------
def _expander(value: float) -> np.ndarray:
    """[2, 32, 128] 0/value matrices: half h maps scale group 16h + j // 8 to plane column j. value = 2^14 for
    the jnp decoder (which yields e2m1 * 2^-14), 1 for the PTX one."""
    e = np.zeros((2, 32, 128), np.float32)
    for h in range(2):
        e[h, 16 * h + np.arange(128) // 8, np.arange(128)] = value
    return e


def _nibble_f32(p16, high: bool):
    """uint16 register tile of packed bytes -> f32 e2m1 value * 2^-14 of the low or high nibble (exact):
    the code's sign goes to bit 15 and its 3 magnitude bits to bits 11:9 of an f16."""
    n = p16 >> 4 if high else p16
    bits = ((n & 8) << 12) | ((n & 7) << 9)
    return lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _w4_kernel(xe_gmem, xo_gmem, p_gmem, s_gmem, g_gmem, e_gmem, o_gmem, o_smem, e_smem, bar, a_smem, sa_smem, *,
               bn, steps, stages, direct, load, widen):
    n_blk, m_blk, split = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("s")
    k_first = split * steps
    groups = bn // ROWS
    plgpu.copy_gmem_to_smem(e_gmem, e_smem, bar.at[0])
    plgpu.barrier_wait(bar.at[0])

    def body(idx, p0_smem, p1_smem, s_smem, xe_smem, xo_smem, acc):
        out = []
        for g in range(groups):
            rows = pl.ds(g * ROWS, ROWS)
            s = _load_8bit(s_smem.at[rows], load).astype(jnp.float32).astype(jnp.bfloat16)  # [64, 32] scales
            part = acc[g]
            for h, p_smem in enumerate((p0_smem, p1_smem)):
                sexp = _mma_value(s, e_smem.at[h], sa_smem, 128)      # [64, 128] scale (* 2^14 for jnp)
                p = _load_8bit(p_smem.at[rows], load)
                cols = pl.ds(h * 128, 128)
                if widen == "ptx":
                    lo, hi = _ptx_e2m1_to_bf16(p, sexp.astype(jnp.bfloat16))
                else:
                    p = p.astype(jnp.uint16)
                    lo = (_nibble_f32(p, False) * sexp).astype(jnp.bfloat16)
                    hi = (_nibble_f32(p, True) * sexp).astype(jnp.bfloat16)

                def run(acc_ref, lo=lo, hi=hi, cols=cols):
                    _mma(acc_ref, lo, xe_smem.at[:, cols].transpose((1, 0)), None if a_smem is None else a_smem.at[0])
                    _mma(acc_ref, hi, xo_smem.at[:, cols].transpose((1, 0)), None if a_smem is None else a_smem.at[1])
                    return acc_ref[...]
                part = part + pl.run_scoped(run, plgpu.ACC((ROWS, BM), jnp.float32))
            out.append(part)
        return tuple(out)

    ptf, stf, xtf = _tf(128, 1), _tf(32, 1), _tf(128, 2)
    zero = plgpu.layout_cast(jnp.zeros((ROWS, BM), jnp.float32), plgpu.Layout.WGMMA)
    acc = plgpu.emit_pipeline(
        body, grid=(steps,),
        in_specs=[plgpu.BlockSpec((bn, 128), lambda k: (n_blk, 2 * (k_first + k)), transforms=ptf),
                  plgpu.BlockSpec((bn, 128), lambda k: (n_blk, 2 * (k_first + k) + 1), transforms=ptf),
                  plgpu.BlockSpec((bn, 32), lambda k: (n_blk, k_first + k), transforms=stf),
                  plgpu.BlockSpec((BM, 256), lambda k: (m_blk, k_first + k), transforms=xtf),
                  plgpu.BlockSpec((BM, 256), lambda k: (m_blk, k_first + k), transforms=xtf)],
        max_concurrent_steps=stages, init_carry=(zero,) * groups)(p_gmem, p_gmem, s_gmem, xe_gmem, xo_gmem)
    gs = g_gmem[0]
    _store_out([a * gs for a in acc], o_smem, o_gmem, split, m_blk, n_blk, bn, direct)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def _w4_call(x, packed, scale, global_scale, *, out_dtype, config: GemvConfig, interpret: bool):
    M, K = x.shape
    N = packed.shape[0]
    bn, nb, mb, split, steps = _grid("w4a16_gemv", M, N, K, W4_BK, config)
    xp = _pad_rows(x)
    direct, out_type, o_smem = _out_spec(xp.shape[0], N, bn, split, out_dtype)
    xe, xo = xp[:, 0::2], xp[:, 1::2]                   # [M, K/2] each: the planes' activations
    kernel = functools.partial(_w4_kernel, bn=bn, steps=steps, stages=min(config.stages, steps), direct=direct,
                               load=config.load, widen="jnp" if interpret else config.widen)
    bf = jnp.bfloat16
    f = plgpu.kernel(
        kernel, out_type=out_type, grid=(nb, mb, split), grid_names=("n", "m", "s"),
        scratch_types=dict(
            o_smem=o_smem,
            e_smem=plgpu.SMEM((2, 32, 128), bf, transforms=_tf(64, 2)),
            bar=plgpu.Barrier(num_barriers=1),
            a_smem=plgpu.SMEM((2, ROWS, 128), bf, transforms=_tf(128, 2)) if interpret else None,
            sa_smem=plgpu.SMEM((ROWS, 32), bf, transforms=_tf(64, 2)) if interpret else None),
        **_interpret_kw(interpret))
    g = jnp.asarray(global_scale, jnp.float32).reshape(1)
    e = _expander(16384.0 if interpret or config.widen == "jnp" else 1.0)
    return _finish(f(xe, xo, packed, scale, g, jnp.asarray(e, bf)), direct, M, out_dtype)


def w4a16_gemv_blocks(N: int, K: int) -> GemvConfig:
    """H200 2026-11-30: the PTX decoder beat the jnp one (63.8 vs 88.8 us, in_proj); Triton is faster still."""
    return GemvConfig(block_n=128, stages=3, widen="ptx")


def w4a16_gemv_mosaic(x, packed, scale, global_scale, *, out_dtype=None, interpret: bool = False,
                      config: GemvConfig | None = None):
    """Decode GEMV on NVFP4 weights, Mosaic GPU arm; same call and result as `w4a16_reference`
    (bf16 x, N % 64 == 0, K % 512 == 0)."""
    check_nvfp4_args("w4a16_gemv", x, packed, scale, global_scale, transposed=False)
    _check_x_bf16("w4a16_gemv", x)
    N, K = packed.shape[0], 2 * packed.shape[1]
    _check_dims("w4a16_gemv", N, K, W4_BK)
    config = config or w4a16_gemv_blocks(N, K)
    _check_config("w4a16_gemv", config)
    return _w4_call(x, packed, scale, global_scale, out_dtype=jnp.dtype(out_dtype or x.dtype), config=config,
                    interpret=interpret)


# Registered beside the Triton arms; shapes the Mosaic arms do not take go to the Triton arm (registry). H200, 2026-11-30 (benchmarks/notes/quant.md): the Mosaic w8a16_gemv beat the
# Triton one (in_proj 27.5 vs 34.7 us, out_proj 14.8 vs 16.6 us at M=1), so it is the GPU default; the Mosaic
# w4a16_gemv lost (63.8 vs 53.4 us), so Triton stays the default there.
registry.register("w8a16_gemv", reference=w8a16_reference, mosaic=w8a16_gemv_mosaic, gpu_default="mosaic",
                  mosaic_supports=lambda x, w, scale, **_: supports("w8a16_gemv", *w.shape, x.dtype))
registry.register("w4a16_gemv", reference=w4a16_reference, mosaic=w4a16_gemv_mosaic,
                  mosaic_supports=lambda x, packed, *_, **__: supports("w4a16_gemv", packed.shape[0],
                                                                        2 * packed.shape[1], x.dtype))
