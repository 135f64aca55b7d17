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
SMs are covered (float32 partials added by XLA in a fixed order, `_finish`, or handed on unreduced to a consumer
that adds them itself: split_partials.py). Where the row blocks alone fill two CTAs per SM (in_proj) w8 runs
unsplit with two K blocks per pipeline step and splits only the row blocks past a whole number per SM into K
pieces (`tail_split`), so every SM streams about the same bytes; those pieces (and w4's
split halves at in_proj) are added in the kernel by 2-CTA clusters (`_cluster_sum`: CTA 0 adds the other's
float32 partial from its shared memory in the order XLA's sum uses, so both give the same bits).

An elementwise epilogue (`epilogues`: the MLP's relu^2 on up_proj) goes on the complete float32 sum: in the kernel
before a direct bf16 store (also after a cluster's sum), else in `_finish` after XLA adds the split partials; the
same bits as applying it to the float32 output.

Weight tiles never depend on M (split-K chosen from (N, K) only, split partials added in a fixed order), and a
wgmma gives each output column the same bits whatever its N (tested on the GPU), so a row's result is
bit-identical whatever the batch. Interpret mode (CPU tests) passes the A operand through shared memory, since the
GPU interpreter's wgmma reads A from shared memory only, decodes with jnp (in the same K order) and adds split
partials in XLA; everything else is shared with the compiled kernel.
Shapes: bf16 x, N % 64 == 0, K % 128 (w8) / K % 512 (w4) == 0 (`supports`); else ShapeError.
This module: the launch config and what both kernels share (the output store, the split-K sum, the cluster sum,
launch tiles, argument checks); the kernels: mgpu_gemv_w8.py, mgpu_gemv_w4.py.
Measurements and what was tried: benchmarks/notes/gemv.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import epilogues
from pallas_kernels.errors import ShapeError
from pallas_kernels.split_partials import SplitPartials, chain_sum, split_halves
from pallas_kernels.w8a16 import H200_SMS

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


def _store_out(accs, o_smem, o_gmem, split, m_blk, n_blk, bn, direct, xr: int = BM, epilogue: str | None = None):
    """accs: per 64-row group, a [64, xr] tile of out^T (xr: x rows per CTA, see `x_rows`), stored through a
    transposed SMEM view [xr, bn] so the output is row-major. direct: the complete sums, through `epilogue`, into
    o_gmem [M, N] (TMA clips rows past M and columns past N; 16-bit outputs only). Else float32 partials, as their
    uint16 halves into o_gmem [2, split, Mp, N] (split_partials.py: a transposed 32-bit store does not lower),
    summed and put through the epilogue by `_finish`, or handed on unreduced."""
    if direct:
        accs = [epilogues.apply(acc, epilogue) for acc in accs]
    for g, acc in enumerate(accs):
        rows, cols = pl.ds(g * ROWS, ROWS), pl.ds(0, xr)
        if direct:
            o_smem.at[cols, rows].transpose((1, 0))[...] = acc.astype(o_smem.dtype)
        else:
            for half, part in enumerate(split_halves(acc)):
                o_smem.at[half, cols, rows].transpose((1, 0))[...] = part
    plgpu.commit_smem()
    mrows, ncols = pl.ds(m_blk * xr, xr), pl.ds(n_blk * bn, bn)
    if direct:
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[mrows, ncols])
    else:
        for half in range(2):
            plgpu.copy_smem_to_gmem(o_smem.at[half], o_gmem.at[half, split, mrows, ncols])
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
    return (False, jax.ShapeDtypeStruct((2, split, pl.cdiv(M, xr) * xr, N), jnp.uint16),
            plgpu.SMEM((2, xr, bn), jnp.uint16))


def _pad_rows(x):
    """TMA tiles x rows by 8: an M above 8 that is not a multiple of 8 gets zero rows appended."""
    M = x.shape[0]
    return x if M <= 8 or M % 8 == 0 else jnp.pad(x, ((0, -M % 8), (0, 0)))


def supports(kernel: str, N: int, K: int, x_dtype) -> bool:
    """Whether the Mosaic arm of `kernel` ("w8a16_gemv" / "w8a8_gemv" / "w4a16_gemv") takes these shapes (else
    ShapeError); x_dtype: bf16 (w8a8_gemv's Fp8Activations carry their unquantized dtype, bf16)."""
    k_multiple = {"w8a16_gemv": W8_BK, "w8a8_gemv": W8_BK, "w4a16_gemv": W4_K}[kernel]
    return N % ROWS == 0 and K % k_multiple == 0 and jnp.dtype(x_dtype) == jnp.dtype(jnp.bfloat16)


def _check_dims(name: str, N: int, K: int, k_multiple: int):
    if N % ROWS or K % k_multiple:
        raise ShapeError(f"{name}(mosaic): needs N % 64 == 0 and K % {k_multiple} == 0 (TMA tiles), got N={N}, K={K}; "
                         "use the Triton arm for other shapes")


def _finish(out, direct: bool, M: int, out_dtype, epilogue: str | None = None, unreduced: bool = False):
    """Direct: cut padded rows (the kernel applied the epilogue). Else `out` holds the split-K partials as uint16
    halves [2, split, Mp, N]: handed on as SplitPartials (unreduced), or summed as a chain of elementwise adds (a
    fixed order whatever the shape: a reduce could be emitted with an M-dependent order) and put through the
    epilogue."""
    if direct:
        return out[:M]
    if unreduced:
        return SplitPartials(out)
    return epilogues.apply(chain_sum(SplitPartials(out), M), epilogue).astype(out_dtype)


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


# the most x tiles per CTA an auto launch takes (the fastest on the H200, benchmarks/notes/gemv.md)
M_TILES_AUTO = {"w8a16_gemv": 8, "w8a8_gemv": 8, "w4a16_gemv": 4}
TILES_STAGES = 2       # pipeline stages of a multi-tile launch: two CTAs per SM
GEMV_SMEM = 220 * 1024  # pipeline stages + output staging of a GEMV CTA (of 227 KB; the rest: barriers)


def launch_tiles(name: str, M: int, N: int, K: int, config: GemvConfig, out_dtype) -> tuple[int, int]:
    """(16-row x tiles per CTA, pipeline stages) of a launch. config.m_tiles as given, or (0) up to
    M_TILES_AUTO[name] of the m-blocks at no more than TILES_STAGES stages, as fit in GEMV_SMEM (the stages' weight and
    x tiles, the output staging), spread evenly over the fewest CTAs."""
    w8 = name != "w4a16_gemv"
    x_bytes = 1 if name == "w8a8_gemv" else 2               # E4M3 or bf16 x
    bk = (W8_BK if w8 else W4_BK) * config.k_blocks
    bn, _, mb, split, steps = _grid(name, M, N, K, bk, config)
    stages = min(config.stages, steps) if w8 else config.stages
    w_bytes = bn * (bk if w8 else bk // 2 + bk // 16)       # per stage
    out_bytes = 2 if _direct(split, out_dtype) else 4
    smem = lambda mt, st: st * w_bytes + (st * x_bytes * bk + out_bytes * bn) * BM * mt
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


def resolve_k_blocks(config: GemvConfig, M: int) -> GemvConfig:
    """config as launched at M rows: auto m_tiles with several x tiles per CTA (M > 16) takes one K block per step
    (two blocks with 4-8 tiles were slower). k_blocks keeps every row's operations and their order, so rows stay
    bit-identical across the two (checked on the GPU)."""
    if config.k_blocks > 1 and config.m_tiles == 0 and pl.cdiv(M, BM) > 1:
        return dataclasses.replace(config, k_blocks=1)
    return config
