"""NVFP4 prefill GEMMs on Hopper through Pallas Mosaic GPU: the Mosaic arms of `w4a16_gemm_t` and
`w4a16_gemm_t_m128` (same call, same result as `w4a16_t_reference` up to float32 summation order), and of
`w4a16_gemm` on the plain layout, whose packed [N, K/2] already is the kernel's weight layout (no transpose).

Hopper has no FP4 matrix math and W4A16 keeps bf16 activations, so the matrix work is a bf16 wgmma GEMM and the
e2m1 * E4M3 weights are decoded in registers (the products are exact in bf16). Orientation: out^T = W x^T, so
the decoded weight tile is the wgmma A operand straight from registers (it never touches shared memory) and x
is the B operand in shared memory (transposed view, K-major).

Per call, XLA first lays the operands out for the kernel (`split_x`, `prepare_weights`; part of the arm's
time):
  x          [M, K] bf16  -> [2, M, K/2]: even and odd columns (a packed byte holds k = 2j low, 2j + 1 high),
  packed_t   [K/2, N] u8  -> [N, K/2]: weight rows with their bytes contiguous (the A operand's rows),
  scale_t    [K/16, N] E4M3 -> [N, K/8] bf16 (per 128-wide K step: its 8 group scales, 8 zeros).
The weight-side two depend only on the weights: a layer can keep them (`prepare_weights`) and call
`w4a16_gemm_t_prepared` so that only the x split remains per call.

Kernel: persistent CTAs (snake order over [N/128, M/tile_m] output tiles), a memory warpgroup streaming
per 128-wide K step the x even / odd tiles [tile_m, 64], the packed tile [128, 64 bytes] and the scale tile
[128, 16] through a TMA pipeline; two compute warpgroups, each owning 64 weight rows and a [64, tile_m]
float32 accumulator. Per step a warpgroup expands its group scales to the plane's register
layout with a small wgmma (scales [64, 16] x a 0/1 matrix [16, 64]: 8 / tile_m of the main FLOPs),
decodes the low and high nibbles (inline PTX on the GPU, jnp bit operations in interpret mode) and issues two
wgmmas (low nibbles x even columns, high x odd). Epilogue: global scale, transposed store to shared memory,
TMA to out [M, N] (float32: out^T, transposed by XLA; a transposed 32-bit store does not
lower). Interpret mode (CPU tests) passes the A operand through shared memory (the GPU
interpreter's wgmma reads A from shared memory only).
Shapes: N % 128 == 0, K % 256 == 0 (ShapeError otherwise; `supports` sends others to the Triton arm); M is
padded to tile_m here. Output dtype bf16 / f16 / f32. H200 results (GPU default since session 3: 0.67-0.78x XLA
BF16, 1.5-1.8x the Triton arm; the x split is 50 / 95 us of it at the 8B shapes): benchmarks/notes/quant_prefill.md.
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
from pallas_kernels import registry
from pallas_kernels.mgpu_gemm import _num_sms
from pallas_kernels.mgpu_gemv import _ptx_e2m1_to_bf16, _tf
from pallas_kernels.w4a16 import (check_nvfp4_args, w4a16_gemm_pallas, w4a16_gemm_t_m128_pallas,
                                  w4a16_gemm_t_pallas, w4a16_reference, w4a16_t_reference)

ROWS = 64            # weight rows (N) per compute warpgroup: the wgmma M
CTA_N = 2 * ROWS     # weight rows per CTA (two compute warpgroups)
STEP_K = 128         # K per pipeline step: 64 packed bytes per weight row
GROUPS = 16          # scale columns per step: the step's 8 groups + 8 zero columns (the expansion wgmma's K)
SMEM_BYTES = 227 * 1024
BF16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Nvfp4Tiles:
    """tile_m: x rows per CTA (the wgmma N, 64..256); stages: TMA pipeline depth; decode: "ptx" | "jnp"
    (interpret mode always decodes with jnp), or the benchmark's timing probes "skip_decode" / "skip_scales"
    (leave out the nibble decode / the scale expansion: wrong results, GPU only); grid order as in mgpu_gemm."""

    tile_m: int = 128
    stages: int = 4
    grid_minor: str = "m"
    grid_tile_width: int = 8
    decode: str = "ptx"


def default_tiles(M: int, N: int, K: int, out_dtype=BF16) -> Nvfp4Tiles:
    """Above 128 rows with a 16-bit output: 256 x rows per CTA, 2 stages (H200, session 3: 1025 / 501 us at
    the 8B in_proj / out_proj, M=4096, against 1231 / 605 for 128 rows x 4 stages). Else 128 rows and the
    deepest pipeline (<= 4) that fits shared memory (3 for a float32 output)."""
    wide = Nvfp4Tiles(tile_m=256, stages=2)
    if M > 128 and jnp.dtype(out_dtype).itemsize == 2 and _smem_bytes(wide, out_dtype) <= SMEM_BYTES:
        return wide
    t = Nvfp4Tiles(tile_m=128, stages=4)
    while t.stages > 2 and _smem_bytes(t, out_dtype) > SMEM_BYTES:
        t = dataclasses.replace(t, stages=t.stages - 1)
    return t


def _smem_bytes(t: Nvfp4Tiles, out_dtype) -> int:
    stage = 2 * t.tile_m * (STEP_K // 2) * 2 + CTA_N * (STEP_K // 2) + CTA_N * GROUPS * 2
    fixed = 2 * t.tile_m * ROWS * jnp.dtype(out_dtype).itemsize + 2 * GROUPS * ROWS * 2
    return t.stages * stage + fixed


def expander(value: float) -> np.ndarray:
    """[16, 64] 0/value matrix mapping the step's scale group j // 8 to plane column j (rows 8..15 zero: the
    padding of the step's scale tile). value = 2^14 for the jnp decoder (which yields e2m1 * 2^-14), 1 for PTX."""
    e = np.zeros((GROUPS, ROWS), np.float32)
    e[np.arange(ROWS) // 8, np.arange(ROWS)] = value
    return e


# ---- nibble decoding -----------------------------------------------------------------------------------------
def _nibble_f32(p16, high: bool):
    """uint16 tile of packed bytes -> f32 e2m1 value * 2^-14 of the low or high nibble (exact): the code's sign
    goes to bit 15 and its 3 magnitude bits to bits 11:9 of an f16."""
    n = p16 >> 4 if high else p16
    bits = ((n & 8) << 12) | ((n & 7) << 9)
    return lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _decode(p, sexp, how: str):
    """p uint8 [64, 64], sexp f32 [64, 64] (expanded scales; x 2^14 for jnp) -> (lo, hi) bf16 [64, 64]."""
    if how == "ptx":
        return _ptx_e2m1_to_bf16(p, sexp.astype(BF16))     # the GEMV's exact decoder (mgpu_gemv.py)
    p16 = p.astype(jnp.uint16)
    return (_nibble_f32(p16, False) * sexp).astype(BF16), (_nibble_f32(p16, True) * sexp).astype(BF16)


# ---- kernel --------------------------------------------------------------------------------------------------
def _kernel(x2_ref, p_ref, s_ref, g_ref, e_ref, out_ref, o_smem, e_smem, e_bar, a_smem, *, t: Nvfp4Tiles,
            M: int, N: int, K: int, decode: str, out_t: bool):
    """x2 [2, M, K/2] bf16, p [N, K/2] u8, s [N, K/8] bf16, g [1] f32, e [16, 64] bf16 -> out [M, N] (16-bit
    outputs) or out^T [N, M] (out_t: float32)."""
    tm = t.tile_m
    m_iters, n_iters, k_iters = M // tm, N // CTA_N, K // STEP_K
    minor = 0 if t.grid_minor == "m" else 1
    half = STEP_K // 2
    # three specs: the GPU interpreter deadlocked with four (x even and odd as separate specs)
    in_specs = [plgpu.BlockSpec((2, tm, half), lambda k: (0, 0, k), transforms=_tf(2 * half, 2)),  # x even, odd
                plgpu.BlockSpec((CTA_N, half), lambda k: (0, k), transforms=_tf(half, 1)),         # packed
                plgpu.BlockSpec((CTA_N, GROUPS), lambda k: (0, k), transforms=_tf(2 * GROUPS, 2))]  # scales

    def make_pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_iters,), memory_registers=40, in_specs=in_specs, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=t.stages, compute_context=context)

    ignore = lambda *_, **__: None
    gmem_args = (x2_ref, p_ref, s_ref)

    @functools.partial(pl.run_scoped, allocs=make_pipeline(ignore, ignore).get_allocations(*gmem_args),
                       collective_axes="wg")
    def _scope(allocs):
        wg = lax.axis_index("wg")
        rows = pl.ds(wg * ROWS, ROWS)

        def mma(acc_ref, a, b_ref, slot):
            if a_smem is not None:           # interpret mode: A through shared memory
                a_smem[wg, slot] = a
                plgpu.commit_smem()
                a = a_smem.at[wg, slot]
            plgpu.wgmma(acc_ref, a, b_ref)

        def body(idx, x_s, p_s, s_s, acc_ref):
            def expand(sacc):
                plgpu.wgmma(sacc, s_s.at[rows], e_smem.at[wg])
                return sacc[...]

            if decode == "skip_scales":        # timing probe: no scale expansion (wrong results)
                sexp = plgpu.layout_cast(jnp.full((ROWS, ROWS), 1.0, jnp.float32), plgpu.Layout.WGMMA)
            else:
                sexp = pl.run_scoped(expand, plgpu.ACC((ROWS, ROWS), jnp.float32))  # [64, 64] scale per element
            if decode == "skip_decode":        # timing probe: no packed-byte load or nibble decode (wrong results)
                lo = hi = sexp.astype(BF16)
            else:
                p = plgpu.load(p_s.at[rows], layout=plgpu.Layout.WGMMA)        # [64, 64] packed bytes
                lo, hi = _decode(p, sexp, "ptx" if decode == "skip_scales" else decode)
            mma(acc_ref, lo, x_s.at[0].transpose((1, 0)), 0)
            mma(acc_ref, hi, x_s.at[1].transpose((1, 0)), 1)
            plgpu.wgmma_wait(0)
            return acc_ref

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
        def _tiles(info: plgpu.NDLoopInfo):
            (lin,) = info.index
            mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), minor, t.grid_tile_width)
            m_rows, n_rows = pl.ds(mi * tm, tm), pl.ds(ni * CTA_N, CTA_N)

            def context(run):
                # the expansion matrix (4 KB) per tile: a compute-warpgroup-only place to load it
                plgpu.copy_gmem_to_smem(e_ref, e_smem.at[wg], e_bar.at[wg])
                plgpu.barrier_wait(e_bar.at[wg])

                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((ROWS, tm), jnp.float32))
                def _acc(acc_ref):
                    run(acc_ref)
                    y = (acc_ref[...] * g_ref[0]).astype(out_ref.dtype)              # [64, tm] of out^T
                    w_rows = pl.ds(ni * CTA_N + wg * ROWS, ROWS)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    if out_t:                  # 32-bit: out^T [N, M] (transposed stores do not lower)
                        o_smem.at[wg][...] = y
                    else:
                        o_smem.at[wg].transpose((1, 0))[...] = y
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_smem.at[wg], out_ref.at[w_rows, m_rows] if out_t else
                                            out_ref.at[m_rows, w_rows])

            make_pipeline(body, context)(x2_ref.at[:, m_rows], p_ref.at[n_rows], s_ref.at[n_rows],
                                         allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("tiles", "out_dtype", "interpret", "name"))
def _call(x2, p, s, g, *, tiles: Nvfp4Tiles, out_dtype, interpret: bool, name: str):
    """x2 [2, Mp, K/2] bf16 (Mp a multiple of tile_m), p [N, K/2] u8, s [N, K/8] bf16, g f32 [1] -> [Mp, N]."""
    _, Mp, half_k = x2.shape
    K, N = 2 * half_k, p.shape[0]
    t = tiles
    decode = "jnp" if interpret else t.decode
    e = jnp.asarray(expander(16384.0 if decode == "jnp" else 1.0), BF16)
    out_t = jnp.dtype(out_dtype).itemsize == 4
    kernel = functools.partial(_kernel, t=t, M=Mp, N=N, K=K, decode=decode, out_t=out_t)
    ncta = (Mp // t.tile_m) * (N // CTA_N)
    f = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((N, Mp) if out_t else (Mp, N), out_dtype),
        scratch_types=dict(
            o_smem=plgpu.SMEM((2, ROWS, t.tile_m) if out_t else (2, t.tile_m, ROWS), out_dtype),
            e_smem=plgpu.SMEM((2, GROUPS, ROWS), BF16, transforms=_tf(2 * GROUPS, 2)),   # A and B: one swizzle
            e_bar=plgpu.Barrier(num_barriers=2),
            a_smem=plgpu.SMEM((2, 2, ROWS, ROWS), BF16, transforms=_tf(2 * ROWS, 2)) if interpret else None),
        grid=(min(_num_sms(interpret), ncta),), grid_names=("sm",), num_threads=3, thread_name="wg",
        interpret=plgpu.InterpretGPUParams() if interpret else None, kernel_name=name)
    y = f(x2, p, s, g, e)
    return y.T if out_t else y


# ---- operand preparation and arms ----------------------------------------------------------------------------
def prepare_scales(scale):
    """scale [N, K/16] E4M3 -> [N, K/8] bf16: per 128-wide K step the step's 8 group scales and 8 zeros (the
    expansion wgmma needs K = 16; the pipeline loads one tile per step: a tile shared by two steps is not
    re-sent by the TMA pipeline and deadlocks it)."""
    N, G = scale.shape
    s = scale.astype(BF16).reshape(N, G // 8, 8)
    return jnp.pad(s, ((0, 0), (0, 0), (0, 8))).reshape(N, 2 * G)


def prepare_weights(packed_t, scale_t):
    """(packed_t [K/2, N] u8, scale_t [K/16, N] E4M3) -> (p [N, K/2] u8, s [N, K/8] bf16): the kernel's weight
    layout (one XLA pass; depends only on the weights, so a layer may keep it)."""
    return packed_t.T, prepare_scales(scale_t.T)


def split_x(x, rows: int):
    """x [M, K] -> [2, rows, K/2]: even and odd columns (rows >= M zero-padded). Each column pair is read as one
    uint32 (element 2j in the low half, XLA's little-endian bitcast) and its halves written out as integers, so every
    bf16 value (subnormals, signed zeros, quiet NaNs) moves unchanged: XLA:CPU flushed subnormals when it split the
    bf16 columns by strided slices.
    Both forms take ~50 / 93 us at the 8B in_proj / out_proj on the H200 (s10-4)."""
    m, k = x.shape
    u = lax.bitcast_convert_type(x.astype(BF16).reshape(m, k // 2, 2), jnp.uint32)             # [M, K/2]
    x2 = lax.bitcast_convert_type(jnp.stack([u & 0xFFFF, u >> 16]).astype(jnp.uint16), BF16)  # [2, M, K/2]
    return x2 if rows == m else jnp.pad(x2, ((0, 0), (0, rows - m), (0, 0)))


def _check(name: str, N: int, K: int, t: Nvfp4Tiles, out_dtype) -> None:
    if N % CTA_N:
        raise ShapeError(f"{name}(mosaic): N={N} (weight rows) is not a multiple of {CTA_N}; use the Triton arm")
    if K % (2 * STEP_K):
        raise ShapeError(f"{name}(mosaic): K={K} (x columns) is not a multiple of {2 * STEP_K}; use the Triton arm")
    if t.tile_m not in (64, 128, 192, 256):
        raise ShapeError(f"{name}(mosaic): tile_m={t.tile_m} must be one of 64, 128, 192, 256 (the wgmma N)")
    if t.decode not in ("ptx", "jnp", "skip_decode", "skip_scales"):
        raise ShapeError(f"{name}(mosaic): decode={t.decode!r} must be 'ptx', 'jnp' or a timing probe")
    if jnp.dtype(out_dtype) not in (jnp.dtype(BF16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        raise ShapeError(f"{name}(mosaic): out_dtype {jnp.dtype(out_dtype).name} is not bfloat16, float16 or float32")
    if _smem_bytes(t, out_dtype) > SMEM_BYTES:
        raise ShapeError(f"{name}(mosaic): tiles {t} need {_smem_bytes(t, out_dtype)} bytes of shared memory "
                         f"(> {SMEM_BYTES}); lower stages")


def w4a16_gemm_t_prepared(x, p, s, global_scale, *, out_dtype=None, interpret: bool = False,
                          tiles: Nvfp4Tiles | None = None, name: str = "w4a16_gemm_t"):
    """The Mosaic GEMM on weights already in the kernel layout (`prepare_weights`): x [M, K] bf16."""
    M, K = x.shape
    N = p.shape[0]
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    t = tiles or default_tiles(M, N, K, out_dtype)
    _check(name, N, K, t, out_dtype)
    if p.shape != (N, K // 2) or s.shape != (N, K // 8):
        raise ShapeError(f"{name}(mosaic): prepared weights expected p [N, {K // 2}], s [N, {K // 8}], "
                         f"got {list(p.shape)}, {list(s.shape)}")
    Mp = pl.cdiv(M, t.tile_m) * t.tile_m
    g = jnp.asarray(global_scale, jnp.float32).reshape(1)
    y = _call(split_x(x, Mp), p, s.astype(BF16), g, tiles=t, out_dtype=out_dtype, interpret=interpret, name=name)
    return y[:M] if Mp != M else y


def w4a16_gemm_t_mosaic(x, packed_t, scale_t, global_scale, *, out_dtype=None, interpret: bool = False,
                        tiles: Nvfp4Tiles | None = None, name: str = "w4a16_gemm_t"):
    """Mosaic arm of w4a16_gemm_t / w4a16_gemm_t_m128: same call and result as `w4a16_t_reference`
    (x [M, K], packed_t uint8 [K/2, N], scale_t E4M3 [K/16, N], global f32); the weight relayout is included."""
    check_nvfp4_args(name, x, packed_t, scale_t, global_scale, transposed=True)
    p, s = prepare_weights(packed_t, scale_t)
    return w4a16_gemm_t_prepared(x, p, s, global_scale, out_dtype=out_dtype, interpret=interpret, tiles=tiles,
                                 name=name)


def w4a16_gemm_t_m128_mosaic(x, packed_t, scale_t, global_scale, **kw):
    return w4a16_gemm_t_mosaic(x, packed_t, scale_t, global_scale, name="w4a16_gemm_t_m128", **kw)


def w4a16_gemm_mosaic(x, packed, scale, global_scale, *, out_dtype=None, interpret: bool = False,
                      tiles: Nvfp4Tiles | None = None, name: str = "w4a16_gemm"):
    """Mosaic arm of w4a16_gemm (plain layout): same call and result as `w4a16_reference` (x [M, K], packed
    uint8 [N, K/2], scale E4M3 [N, K/16], global f32). The packed bytes go in as they are; only the scales are
    relaid out (`prepare_scales`, N K / 16 bytes)."""
    check_nvfp4_args(name, x, packed, scale, global_scale, transposed=False)
    return w4a16_gemm_t_prepared(x, packed, prepare_scales(scale), global_scale, out_dtype=out_dtype,
                                 interpret=interpret, tiles=tiles, name=name)


def supports_shape(N: int, K: int, x_dtype, out_dtype) -> bool:
    """Calls the Mosaic GEMM takes: N % 128 == 0, K % 256 == 0, bf16 x (the kernel's B operand; it would round
    any other x to bf16), a bf16/f16/f32 output."""
    od = jnp.dtype(out_dtype)
    return (N % CTA_N == 0 and K % (2 * STEP_K) == 0 and jnp.dtype(x_dtype) == jnp.dtype(BF16)
            and od in (jnp.dtype(BF16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)))


def supports(x, packed_t, scale_t, global_scale, *, out_dtype=None, **_) -> bool:
    """The transposed arms' calls the Mosaic GEMM takes (`supports_shape`)."""
    return supports_shape(packed_t.shape[1], 2 * packed_t.shape[0], x.dtype, out_dtype or x.dtype)


def supports_plain(x, packed, scale, global_scale, *, out_dtype=None, **_) -> bool:
    """The plain-layout (w4a16_gemm) calls the Mosaic GEMM takes (`supports_shape`)."""
    return supports_shape(packed.shape[0], 2 * packed.shape[1], x.dtype, out_dtype or x.dtype)


# GPU default Mosaic: 0.63-0.76x XLA BF16 at the 8B shapes (M=4096) against the Triton arm's 0.42x, correct on
# the H200 (benchmarks/notes/quant_prefill.md, session 3); still short of the 1x.
registry.register("w4a16_gemm_t", reference=w4a16_t_reference, pallas=w4a16_gemm_t_pallas, mosaic=w4a16_gemm_t_mosaic,
                  mosaic_supports=supports, gpu_default="mosaic")
registry.register("w4a16_gemm_t_m128", reference=w4a16_t_reference, pallas=w4a16_gemm_t_m128_pallas,
                  mosaic=w4a16_gemm_t_m128_mosaic, mosaic_supports=supports, gpu_default="mosaic")
# The plain layout on the same kernel, minus the per-call weight transpose: H200 s10-1, 998 / 533 us at the 8B
# in_proj / out_proj against the transposed arm's 1029 / 534 (the Triton w4a16_gemm: 8276 us at in_proj), so on
# Hopper the model serves NVFP4 prefill from it and builds no transposed copy (benchmarks/notes/quant_prefill.md).
registry.register("w4a16_gemm", reference=w4a16_reference, pallas=w4a16_gemm_pallas, mosaic=w4a16_gemm_mosaic,
                  mosaic_supports=supports_plain, gpu_default="mosaic")

