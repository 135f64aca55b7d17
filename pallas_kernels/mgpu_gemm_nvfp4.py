"""NVFP4 prefill GEMMs on Hopper through Pallas Mosaic GPU: the Mosaic arms of `w4a16_gemm_t` and
`w4a16_gemm_t_m128` (same call, same result as `w4a16_t_reference` up to float32 summation order), and of
`w4a16_gemm` on the plain layout, whose packed [N, K/2] already is the kernel's weight layout (no transpose).

Hopper has no FP4 matrix math and W4A16 keeps bf16 activations, so the matrix work is a bf16 wgmma GEMM and the
e2m1 * E4M3 weights are decoded in registers (the products are exact in bf16). Orientation: out^T = W x^T, so
the decoded weight tile is the wgmma A operand straight from registers (it never touches shared memory) and x
is the B operand in shared memory (transposed view, K-major).

The kernel reads x as it is and the packed bytes in their checkpoint layout (p [N, K/2], low nibble = even k);
per call XLA only relays out the group scales (`prepare_scales`: [N, K/16] E4M3 -> [N, K/8] bf16, per 128-wide K
step the step's 8 group scales as (scale, scale) pairs times 2^118; N K / 4 bytes). The transposed arms (packed_t
[K/2, N]) transpose the weights back per call (`prepare_weights`; a layer can keep the result and call
`w4a16_gemm_t_prepared`).

Kernel: persistent CTAs (snake order over [N/128, M/tile_m] output tiles), a memory warpgroup streaming per 128-wide
K step the x tile [tile_m, 128], the packed tile [128, 64 bytes] and the scale tile [128, 16] through a TMA pipeline;
two compute warpgroups, each owning 64 weight rows and a [64, tile_m] float32 accumulator. Per step a warpgroup
decodes its [64, 128] A operand (inline PTX, "natural K order" below; jnp in interpret mode), issues one wgmma
against x^T and waits for it (the next step's decode rewrites the A registers). Epilogue: global scale, transposed
store to shared memory, TMA to out [M, N] (float32: out^T, transposed by XLA; a transposed 32-bit store does not
lower). Interpret mode (CPU tests) passes the A operand through shared memory (the GPU interpreter's wgmma reads A
from shared memory only).
Shapes: N % 128 == 0, K % 256 == 0 (ShapeError otherwise; `supports` sends others to the Triton arm); M is padded
to tile_m here. Output dtype bf16 / f16 / f32. The decode costs its ALU throughput beside the wgmmas however it is
scheduled, so only fewer decode instructions move it; timings: benchmarks/notes/quant_prefill.md.
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
from pallas_kernels import registry
from pallas_kernels.mgpu_gemm import SMEM_BYTES, _num_sms
from pallas_kernels.mgpu_gemv import _tf
from pallas_kernels.mgpu_gemv_w4 import E2M1_A_SHIFT, _nibble_f32, e2m1x4_to_bf16_asm
from pallas_kernels.w4a16 import (check_nvfp4_args, w4a16_gemm_pallas, w4a16_gemm_t_m128_pallas,
                                  w4a16_gemm_t_pallas, w4a16_reference, w4a16_t_reference)

ROWS = 64            # weight rows (N) per compute warpgroup: the wgmma M
CTA_N = 2 * ROWS     # weight rows per CTA (two compute warpgroups)
STEP_K = 128         # K per pipeline step: 64 packed bytes per weight row
GROUPS = 16          # scale columns per step: the step's 8 groups as (scale, scale) pairs
BF16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Nvfp4Tiles:
    """tile_m: x rows per CTA (the wgmma N, 64..256); stages: TMA pipeline depth; grid order as in mgpu_gemm."""

    tile_m: int = 128
    stages: int = 4
    grid_minor: str = "m"
    grid_tile_width: int = 8


def default_tiles(M: int, N: int, K: int, out_dtype=BF16) -> Nvfp4Tiles:
    """Above 128 rows with a 16-bit output: 256 x rows per CTA, 2 stages, the grid's n index fastest (the fastest
    at the 8B shapes, M = 4096). Else 128 rows and the deepest pipeline (<= 4) that fits shared memory (3 for a
    float32 output)."""
    wide = Nvfp4Tiles(tile_m=256, stages=2, grid_minor="n")
    if M > 128 and jnp.dtype(out_dtype).itemsize == 2 and _smem_bytes(wide, out_dtype) <= SMEM_BYTES:
        return wide
    t = Nvfp4Tiles(tile_m=128, stages=4)
    while t.stages > 2 and _smem_bytes(t, out_dtype) > SMEM_BYTES:
        t = dataclasses.replace(t, stages=t.stages - 1)
    return t


def _smem_bytes(t: Nvfp4Tiles, out_dtype) -> int:
    stage = t.tile_m * STEP_K * 2 + CTA_N * (STEP_K // 2) + CTA_N * GROUPS * 2
    return t.stages * stage + 2 * t.tile_m * ROWS * jnp.dtype(out_dtype).itemsize


# ---- decoding in natural K order (x as it is) ----------------------------------------------------------------
# In the WGMMA A fragment, register j of lane q (of its quad) holds columns 8j + 2q, +1 of a row: in natural K order
# that is packed byte 4j + q, both nibbles in scale group j // 2 (a 128-wide step: 16 registers, 8 groups). A
# WGMMA_UPCAST_4X load gives lane q bytes 32c + 8q .. +8 instead (one 8-byte vector per c), so the quad transposes
# its bytes (per word: two shuffles, two prmt) and decodes each byte into one bf16 pair as the GEMV's decoder
# does, with a scale per byte: value * scale * 2^-8, exact. The scales come ready (`prepare_scales`: per step and
# row the 8 groups' (scale, scale) * 2^118 bf16 pairs) and every lane loads all of its rows' pairs (SCALE_LAYOUT).
# Lane q's word (c, hh) holds bytes 32c + 8q + 4hh + b, b < 4, wanted by lane b (j = 8c + 2q + hh): a 4 x 4 byte
# transpose over the quad for each (c, hh). Step 1 (xor 1) swaps bit 0 of the lane with bit 0 of the byte index,
# step 2 (xor 2) bit 1; the prmt selectors (lane-dependent, `_QUAD_SELECTORS`) pick, per output byte, the own or
# the partner's byte.
_QUAD_SELECTORS = """{
.reg .b32 l, t;
.reg .pred o;
mov.u32 l, %laneid;
and.b32 t, l, 1;
setp.ne.u32 o, t, 0;
selp.b32 $0, 0x3715, 0x6240, o;
and.b32 t, l, 2;
setp.ne.u32 o, t, 0;
selp.b32 $1, 0x3276, 0x5410, o;
}"""
_QUAD_TRANSPOSE = """{
.reg .b32 p, t;
""" + "".join(f"""shfl.sync.bfly.b32 p, ${2 + i}, 1, 0x1f, 0xffffffff;
prmt.b32 t, ${2 + i}, p, $4;
shfl.sync.bfly.b32 p, t, 2, 0x1f, 0xffffffff;
prmt.b32 ${i}, t, p, $5;
""" for i in range(2)) + "}"                # words $2, $3, selectors $4, $5 -> the words' quad transposes $0, $1
# Four packed bytes -> four bf16 pairs, byte k times its own scale pair $(5 + k): the GEMV's perm recipe.
_E2M1X4_TO_BF16_S4 = e2m1x4_to_bf16_asm(("$5", "$6", "$7", "$8"))
SCALE_SHIFT = 2.0 ** 118   # prepared scales are scale * 2^118 (the decoder's bf16 pattern is e2m1 * 2^-126)
# The scale tile [64 rows, 16] bf16 with every lane holding all 16 columns of its rows r, r + 8 (two 16-byte vectors
# per row, the same in the four lanes of a quad): the rows' 8 scale pairs straight from shared memory.
SCALE_LAYOUT = plgpu.Layout.TILED(mgpu_fa.Tiling(((ROWS, GROUPS), (16, GROUPS), (8, GROUPS), (8, 8))),
                                  warp_dims=(-8,), lane_dims=(-2, mgpu_fa.Replicated(4)), vector_dim=-1)


def natural_registers(src, scl, asm, words, as_pair):
    """Register plan of the natural-order decoder, independent of how registers are represented (Mosaic values on
    the GPU, numpy lanes in the CPU test): src = the packed tile's registers (WGMMA_UPCAST_4X, [64, 64] u8), scl =
    the scale tile's (SCALE_LAYOUT, [64, 16] bf16); `words(r)` splits a register into 32-bit words, `asm(template,
    n_out, ins)` runs one PTX block. Returns the A operand's registers (WGMMA, [64, 128] bf16) = dequantized weight
    * 2^-8 in natural K order."""
    out = np.empty((1, 16, 1, 1, 2, 1, 1, 1, 1), dtype=object)
    sel = asm(_QUAD_SELECTORS, 2, [])
    for h in range(2):                                                  # rows r, r + 8 of the lane
        for c in range(2):                                              # K halves: bytes 32c .. 32c + 31
            w = words(src[0, c, 0, 0, h, 0, 0, 0, 0])                   # hh = 0, 1
            t = asm(_QUAD_TRANSPOSE, 2, w + sel)
            sp = words(scl[0, 0, 0, 0, h, 0, 0, c, 0, 0])               # groups 4c .. 4c + 3
            for hh in range(2):
                o = asm(_E2M1X4_TO_BF16_S4, 4, [t[hh], *sp])
                for k in range(4):                                      # byte k came from lane k: j = 8c + 2k + hh
                    out[0, 8 * c + 2 * k + hh, 0, 0, h, 0, 0, 0, 0] = as_pair(o[k])
    return out


def _ptx_e2m1_natural(p, s):
    """Packed bytes [64, 64] (WGMMA_UPCAST_4X) and prepared scales [64, 16] (SCALE_LAYOUT) -> bf16 [64, 128]
    = dequantized weight * 2^-8 in WGMMA layout, natural K order."""
    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA_UPCAST_4X, SCALE_LAYOUT),
                       return_type=plgpu.ShapeDtypeStruct((ROWS, STEP_K), BF16, plgpu.Layout.WGMMA))
    def decode(ctx, fp, fs):
        from jax.experimental.mosaic import gpu as mgpu
        from jax.experimental.mosaic.gpu import utils as mu
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import llvm, vector
        i32 = ir.IntegerType.get_signless(32)
        bf2 = ir.VectorType.get((2,), ir.BF16Type.get())

        def asm(template, n_out, ins):
            ty = ir.Type.parse("!llvm.struct<(" + ", ".join(["i32"] * n_out) + ")>")
            res = llvm.inline_asm(ty, list(ins), template, ",".join(["=r"] * n_out + ["r"] * len(ins)),
                                  convergent="shfl" in template)
            return [llvm.extractvalue(i32, res, [i]) for i in range(n_out)]

        def words(r):
            vt = ir.VectorType(r.type)
            n = vt.shape[0] * mu.bitwidth(vt.element_type) // 32
            ws = mu.bitcast(r, ir.VectorType.get((n,), i32))
            return [vector.extract(ws, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))
                    for i in range(n)]

        regs = natural_registers(fp.registers, fs.registers, asm, words, lambda v: mu.bitcast(v, bf2))
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)
    return decode(p, s)


def _jnp_e2m1_natural(p, s):
    """Interpret-mode twin of `_ptx_e2m1_natural`: p uint8 [64, 64], s bf16 [64, 16] -> bf16 [64, 128], same values."""
    p16 = p.astype(jnp.uint16)
    w = jnp.stack([_nibble_f32(p16, False), _nibble_f32(p16, True)], axis=-1).reshape(ROWS, 8, 16)  # e2m1 * 2^-14
    sc = s[:, 0::2].astype(jnp.float32)                                                              # [64, 8]
    return ((w * sc[:, :, None]) * 2.0 ** -112).reshape(ROWS, STEP_K).astype(BF16)


# ---- kernel --------------------------------------------------------------------------------------------------
def _kernel(x_ref, p_ref, s_ref, g_ref, out_ref, o_smem, a_smem, *, t: Nvfp4Tiles, M: int, N: int, K: int,
            interpret: bool, out_t: bool):
    """x [M, K] bf16, p [N, K/2] u8, s [N, K/8] bf16, g [1] f32 -> out [M, N] (16-bit outputs) or out^T [N, M]
    (out_t: float32)."""
    tm = t.tile_m
    m_iters, n_iters, k_iters = M // tm, N // CTA_N, K // STEP_K
    minor = 0 if t.grid_minor == "m" else 1
    in_specs = [plgpu.BlockSpec((tm, STEP_K), lambda k: (0, k), transforms=_tf(128, 2)),               # x
                plgpu.BlockSpec((CTA_N, STEP_K // 2), lambda k: (0, k), transforms=_tf(STEP_K // 2, 1)),  # packed
                plgpu.BlockSpec((CTA_N, GROUPS), lambda k: (0, k), transforms=_tf(2 * GROUPS, 2))]       # scales

    def make_pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_iters,), memory_registers=40, in_specs=in_specs, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=t.stages, compute_context=context)

    ignore = lambda *_, **__: None
    gmem_args = (x_ref, p_ref, s_ref)

    @functools.partial(pl.run_scoped, allocs=make_pipeline(ignore, ignore).get_allocations(*gmem_args),
                       collective_axes="wg")
    def _scope(allocs):
        wg = lax.axis_index("wg")
        rows = pl.ds(wg * ROWS, ROWS)

        def body(idx, x_s, p_s, s_s, acc_ref):
            if interpret:
                a = _jnp_e2m1_natural(p_s.at[rows][...], s_s.at[rows][...])
            else:
                a = _ptx_e2m1_natural(plgpu.load(p_s.at[rows], layout=plgpu.Layout.WGMMA_UPCAST_4X),
                                      plgpu.load(s_s.at[rows], layout=SCALE_LAYOUT))
            if a_smem is not None:             # interpret mode: A through shared memory
                a_smem[wg] = a
                plgpu.commit_smem()
                a = a_smem.at[wg]
            plgpu.wgmma(acc_ref, a, x_s.transpose((1, 0)))
            plgpu.wgmma_wait(0)                # the next step's decode rewrites the A registers
            return acc_ref

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
        def _tiles(info: plgpu.NDLoopInfo):
            (lin,) = info.index
            mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), minor, t.grid_tile_width)
            m_rows, n_rows = pl.ds(mi * tm, tm), pl.ds(ni * CTA_N, CTA_N)

            def context(run):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((ROWS, tm), jnp.float32))
                def _acc(acc_ref):
                    run(acc_ref)
                    y = (acc_ref[...] * (g_ref[0] * E2M1_A_SHIFT)).astype(out_ref.dtype)   # [64, tm] of out^T
                    w_rows = pl.ds(ni * CTA_N + wg * ROWS, ROWS)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    if out_t:                  # 32-bit: out^T [N, M] (transposed stores do not lower)
                        o_smem.at[wg][...] = y
                    else:
                        o_smem.at[wg].transpose((1, 0))[...] = y
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_smem.at[wg], out_ref.at[w_rows, m_rows] if out_t else
                                            out_ref.at[m_rows, w_rows])

            make_pipeline(body, context)(x_ref.at[m_rows], p_ref.at[n_rows], s_ref.at[n_rows], allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


@functools.partial(jax.jit, static_argnames=("tiles", "out_dtype", "interpret", "name"))
def _call(x, p, s, g, *, tiles: Nvfp4Tiles, out_dtype, interpret: bool, name: str):
    """x [Mp, K] bf16 (Mp a multiple of tile_m), p [N, K/2] u8, s [N, K/8] bf16, g f32 [1] -> [Mp, N]."""
    t = tiles
    Mp, K = x.shape
    N = p.shape[0]
    out_t = jnp.dtype(out_dtype).itemsize == 4
    kernel = functools.partial(_kernel, t=t, M=Mp, N=N, K=K, interpret=bool(interpret), out_t=out_t)
    ncta = (Mp // t.tile_m) * (N // CTA_N)
    f = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((N, Mp) if out_t else (Mp, N), out_dtype),
        scratch_types=dict(
            o_smem=plgpu.SMEM((2, ROWS, t.tile_m) if out_t else (2, t.tile_m, ROWS), out_dtype),
            a_smem=plgpu.SMEM((2, ROWS, STEP_K), BF16, transforms=_tf(128, 2)) if interpret else None),
        grid=(min(_num_sms(interpret), ncta),), grid_names=("sm",), num_threads=3, thread_name="wg",
        interpret=plgpu.InterpretGPUParams() if interpret else None, kernel_name=name)
    y = f(x, p, s, g)
    return y.T if out_t else y


# ---- operand preparation and arms ----------------------------------------------------------------------------
def prepare_scales(scale):
    """scale [N, K/16] E4M3 -> [N, K/8] bf16: per 128-wide K step and row the step's 8 group scales as
    (scale, scale) * 2^118 pairs, the decoder's operands as they are (exact: E4M3 is 2^-9..448)."""
    return jnp.repeat(scale.astype(jnp.float32) * SCALE_SHIFT, 2, axis=1).astype(BF16)


def prepare_weights(packed_t, scale_t):
    """(packed_t [K/2, N] u8, scale_t [K/16, N] E4M3) -> (p [N, K/2] u8, s [N, K/8] bf16): the kernel's weight
    layout (one XLA pass; depends only on the weights, so a layer may keep it)."""
    return packed_t.T, prepare_scales(scale_t.T)


def _check(name: str, N: int, K: int, t: Nvfp4Tiles, out_dtype) -> None:
    if N % CTA_N:
        raise ShapeError(f"{name}(mosaic): N={N} (weight rows) is not a multiple of {CTA_N}; use the Triton arm")
    if K % (2 * STEP_K):
        raise ShapeError(f"{name}(mosaic): K={K} (x columns) is not a multiple of {2 * STEP_K}; use the Triton arm")
    if t.tile_m not in (64, 128, 192, 256):
        raise ShapeError(f"{name}(mosaic): tile_m={t.tile_m} must be one of 64, 128, 192, 256 (the wgmma N)")
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
    xp = jnp.pad(x.astype(BF16), ((0, Mp - M), (0, 0))) if Mp != M else x.astype(BF16)
    y = _call(xp, p, s.astype(BF16), g, tiles=t, out_dtype=out_dtype, interpret=interpret, name=name)
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


# GPU default Mosaic: about twice the Triton arm at the 8B shapes (M = 4096) with the per-call weight transpose
# (the plain layout below skips it; benchmarks/notes/quant_prefill.md).
registry.register("w4a16_gemm_t", reference=w4a16_t_reference, pallas=w4a16_gemm_t_pallas, mosaic=w4a16_gemm_t_mosaic,
                  mosaic_supports=supports, gpu_default="mosaic")
registry.register("w4a16_gemm_t_m128", reference=w4a16_t_reference, pallas=w4a16_gemm_t_m128_pallas,
                  mosaic=w4a16_gemm_t_m128_mosaic, mosaic_supports=supports, gpu_default="mosaic")
# The plain layout on the same kernel, minus the per-call weight transpose (about 9x the Triton w4a16_gemm at the
# 8B in_proj), so on Hopper the model serves NVFP4 prefill from it and builds no transposed copy
# (benchmarks/notes/quant_prefill.md).
registry.register("w4a16_gemm", reference=w4a16_reference, pallas=w4a16_gemm_pallas, mosaic=w4a16_gemm_mosaic,
                  mosaic_supports=supports_plain, gpu_default="mosaic")

