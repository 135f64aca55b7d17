"""Prefill GEMMs on Hopper's FP8 matrix units through Pallas Mosaic GPU (TMA + wgmma, warp-specialized).

Mosaic arms of existing registry names (same call, same result as the Triton arm and the reference):
  fp8_gemm_t            E4M3 activations with one scale per row x the pre-dequantized E4M3 copy [N, K]
                        with one scale per row; the matrix units accumulate all of K and both scales are
                        applied once in the epilogue.
  w8a16_gemm_pipelined  activations quantized per row per 128 columns x block-scaled E4M3 weights.
Both also take activations quantized by their producer (Fp8Activations) per row or per a multiple of 128
columns (the gated norm's per-group output). Where a side's scale changes along K (per-128 weight blocks,
per-group activations) the one float32 accumulator is rescaled before the step's wgmma into that step's
units (times the previous step's scale over this one's); the last step's scales go into the epilogue.
Activations are quantized by one-pass Triton kernels where they take the shape (`act_quant="fused"`, the
default) or by XLA (`act_quant="xla"`); both give the same bits.

Kernel layout: one CTA per SM, looping over output tiles (persistent, snake order for L2 reuse); a memory
warpgroup streams [rows, 128] E4M3 tiles of x and w through a multi-stage TMA pipeline (128-byte swizzle),
two compute warpgroups each own one [tile_m, tile_n] accumulator; w [N, K] is K-major, the layout FP8
wgmma needs for its B operand (passed as the transposed view of the shared-memory tile).
Rows (M) are padded to the CTA tile here; N and K must be multiples of 128 (ShapeError otherwise; as the GPU
default, `supports` sends such weights to the Triton arm).
H200 results and the tile reasoning: benchmarks/notes/quant_prefill.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.errors import ShapeError
from pallas_kernels.formats import E4M3_MAX, FP8_BLOCK, Fp8Activations, fp8_groups
from pallas_kernels import registry
from pallas_kernels.fp8_gemm import _check_fp8_rows, fp8_gemm_t_reference
from pallas_kernels.w8a16 import _check_w8a16, w8a16_pipelined_reference

TILE_K = 128          # one 128-byte swizzle row of E4M3; also the block-scale width
SMEM_BYTES = 227 * 1024
E4M3 = jnp.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class MgpuTiles:
    """Tile config: each compute warpgroup owns [tile_m, tile_n]; the two sit side by side along `wg_dim`."""

    tile_m: int = 128
    tile_n: int = 128
    wg_dim: str = "m"          # "m": CTA tile [2 tile_m, tile_n]; "n": [tile_m, 2 tile_n]
    stages: int = 4            # TMA pipeline depth (max concurrent K steps)
    grid_minor: str = "m"      # snake order over output tiles: the fastest-moving tile index
    grid_tile_width: int = 8
    epi_m: int = 64            # epilogue sub-tile rows (a multiple of the wgmma layout's 64-row tile)
    epi_bytes: int = 128       # epilogue sub-tile columns in bytes of the output dtype (its swizzle: 32/64/128)
    delay_release: int = 0     # wgmma groups left in flight per step (a stage is freed one step later)

    @property
    def cta(self) -> tuple[int, int]:
        return (2 * self.tile_m, self.tile_n) if self.wg_dim == "m" else (self.tile_m, 2 * self.tile_n)


def default_tiles(N: int, K: int, *, per_block: bool, x_steps: bool = False) -> MgpuTiles:
    """Block-scaled: 128x128 per warpgroup (CTA 256x128), tile_n = 128 = one scale block, so each step's weight
    scale is one number per warpgroup; stages 3 and 128-byte epilogue staging at K <= 4096 (a few % faster at
    in_proj, no faster at out_proj's K = 8192), else stages 4 with 64-byte staging (room for the per-step scale
    ratios). Row-scaled: 64x256 per warpgroup (CTA 128x256: one m64n256 wgmma per 32-wide K slice, each weight
    tile read once per warpgroup) where N takes 256-wide CTAs, else 128x128 (in_proj's N = 145 x 128). Timings:
    benchmarks/notes/quant_prefill.md."""
    if per_block:
        if K <= 4096:
            return MgpuTiles(tile_m=128, tile_n=128, wg_dim="m", stages=3, epi_bytes=128)
        return MgpuTiles(tile_m=128, tile_n=128, wg_dim="m", stages=4, epi_bytes=64)
    if N % 256 == 0:
        return MgpuTiles(tile_m=64, tile_n=256, wg_dim="m", stages=3, epi_bytes=128)
    return MgpuTiles(tile_m=128, tile_n=128, wg_dim="m", stages=4, epi_bytes=64 if x_steps else 128)


def _num_sms(interpret: bool) -> int:
    """Persistent CTAs: one per SM (132 on the H200 when lowering without a GPU, e.g. for CPU checks)."""
    if interpret:
        return 2
    try:
        return jax.devices()[0].core_count
    except AttributeError:
        return 132


def _fp8_transforms():
    return (plgpu.TilingTransform((8, TILE_K)), plgpu.SwizzleTransform(128))


def _check_tiles(name: str, M: int, N: int, K: int, t: MgpuTiles, *, per_block: bool) -> None:
    cols = t.cta[1]
    if per_block and (t.wg_dim != "m" or t.tile_n != FP8_BLOCK):
        # one 128-column scale block per CTA (the wg_dim="n" variant also deadlocked in GPU interpret mode)
        raise ShapeError(f"{name}: tiles.wg_dim must be 'm' and tile_n {FP8_BLOCK} for the block-scaled kernel, "
                         f"got {t.wg_dim!r}, {t.tile_n}")
    if t.tile_m % 64 or t.tile_n % 8 or t.tile_n > 256:
        raise ShapeError(f"{name}: tile_m={t.tile_m} must be a multiple of 64 and tile_n={t.tile_n} a multiple "
                         f"of 8 up to 256 (wgmma shapes)")
    if N % cols:
        raise ShapeError(f"{name}: w has N={N} rows, not a multiple of the Mosaic tile's {cols} columns; "
                         f"use the Triton arm or pad the weight")
    if K % TILE_K:
        raise ShapeError(f"{name}: K={K} (x columns, w columns) is not a multiple of {TILE_K}")
    if t.tile_m % t.epi_m or t.epi_m % 64 or t.epi_bytes not in (32, 64, 128):
        raise ShapeError(f"{name}: epi_m={t.epi_m} must be a multiple of 64 dividing tile_m={t.tile_m}, epi_bytes "
                         f"32, 64 or 128 (got {t.epi_bytes})")


def _gemm_kernel(*refs, per_block: bool, x_group_steps: int, t: MgpuTiles, M: int, N: int, K: int, out_dtype,
                 interpret: bool):
    """Body for both arms. refs = x, w, [xr_t [K/128, M]], [wr [K/128, N/128 * tile_m]], xs [M], ws [N], out,
    scratch. One float32 accumulator per warpgroup, kept in the units of the current K step's scales: where
    they change (x per group: xr; w per 128x128 block: wr) it is multiplied by the ratio of the previous
    step's scales to this step's before the step's wgmma; the last step's scales (xs, ws) are applied in the
    epilogue (not a fresh accumulator per step added into a running one: two accumulators per warpgroup fit only
    64x128 tiles, which were slower)."""
    x_steps = x_group_steps > 0        # x's scale changes along K, every x_group_steps steps
    n_ratio = int(x_steps) + int(per_block)
    x_ref, w_ref = refs[:2]
    ratio_refs = refs[2:2 + n_ratio]
    xs_ref, ws_ref, out_ref, out_smem, sx_smem, sw_smem, sx_bar, sw_bar = refs[2 + n_ratio:]
    cta_m, cta_n = t.cta
    tm, tn = t.tile_m, t.tile_n
    m_iters, n_iters, k_iters = M // cta_m, N // cta_n, K // TILE_K
    epi_n = _epi_n(t, out_dtype)
    minor = 0 if t.grid_minor == "m" else 1

    dr = t.delay_release

    def spec(shape, **kw):         # K step k of an operand
        return plgpu.BlockSpec(shape, lambda k: (k, 0) if shape[0] == 1 else (0, k), delay_release=dr, **kw)

    in_specs = [spec((cta_m, TILE_K), transforms=_fp8_transforms()),
                spec((cta_n, TILE_K), transforms=_fp8_transforms())]
    in_specs += ([spec((1, cta_m))] if x_steps else []) + ([spec((1, tm))] if per_block else [])

    def make_pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_iters,), memory_registers=40, in_specs=in_specs, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=t.stages, compute_context=context)

    ignore = lambda *_, **__: None
    gmem_args = (x_ref, w_ref) + tuple(ratio_refs)

    @functools.partial(pl.run_scoped, allocs=make_pipeline(ignore, ignore).get_allocations(*gmem_args),
                       collective_axes="wg")
    def _scope(allocs):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
        def _tiles(info: plgpu.NDLoopInfo):
            (lin,) = info.index
            mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), minor, t.grid_tile_width)
            cta_rows, cta_cols = pl.ds(mi * cta_m, cta_m), pl.ds(ni * cta_n, cta_n)
            if t.wg_dim == "m":
                wg_rows, wg_cols = pl.ds(wg * tm, tm), pl.ds(0, tn)
            else:
                wg_rows, wg_cols = pl.ds(0, tm), pl.ds(wg * tn, tn)
            rows0 = mi * cta_m + (wg * tm if t.wg_dim == "m" else 0)
            cols0 = ni * cta_n + (0 if t.wg_dim == "m" else wg * tn)

            def epilogue(acc):
                """acc [tm, tn] f32 (scaled) -> out[rows, cols] through 128-byte sub-tiles and TMA stores."""
                y = acc.astype(out_dtype)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                for i in range(tm // t.epi_m):
                    for j in range(tn // epi_n):
                        slot = (i * (tn // epi_n) + j) % 2
                        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                        out_smem[wg, slot] = y[i * t.epi_m:(i + 1) * t.epi_m, j * epi_n:(j + 1) * epi_n]
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            out_smem.at[wg, slot],
                            out_ref.at[pl.ds(rows0 + i * t.epi_m, t.epi_m), pl.ds(cols0 + j * epi_n, epi_n)])

            row_vec = lambda ref: plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1))     # [tm], one per row
            def finish(acc):
                plgpu.barrier_wait(sx_bar.at[wg])
                plgpu.barrier_wait(sw_bar.at[wg])
                xs = row_vec(sx_smem.at[wg])
                ws = plgpu.load(sw_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(0))
                epilogue(acc * lax.broadcast_in_dim(xs, (tm, tn), [0]) * lax.broadcast_in_dim(ws, (tm, tn), [1]))

            def context(run):
                # the epilogue's scales travel while the K loop runs
                plgpu.copy_gmem_to_smem(xs_ref.at[pl.ds(rows0, tm)], sx_smem.at[wg], sx_bar.at[wg])
                plgpu.copy_gmem_to_smem(ws_ref.at[pl.ds(cols0, tn)], sw_smem.at[wg], sw_bar.at[wg])
                if n_ratio:         # the accumulator is a value: rescaled, then handed to each step's wgmma
                    finish(run(plgpu.layout_cast(jnp.zeros((tm, tn), jnp.float32), plgpu.Layout.WGMMA)))
                    return

                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
                def _acc(acc_ref):
                    run(acc_ref)
                    finish(acc_ref[...])

            def body(idx, x_s, w_s, *rest):
                *ratio_s, acc = rest

                def mma(acc_ref):
                    plgpu.wgmma(acc_ref, x_s.at[wg_rows], w_s.at[wg_cols].transpose((1, 0)))

                if not ratio_s:
                    mma(acc)
                    plgpu.wgmma_wait(dr)
                    return acc
                def rescale(acc):       # change the units to this step's scales
                    r = row_vec(ratio_s[0].at[0, wg_rows]) if x_steps else None
                    if per_block:
                        rw = row_vec(ratio_s[-1].at[0])                         # one value, tm times
                        r = rw if r is None else r * rw
                    return acc * lax.broadcast_in_dim(r, (tm, tn), [0])

                if per_block or x_group_steps == 1:
                    acc = rescale(acc)
                else:                   # x's scale changes at its group boundaries only
                    acc = lax.cond(idx[0] % x_group_steps == 0, rescale, lambda a: a, acc)
                if not interpret:
                    return pl.run_state(mma)(plgpu.ACC.init(acc))    # waits for the wgmma
                # GPU interpret mode runs neither run_state over an accumulator nor accumulator stores:
                # the same sum through a fresh accumulator (what the compiled path must not do: two
                # accumulators do not fit the registers at 128x128 per warpgroup)
                def fresh_mma(part):
                    mma(part)
                    return plgpu.wgmma_accumulator_load(part)
                return acc + pl.run_scoped(fresh_mma, plgpu.ACC((tm, tn), jnp.float32))

            args = (x_ref.at[cta_rows, :], w_ref.at[cta_cols, :])
            args += ((ratio_refs[0].at[:, cta_rows],) if x_steps else ()) + \
                    ((ratio_refs[-1].at[:, pl.ds(ni * tm, tm)],) if per_block else ())
            make_pipeline(body, context)(*args, allocations=allocs)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _epi_n(t: MgpuTiles, out_dtype) -> int:
    return min(t.epi_bytes // jnp.dtype(out_dtype).itemsize, t.tile_n)


def _smem_bytes(t: MgpuTiles, out_dtype, per_block: bool, x_steps: bool) -> int:
    cta_m, cta_n = t.cta
    stage = (cta_m + cta_n) * TILE_K + 4 * (cta_m * x_steps + t.tile_m * per_block)
    epi_n = _epi_n(t, out_dtype)
    # + 1 KB: barriers and the 1024-byte alignment of swizzled buffers (H200: 64x256 st4 took 608 bytes more)
    return (t.stages * stage + 2 * 2 * t.epi_m * epi_n * jnp.dtype(out_dtype).itemsize + 8 * (t.tile_m + t.tile_n)
            + 1024)


@functools.partial(jax.jit, static_argnames=("per_block", "x_group_steps", "tiles", "out_dtype", "interpret",
                                             "name"))
def _mgpu_call(xq, w, scale_args, *, per_block: bool, x_group_steps: int, tiles: MgpuTiles, out_dtype,
               interpret: bool, name: str):
    """xq E4M3 [Mp, K] (Mp a multiple of the CTA rows), w E4M3 [N, K], scale_args the kernel's scale refs in
    order (see _gemm_kernel); x_group_steps: K steps per x scale group (0: one scale per row) -> [Mp, N]."""
    x_steps = x_group_steps > 0
    Mp, K = xq.shape
    N = w.shape[0]
    t = tiles
    if _smem_bytes(t, out_dtype, per_block, x_steps) > SMEM_BYTES:
        raise ShapeError(f"{name}: tiles {t} need {_smem_bytes(t, out_dtype, per_block, x_steps)} bytes of shared "
                         f"memory (> {SMEM_BYTES}); lower stages")
    epi_n = _epi_n(t, out_dtype)
    swz = epi_n * jnp.dtype(out_dtype).itemsize
    out_smem = plgpu.SMEM((2, 2, t.epi_m, epi_n), out_dtype,
                          transforms=(plgpu.TilingTransform((8, epi_n)), plgpu.SwizzleTransform(swz)))
    kernel = functools.partial(_gemm_kernel, per_block=per_block, x_group_steps=x_group_steps, t=t, M=Mp, N=N, K=K,
                               out_dtype=out_dtype, interpret=interpret)
    ntiles = (Mp // t.cta[0]) * (N // t.cta[1])
    f = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((Mp, N), out_dtype),
        scratch_types=[out_smem, plgpu.SMEM((2, t.tile_m), jnp.float32), plgpu.SMEM((2, t.tile_n), jnp.float32),
                       plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2)],
        grid=(min(_num_sms(interpret), ntiles),), grid_names=("sm",),
        num_threads=3, thread_name="wg",
        interpret=plgpu.InterpretGPUParams() if interpret else None, kernel_name=name)
    return f(xq, w, *scale_args)


def _step_ratios(s):
    """s [steps, X] scale of each 128-wide K step -> [steps, X]: the previous step's scale over this one's
    (1 at step 0): the factor that moves the accumulator into this step's units."""
    return jnp.concatenate([jnp.ones_like(s[:1]), s[:-1] / s[1:]], axis=0)


def _scale_args(xs, width: int, ws, *, per_block: bool, tiles: MgpuTiles, K: int):
    """The kernel's scale operands from x's scales xs [Mp, K/width] and w's (per row [N] or per block
    [N/128, K/128]): (xr_t, wr, xs_last, ws_last) without the ratios a side does not need."""
    kb = K // TILE_K
    x_steps = width < K
    xs_k = jnp.repeat(xs, width // TILE_K, axis=1)[:, :kb] if x_steps else None          # [Mp, K/128]
    args = (_step_ratios(xs_k.T),) if x_steps else ()
    if per_block:       # [K/128, N/128 * tile_m]: each block's ratio tile_m times (a row vector per warpgroup)
        args += (jnp.repeat(_step_ratios(ws.T), tiles.tile_m, axis=1),)
    xs_last = xs[:, -1]
    ws_last = jnp.repeat(ws[:, -1], TILE_K) if per_block else ws
    return args + (xs_last, ws_last)


# ---- activation quantization in one pass (Pallas Triton; act_quant="fused") ------------------------------
# XLA quantizes x in ~2 passes (row amax, then divide + convert). These kernels read x once and write the E4M3
# copy and its scales once, with the same formulas as formats.quantize_rows_fp8[_blocks] (same bits), in about
# half XLA's time at the 8B shapes (benchmarks/notes/quant_prefill.md).


@dataclasses.dataclass(frozen=True)
class ActQuantBlocks:
    """Rows per program and warps of the fused quantizers (rows: whole rows; blocks: [rows, 128] per program)."""
    rows_elems: int = 8192           # rows kernel: rows per program = rows_elems // K (the fastest in a sweep)
    rows_warps: int = 4
    blocks_rows: int = 64
    blocks_warps: int = 4


ACT_QUANT_BLOCKS = ActQuantBlocks()


def _e4m3_last_axis(x):
    """float32 x [..., W] -> (E4M3 [..., W], scale [...]): formats' formulas, one scale over the last axis."""
    amax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    return jnp.clip(x / scale[..., None], -E4M3_MAX, E4M3_MAX).astype(E4M3), scale


def _quant_rows_kernel(x_ref, q_ref, s_ref):
    q_ref[...], s_ref[...] = _e4m3_last_axis(x_ref[...].astype(jnp.float32))      # [R, K], [R]


def _quant_blocks_kernel(x_ref, q_ref, s_ref):
    q, scale = _e4m3_last_axis(x_ref[...].astype(jnp.float32))                     # [R, 128], [R]
    q_ref[...] = q
    s_ref[...] = scale[None, :]


def fused_quant_ok(M: int, K: int, qb: ActQuantBlocks | None = None) -> bool:
    """The fused passes take K a power of two >= 128 and M a multiple of their row blocks."""
    qb = qb or ACT_QUANT_BLOCKS
    return (K >= TILE_K and K & (K - 1) == 0 and M % _quant_rows_block(K, qb) == 0
            and M % qb.blocks_rows == 0)


def _quant_rows_block(K: int, qb: ActQuantBlocks) -> int:
    return max(1, qb.rows_elems // K)


@functools.partial(jax.jit, static_argnames=("interpret", "qb"))
def quantize_rows_fused(x, *, interpret: bool = False, qb: ActQuantBlocks | None = None):
    """x [M, K] -> (E4M3 [M, K], f32 scale [M]), as formats.quantize_rows_fp8, in one pass."""
    from jax.experimental.pallas import triton as pltr
    qb = qb or ACT_QUANT_BLOCKS
    M, K = x.shape
    if not fused_quant_ok(M, K, qb):
        raise ShapeError(f"fused E4M3 quantization: x [{M}, {K}] needs K a power of two >= 128, M a multiple of "
                         f"{max(_quant_rows_block(K, qb), qb.blocks_rows)}")
    R = _quant_rows_block(K, qb)
    return pl.pallas_call(
        _quant_rows_kernel, grid=(M // R,),
        in_specs=[pl.BlockSpec((R, K), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((R, K), lambda i: (i, 0)), pl.BlockSpec((R,), lambda i: (i,))],
        out_shape=[jax.ShapeDtypeStruct((M, K), E4M3), jax.ShapeDtypeStruct((M,), jnp.float32)],
        compiler_params=pltr.CompilerParams(num_warps=qb.rows_warps, num_stages=1), interpret=interpret,
        name="quantize_rows_fp8")(x)


@functools.partial(jax.jit, static_argnames=("interpret", "qb"))
def quantize_blocks_fused_t(x, *, interpret: bool = False, qb: ActQuantBlocks | None = None):
    """x [M, K] -> (E4M3 [M, K], f32 scale transposed [K/128, M]): formats.quantize_rows_fp8_blocks
    with the scales already in the layout the block-scaled kernel reads."""
    from jax.experimental.pallas import triton as pltr
    qb = qb or ACT_QUANT_BLOCKS
    M, K = x.shape
    if not fused_quant_ok(M, K, qb):
        raise ShapeError(f"fused E4M3 quantization: x [{M}, {K}] needs K a power of two >= 128, M a multiple of "
                         f"{max(_quant_rows_block(K, qb), qb.blocks_rows)}")
    R = qb.blocks_rows
    return pl.pallas_call(
        _quant_blocks_kernel, grid=(M // R, K // TILE_K),
        in_specs=[pl.BlockSpec((R, TILE_K), lambda i, j: (i, j))],
        out_specs=[pl.BlockSpec((R, TILE_K), lambda i, j: (i, j)), pl.BlockSpec((1, R), lambda i, j: (j, i))],
        out_shape=[jax.ShapeDtypeStruct((M, K), E4M3), jax.ShapeDtypeStruct((K // TILE_K, M), jnp.float32)],
        compiler_params=pltr.CompilerParams(num_warps=qb.blocks_warps, num_stages=1), interpret=interpret,
        name="quantize_rows_fp8_blocks")(x)


def _quant_blocks_masked_kernel(x_ref, q_ref, s_ref, *, M: int, R: int, NB: int):
    """Rows [R] x NB whole 128-column blocks of any M (rows past M masked): the blocks kernel's formulas."""
    from jax.experimental.pallas import triton as pltr
    rows = pl.program_id(0) * R + jnp.arange(R)
    cols = pl.program_id(1) * NB * TILE_K + jnp.arange(NB * TILE_K)
    rm = (rows < M)[:, None]
    x = pltr.load(x_ref.at[rows[:, None], cols[None, :]], mask=rm, other=0.0).astype(jnp.float32)   # [R, NB*128]
    q, scale = _e4m3_last_axis(x.reshape(R, NB, TILE_K))                                          # scale [R, NB]
    pltr.store(q_ref.at[rows[:, None], cols[None, :]], q.reshape(R, NB * TILE_K), mask=rm)
    blocks = pl.program_id(1) * NB + jnp.arange(NB)
    pltr.store(s_ref.at[rows[:, None], blocks[None, :]], scale, mask=rm)


MASKED_QUANT_COLS = 1024        # columns per program of the any-M quantizer (8 blocks of 128)


@functools.partial(jax.jit, static_argnames=("interpret",))
def quantize_blocks_any_rows(x, *, interpret: bool = False):
    """x [M, K] (any M, K a multiple of 128) -> (E4M3 [M, K], f32 scale [M, K/128]): formats.quantize_rows_fp8_blocks
    in one pass, for the row counts the fused blocks kernel does not take (decode's M < 64)."""
    from jax.experimental.pallas import triton as pltr
    M, K = x.shape
    if K % TILE_K:
        raise ShapeError(f"E4M3 block quantization: x [{M}, {K}] needs K a multiple of {TILE_K}")
    kb = K // TILE_K
    NB = max(d for d in (8, 4, 2, 1) if kb % d == 0 and d * TILE_K <= MASKED_QUANT_COLS)
    R = min(8, 1 << (M - 1).bit_length())
    kernel = functools.partial(_quant_blocks_masked_kernel, M=M, R=R, NB=NB)
    return pl.pallas_call(
        kernel, grid=(pl.cdiv(M, R), kb // NB),
        out_shape=[jax.ShapeDtypeStruct((M, K), E4M3), jax.ShapeDtypeStruct((M, kb), jnp.float32)],
        compiler_params=pltr.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
        name="quantize_rows_fp8_blocks_any")(x)


def _pad_rows(a, rows: int):
    return a if a.shape[0] == rows else jnp.pad(a, ((0, rows - a.shape[0]),) + ((0, 0),) * (a.ndim - 1))


def _quantized_x(x, group: int | None, M: int, K: int, interpret: bool, act_quant: str,
                 qb: ActQuantBlocks | None):
    """(E4M3 [M, K], f32 scales [M, K/width], width): x as its producer quantized it, or quantized here per
    row (group None) or per row per 128 columns, by the fused kernels where they take the shape (per 128 columns
    below 64 rows: `quantize_blocks_any_rows`, any K multiple of 128), else by XLA; the same bits every way."""
    fused = not isinstance(x, Fp8Activations) and act_quant == "fused"
    if fused and fused_quant_ok(M, K, qb):
        if group is None:
            xq, xs = quantize_rows_fused(x, interpret=interpret, qb=qb)
            xs, width = xs[:, None], K
        else:
            xq, xs_t = quantize_blocks_fused_t(x, interpret=interpret, qb=qb)
            xs, width = xs_t.T, TILE_K
    elif fused and group is not None and K % TILE_K == 0 and M < (qb or ACT_QUANT_BLOCKS).blocks_rows:
        # decode's row counts (prefill's ragged ones stay on XLA, as timed)
        xq, xs = quantize_blocks_any_rows(x, interpret=interpret)
        width = TILE_K
    else:
        xq, xs, width = fp8_groups(x, group)
    return xq, xs, width


def _mosaic_arm(name: str, x, w, scale, *, per_block: bool, out_dtype, interpret: bool, tiles: MgpuTiles | None,
                act_quant: str, qb: ActQuantBlocks | None):
    if act_quant not in ("fused", "xla"):
        raise ShapeError(f"{name}: act_quant must be 'fused' or 'xla', got {act_quant!r}")
    M, K = x.shape
    N = w.shape[0]
    xq, xs, width = _quantized_x(x, FP8_BLOCK if per_block else None, M, K, interpret, act_quant, qb)
    x_group_steps = width // TILE_K if width < K else 0        # 0: one x scale per row
    t = tiles or default_tiles(N, K, per_block=per_block, x_steps=x_group_steps > 0)
    _check_tiles(name, M, N, K, t, per_block=per_block)
    Mp = pl.cdiv(M, t.cta[0]) * t.cta[0]
    xs = _pad_rows(xs, Mp)
    args = _scale_args(xs, width, scale, per_block=per_block, tiles=t, K=K)
    y = _mgpu_call(_pad_rows(xq, Mp), w, args, per_block=per_block, x_group_steps=x_group_steps, tiles=t,
                   out_dtype=jnp.dtype(out_dtype or x.dtype), interpret=interpret, name=name)
    return y[:M] if Mp != M else y


def fp8_gemm_t_mosaic(x, w, scale, *, out_dtype=None, interpret: bool = False, tiles: MgpuTiles | None = None,
                      act_quant: str = "fused", qb: ActQuantBlocks | None = None):
    """Mosaic arm of fp8_gemm_t: same call and result as `fp8_gemm_t_reference` (x [M, K] or Fp8Activations,
    w E4M3 [N, K], scale f32 [N]). act_quant: "fused" (one-pass kernels where they take the shape, else XLA) or
    "xla" quantization of a bf16 x, the same bits; qb: the fused kernels' blocks."""
    _check_fp8_rows(x, w, scale)
    return _mosaic_arm("fp8_gemm_t", x, w, scale, per_block=False, out_dtype=out_dtype, interpret=interpret,
                       tiles=tiles, act_quant=act_quant, qb=qb)


def w8a16_gemm_pipelined_mosaic(x, w, scale, *, out_dtype=None, interpret: bool = False,
                                tiles: MgpuTiles | None = None, act_quant: str = "fused",
                                qb: ActQuantBlocks | None = None):
    """Mosaic arm of w8a16_gemm_pipelined: same call and result as `w8a16_pipelined_reference` (x [M, K] or
    Fp8Activations, w E4M3 [N, K], scale f32 [ceil(N/128), ceil(K/128)], nonzero: the accumulator is rescaled by
    ratios of consecutive block scales; Projection.prepare clears zero-scale blocks). act_quant as for
    fp8_gemm_t_mosaic."""
    _check_w8a16("w8a16_gemm_pipelined", x, w, scale)
    return _mosaic_arm("w8a16_gemm_pipelined", x, w, scale, per_block=True, out_dtype=out_dtype,
                       interpret=interpret, tiles=tiles, act_quant=act_quant, qb=qb)


def supports(name: str, N: int, K: int) -> bool:
    """Whether the default tiles of `name` take an [N, K] weight (M is always padded): N a multiple of the CTA
    columns (128), K a multiple of 128. Other shapes go to the Triton arm when Mosaic is the default."""
    t = default_tiles(N, K, per_block=name == "w8a16_gemm_pipelined")
    return N % t.cta[1] == 0 and K % TILE_K == 0


# Mosaic is the GPU default of both: about 3x the Triton arms at the 8B prefill shapes on the H200
# (benchmarks/notes/quant_prefill.md).
registry.register("fp8_gemm_t", reference=fp8_gemm_t_reference, mosaic=fp8_gemm_t_mosaic, gpu_default="mosaic",
                  mosaic_supports=lambda x, w, scale, **_: supports("fp8_gemm_t", *w.shape))
registry.register("w8a16_gemm_pipelined", reference=w8a16_pipelined_reference, mosaic=w8a16_gemm_pipelined_mosaic,
                  gpu_default="mosaic",
                  mosaic_supports=lambda x, w, scale, **_: supports("w8a16_gemm_pipelined", *w.shape))
