"""W4A16 projections: bf16 activations x NVFP4 weights, dequantized in the kernel (Hopper has no FP4 math).

NVFP4: E2M1 codes packed two per byte along K (low nibble = even k), E4M3 scale per 16 along K, f32
global scale.  y = global * (x @ (e2m1 * scale)^T); each e2m1 * scale product is exact in bf16, so the
matrix units see the exact weights and only the float32 accumulation order differs from the reference.

No interleaving is ever built: a packed byte holds k = 2j (low) and 2j + 1 (high), so
    x @ w^T = x[:, 0::2] @ lo^T + x[:, 1::2] @ hi^T
with lo / hi the decoded nibbles and the activation tile split into even and odd columns in registers.

Kernels (registry names):
  w4a16_gemv          decode; weights [N, K/2], rows tiled by 16, split-K to fill the GPU.
  w4a16_gemm          prefill, plain layout [N, K/2].
  w4a16_gemm_t        prefill, transposed layout [K/2, N] (Nvfp4WeightT): weight and scale rows
                      along N are contiguous, scales broadcast over leading dimensions only.
  w4a16_gemm_t_m128   the same with 128-row tiles, for prefills above 128 tokens.
Nibbles are decoded either with plain jnp bit operations (`decode="arith"`, also the interpret
mode's) or with a PTX sequence through elementwise_inline_asm (`decode="asm"`, GPU only).
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
from pallas_kernels.formats import NVFP4_GROUP, dequantize_nvfp4
from pallas_kernels import registry
from pallas_kernels.split_partials import SplitPartials, check_unreduced, of_output
from pallas_kernels.triton_util import compiler_params, dot, dot_dtype
from pallas_kernels.w8a16 import (GEMV_SWAP, QuantBlocks, check_activations, check_array, finish_split, fit_blocks,
                                  gemv_split_k, grid_ids, matmul_f32, row_tile, store_tile)


# ---- references ----------------------------------------------------------------------------------------
def w4a16_reference(x, packed, scale, global_scale, *, out_dtype=None, epilogue: str | None = None,
                    unreduced: bool = False):
    """Dequantize then matmul, then the epilogue (`epilogues`) on the float32 result.  x [M, K], packed uint8
    [N, K/2], scale E4M3 [N, K/16], global f32 []; unreduced: the float32 result as one SplitPartials."""
    check_nvfp4_args("w4a16", x, packed, scale, global_scale, transposed=False)
    epilogues.check("w4a16", epilogue)
    check_unreduced("w4a16", unreduced, epilogue, out_dtype)
    y = matmul_f32(x, dequantize_nvfp4(packed, scale, global_scale))
    return of_output(y) if unreduced else epilogues.apply(y, epilogue).astype(out_dtype or x.dtype)


def w4a16_t_reference(x, packed_t, scale_t, global_scale, *, out_dtype=None):
    """Transposed layout: packed_t uint8 [K/2, N], scale_t E4M3 [K/16, N]."""
    check_nvfp4_args("w4a16_t", x, packed_t, scale_t, global_scale, transposed=True)
    return matmul_f32(x, dequantize_nvfp4(packed_t.T, scale_t.T, global_scale)).astype(out_dtype or x.dtype)


def check_nvfp4_args(kernel, x, packed, scale, global_scale, *, transposed: bool):
    if packed.ndim != 2 or jnp.dtype(packed.dtype) != jnp.dtype(jnp.uint8):
        raise ShapeError(f"{kernel}: packed weight expected uint8 2-D, got {jnp.dtype(packed.dtype).name}"
                         f"{list(packed.shape)}")
    half, N = packed.shape if transposed else packed.shape[::-1]
    K = 2 * half
    check_activations(kernel, x, K)
    if K % NVFP4_GROUP:
        raise ShapeError(f"{kernel}: K = {K} is not a multiple of {NVFP4_GROUP}")
    g = K // NVFP4_GROUP
    check_array(kernel, "scale", scale, jnp.float8_e4m3fn, (g, N) if transposed else (N, g))
    check_array(kernel, "global_scale", jnp.asarray(global_scale).reshape(()), jnp.float32, ())


# ---- nibble decoding inside the kernel -------------------------------------------------------------------
def _nibbles_arith(p, s):
    """p uint8 tile, s f32 scale tile of the same shape -> (lo, hi) exact e2m1 * s values (f32).

    The code's bits as an f16 pattern are value * 2^-14 (code 1 is the f16 subnormal 2^-15)."""
    c = p.astype(jnp.int32)

    def one(n):
        bits = ((n & 8) << 12) | ((n & 7) << 9)
        return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16).astype(jnp.float32)

    s = s * 16384.0
    return one(c & 15) * s, one(c >> 4) * s


# Four packed bytes ($2) and their four bf16 scales ($3, $4) in; one nibble of each byte (the low one, or
# the high one after `shr 4`) as two bf16 pairs out ($0: bytes 0-1, $1: bytes 2-3). A nibble's sign bit
# goes to bit 15 of its 16-bit lane and its 3 magnitude bits to bits 8:6: as bf16 that is value * 2^-126
# (code 1 the subnormal 2^-127), so one bf16x2 multiply by 2^126 restores the value and a second one by
# the group scale applies it; both products are exact.
_NIBBLE_ASM = """
{{
.reg .b32 u0, u1, a, b, k, z, n;
mov.b32 k, 0x7E807E80;
mov.b32 z, 0x80008000;
mov.b32 n, 0;
prmt.b32 u0, $2, n, 0x4140;
prmt.b32 u1, $2, n, 0x4342;
{shift}
shl.b32 a, u0, 12; and.b32 a, a, 0x80008000; shl.b32 b, u0, 6; and.b32 b, b, 0x01C001C0; or.b32 a, a, b;
fma.rn.bf16x2 a, a, k, z; fma.rn.bf16x2 $0, a, $3, z;
shl.b32 a, u1, 12; and.b32 a, a, 0x80008000; shl.b32 b, u1, 6; and.b32 b, b, 0x01C001C0; or.b32 a, a, b;
fma.rn.bf16x2 a, a, k, z; fma.rn.bf16x2 $1, a, $4, z;
}}
"""
_ASM_LO = _NIBBLE_ASM.format(shift="")
_ASM_HI = _NIBBLE_ASM.format(shift="shr.b32 u0, u0, 4;\nshr.b32 u1, u1, 4;")


def _nibbles_asm(p, s):
    """Same values as `_nibbles_arith` through PTX, bf16 out (GPU only)."""
    out = [jax.ShapeDtypeStruct(p.shape, jnp.bfloat16)]
    sb = s.astype(jnp.bfloat16)
    run = lambda asm: plgpu.elementwise_inline_asm(asm, args=[p, sb], constraints="=r,=r,r,r,r", pack=4,
                                                   result_shape_dtypes=out)[0]
    return run(_ASM_LO), run(_ASM_HI)


# ---- Pallas kernel -------------------------------------------------------------------------------------
def split_even_odd(x):
    """[m, 2h] -> ([m, h] even columns, [m, h] odd columns) by a register split (Triton's tt.split)."""
    m, k = x.shape
    even, odd = jax.lax.split(x.reshape(m, k // 2, 2), (1, 1), axis=2)
    return even.reshape(m, k // 2), odd.reshape(m, k // 2)


@dataclasses.dataclass(frozen=True)
class W4Blocks(QuantBlocks):
    decode: str = "arith"     # "arith" | "asm"


def _w4_kernel(*refs, M, N, K, bm, bn, bk, k_split, num_m, cdt, transposed, decode, swap, grouped):
    """Packed weights arrive as 3-D tiles [bn, groups, 8 bytes] (or [groups, 8, bn] transposed), so a
    group's scale broadcasts over its 8 bytes without any reshape of the scales. grouped (plain layout
    only): a tiles_ref comes first and the weights carry a leading expert axis (w8a16.row_tile)."""
    tiles_ref, (x_ref, p_ref, s_ref, g_ref, o_ref) = (refs[0], refs[1:]) if grouped else (None, refs)
    pid_n, pid_m = grid_ids(num_m)
    split = pl.program_id(1)
    n0 = pid_n * bn
    m0, m_mask, ex = row_tile(tiles_ref, pid_m, bm, M)
    hb, gb, G = bk // 2, bk // NVFP4_GROUP, K // NVFP4_GROUP       # bytes, groups per step; groups in K
    n_mask = (n0 + jnp.arange(bn)) < N
    k_first = split * k_split
    ragged_k = K % bk != 0
    nibbles = _nibbles_asm if decode == "asm" else _nibbles_arith

    def body(i, acc):
        k0 = k_first + i * bk
        g0 = k0 // NVFP4_GROUP
        gm = (g0 + jnp.arange(gb)) < G if ragged_k else None
        xm = m_mask[:, None] if not ragged_k else m_mask[:, None] & ((k0 + jnp.arange(bk)) < K)[None, :]
        x = plgpu.load(x_ref.at[pl.ds(m0, bm), pl.ds(k0, bk)], mask=xm, other=0.0).astype(cdt)
        xe, xo = split_even_odd(x)
        if transposed:                                                   # p_ref [G, 8, N], s_ref [G, N]
            sm = n_mask[None, :] if gm is None else gm[:, None] & n_mask[None, :]
            p = plgpu.load(p_ref.at[pl.ds(g0, gb), :, pl.ds(n0, bn)], mask=sm[:, None, :], other=0)
            s = plgpu.load(s_ref.at[pl.ds(g0, gb), pl.ds(n0, bn)], mask=sm, other=0.0).astype(jnp.float32)
            lo, hi = nibbles(p, jnp.broadcast_to(s[:, None, :], p.shape))
            lo, hi = lo.reshape(hb, bn).astype(cdt), hi.reshape(hb, bn).astype(cdt)
            return acc + dot(xe, lo) + dot(xo, hi)
        sm = n_mask[:, None] if gm is None else n_mask[:, None] & gm[None, :]   # p_ref [N, G, 8], s_ref [N, G]
        p = plgpu.load(p_ref.at[(*ex, pl.ds(n0, bn), pl.ds(g0, gb), slice(None))], mask=sm[:, :, None], other=0)
        s = plgpu.load(s_ref.at[(*ex, pl.ds(n0, bn), pl.ds(g0, gb))], mask=sm, other=0.0).astype(jnp.float32)
        lo, hi = nibbles(p, jnp.broadcast_to(s[:, :, None], p.shape))
        lo, hi = lo.reshape(bn, hb).astype(cdt), hi.reshape(bn, hb).astype(cdt)
        if swap:
            return acc + dot(lo, xe, trans_b=True) + dot(hi, xo, trans_b=True)
        return acc + dot(xe, lo, trans_b=True) + dot(xo, hi, trans_b=True)

    swap = swap and not transposed
    acc = jax.lax.fori_loop(0, k_split // bk, body, jnp.zeros((bn, bm) if swap else (bm, bn), jnp.float32))
    store_tile(o_ref, split, acc * g_ref[ex[0] if grouped else 0], m0, n0, m_mask, n_mask, swap)


@functools.partial(jax.jit, static_argnames=("out_dtype", "blocks", "interpret", "transposed", "name", "unreduced"))
def _w4_call(x, packed, scale, global_scale, tiles=None, *, out_dtype, blocks: W4Blocks, interpret: bool,
             transposed: bool, name: str, unreduced: bool = False):
    """tiles: None, or the grouped form's row tiles [3, tiles] (packed [E, N, K/2], scale [E, N, K/16],
    global_scale [E]; plain layout)."""
    M, K = x.shape
    N = packed.shape[-1] if transposed else packed.shape[-2]
    G = K // NVFP4_GROUP
    bm, bn, bk, split = blocks.block_m, blocks.block_n, blocks.block_k, blocks.split_k
    if bk < 32 or bk % NVFP4_GROUP:
        raise ShapeError(f"{name}: block_k={bk} must be >= 32 (16 bytes per matrix-unit step)")
    if pl.cdiv(K, bk) % split:
        raise ShapeError(f"{name}: split_k={split} does not divide the {pl.cdiv(K, bk)} K steps of {bk}")
    decode = "arith" if interpret else blocks.decode
    num_m, num_n = pl.cdiv(M, bm) if tiles is None else tiles.shape[1], pl.cdiv(N, bn)
    k_split = pl.cdiv(K, bk) // split * bk
    out_t = jnp.float32 if split > 1 else out_dtype
    lead = packed.shape[:-2]                                                     # (E,) when grouped
    p3 = packed.reshape(*lead, G, 8, N) if transposed else packed.reshape(*lead, N, G, 8)   # a view of the bytes
    kernel = functools.partial(_w4_kernel, M=M, N=N, K=K, bm=bm, bn=bn, bk=bk, k_split=k_split, num_m=num_m,
                               cdt=dot_dtype(x.dtype), transposed=transposed, decode=decode, swap=blocks.swap,
                               grouped=tiles is not None)
    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((split, M, N), out_t), grid=(num_m * num_n, split),
        compiler_params=compiler_params(blocks.num_warps, blocks.num_stages), interpret=interpret, name=name,
    )(*(() if tiles is None else (tiles,)), x, p3, scale, jnp.asarray(global_scale, jnp.float32).reshape(-1))
    return SplitPartials(out) if unreduced else finish_split(out, M, out_dtype)


# Defaults from the H200 sweeps (benchmarks/notes/quant.md): the PTX nibble decoder on the GPU
# (interpret mode always uses the arithmetic one), weight tile as the B operand for the GEMV, 128x128x64
# tiles with 8 warps for the large prefill GEMMs.
DEFAULT_DECODE = "asm"


def w4a16_gemv_blocks(N: int, K: int) -> W4Blocks:
    bn, bk = 64, 128
    split = gemv_split_k(pl.cdiv(N, bn), pl.cdiv(K, bk))
    return W4Blocks(block_m=16, block_n=bn, block_k=bk, split_k=split, num_warps=4, num_stages=4,
                    decode=DEFAULT_DECODE, swap=GEMV_SWAP)


def w4a16_gemm_blocks(N: int, K: int, block_m: int = 64) -> W4Blocks:
    """block_m=64: w4a16_gemm_t (<= 128 tokens); block_m=128: w4a16_gemm_t_m128 and the plain w4a16_gemm."""
    if block_m <= 64:
        return W4Blocks(block_m=64, block_n=128, block_k=128, split_k=1, num_warps=4, num_stages=3,
                        decode=DEFAULT_DECODE)
    return W4Blocks(block_m=128, block_n=128, block_k=64, split_k=1, num_warps=8, num_stages=3,
                    decode=DEFAULT_DECODE)


def _run(name, x, packed, scale, global_scale, blocks, out_dtype, interpret, transposed, unreduced=False):
    check_nvfp4_args(name, x, packed, scale, global_scale, transposed=transposed)
    blk = fit_blocks(blocks, x.shape[0], x.shape[1], k_unit=2)
    return _w4_call(x, packed, scale, global_scale, out_dtype=jnp.dtype(out_dtype or x.dtype), blocks=blk,
                    interpret=interpret, transposed=transposed, name=name, unreduced=unreduced)


def w4a16_gemv_pallas(x, packed, scale, global_scale, *, out_dtype=None, epilogue: str | None = None,
                      interpret=False, blocks=None, unreduced: bool = False):
    """Decode GEMV; same call and result as `w4a16_reference` (the epilogue by XLA on the float32 output;
    unreduced: the split partials)."""
    epilogues.check("w4a16_gemv", epilogue)
    check_unreduced("w4a16_gemv", unreduced, epilogue, out_dtype)
    N, K = packed.shape[0], 2 * packed.shape[1]
    out_dtype = jnp.dtype(jnp.float32 if unreduced else out_dtype or x.dtype)
    y = _run("w4a16_gemv", x, packed, scale, global_scale, blocks or w4a16_gemv_blocks(N, K),
             jnp.float32 if epilogue else out_dtype, interpret, False, unreduced)
    return y if unreduced else epilogues.apply(y, epilogue).astype(out_dtype)


def w4a16_gemm_pallas(x, packed, scale, global_scale, *, out_dtype=None, interpret=False, blocks=None):
    """Prefill GEMM on the plain layout; same call and result as `w4a16_reference`."""
    N, K = packed.shape[0], 2 * packed.shape[1]
    blk = blocks or dataclasses.replace(w4a16_gemm_blocks(N, K, block_m=128), swap=True)
    return _run("w4a16_gemm", x, packed, scale, global_scale, blk, out_dtype, interpret, False)


def _run_t(name, x, packed_t, scale_t, global_scale, blocks, out_dtype, interpret, **block_kw):
    """The transposed-layout GEMM; without `blocks`, w4a16_gemm_blocks(N, K, **block_kw)."""
    N, K = packed_t.shape[1], 2 * packed_t.shape[0]
    return _run(name, x, packed_t, scale_t, global_scale, blocks or w4a16_gemm_blocks(N, K, **block_kw), out_dtype,
                interpret, True)


def w4a16_gemm_t_pallas(x, packed_t, scale_t, global_scale, *, out_dtype=None, interpret=False, blocks=None):
    """Prefill GEMM on the transposed layout; same call and result as `w4a16_t_reference`."""
    return _run_t("w4a16_gemm_t", x, packed_t, scale_t, global_scale, blocks, out_dtype, interpret)


def w4a16_gemm_t_m128_pallas(x, packed_t, scale_t, global_scale, *, out_dtype=None, interpret=False, blocks=None):
    """The transposed GEMM with 128-row tiles (prefills above 128 tokens)."""
    return _run_t("w4a16_gemm_t_m128", x, packed_t, scale_t, global_scale, blocks, out_dtype, interpret, block_m=128)


registry.register("w4a16_gemv", reference=w4a16_reference, pallas=w4a16_gemv_pallas)
registry.register("w4a16_gemm", reference=w4a16_reference, pallas=w4a16_gemm_pallas)
registry.register("w4a16_gemm_t", reference=w4a16_t_reference, pallas=w4a16_gemm_t_pallas)
registry.register("w4a16_gemm_t_m128", reference=w4a16_t_reference, pallas=w4a16_gemm_t_m128_pallas)
for _name in ("w4a16_gemv", "w4a16_gemm", "w4a16_gemm_t", "w4a16_gemm_t_m128"):   # gradients to the activations only
    registry.register(_name, grad_wrt=registry.ACTIVATIONS)
