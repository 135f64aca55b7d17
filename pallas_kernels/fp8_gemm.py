"""FP8 x FP8 prefill GEMMs on the FP8 matrix units (Hopper has no FP4 math, but it has E4M3).

Activations arrive in bf16 and are quantized to E4M3 first (one XLA pass over x), then:
  fp8_block_gemm   weights block-scaled [ceil(N/128), ceil(K/128)], activations one scale per row per
                   128 columns; each 128-wide K step is rescaled into a float32 accumulator
                   (serves w8a16_gemm_pipelined).
  fp8_gemm_t       the pre-dequantized FP8 prefill copy: weights one scale per row [N], activations one
                   scale per row [M], so the matrix units accumulate the whole K and the scales are
                   applied once at the end.  ("_t": the seed's name; the copy is stored [N, K], the
                   K-major operand layout Hopper's FP8 matrix instructions read.)
Both references quantize the activations the same way, dequantize both operands and matmul in f32. Every arm
also takes x already quantized by its producer (formats.Fp8Activations, e.g. from norm_fp8): per row,
or per row per group of 128k columns, whose scales are then applied per K step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.errors import ShapeError
from pallas_kernels.formats import FP8_BLOCK, fp8_dequantized, fp8_groups
from pallas_kernels import registry
from pallas_kernels.triton_util import compiler_params, dot
from pallas_kernels.w8a16 import (QuantBlocks, check_activations, check_array, fit_blocks, grid_ids, matmul_f32,
                                  store_tile)


def fp8_gemm_t_reference(x, w, scale, *, out_dtype=None):
    """x [M, K] (quantized per row to E4M3, or Fp8Activations), w E4M3 [N, K] with row scale f32 [N] -> [M, N]."""
    _check_fp8_rows(x, w, scale)
    wd = w.astype(jnp.float32) * scale[:, None]
    return matmul_f32(fp8_dequantized(x, None), wd).astype(out_dtype or x.dtype)


def _check_fp8_rows(x, w, scale):
    name = "fp8_gemm_t"
    if w.ndim != 2 or jnp.dtype(w.dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise ShapeError(f"{name}: w expected float8_e4m3fn [N, K], got {jnp.dtype(w.dtype).name}{list(w.shape)}")
    check_activations(name, x, w.shape[1])
    check_array(name, "scale", scale, jnp.float32, (w.shape[0],))


def _fp8_kernel(xq_ref, xs_ref, w_ref, ws_ref, o_ref, *, M, N, K, bm, bn, bk, num_m, width, per_block, upcast,
                swap):
    """xs [M, K/width]: per step when x is quantized per group (width < K), else once at the end; ws per
    128x128 block per step (per_block) or per row at the end."""
    pid_n, pid_m = grid_ids(num_m)
    n0, m0 = pid_n * bn, pid_m * bm
    n_mask = (n0 + jnp.arange(bn)) < N
    m_mask = (m0 + jnp.arange(bm)) < M
    ragged_k = K % bk != 0
    x_steps = width < K

    def body(i, acc):
        k0 = i * bk
        if ragged_k:
            k_mask = (k0 + jnp.arange(bk)) < K
            xm, wm = m_mask[:, None] & k_mask[None, :], n_mask[:, None] & k_mask[None, :]
        else:
            xm, wm = m_mask[:, None], n_mask[:, None]
        xq = plgpu.load(xq_ref.at[pl.ds(m0, bm), pl.ds(k0, bk)], mask=xm, other=0.0)
        wq = plgpu.load(w_ref.at[pl.ds(n0, bn), pl.ds(k0, bk)], mask=wm, other=0.0)
        if upcast:  # interpret mode on the CPU: E4M3 -> bf16 is exact
            xq, wq = xq.astype(jnp.bfloat16), wq.astype(jnp.bfloat16)
        part = dot(wq, xq, trans_b=True) if swap else dot(xq, wq, trans_b=True)   # [bn, bm] / [bm, bn] f32
        if not (x_steps or per_block):
            return acc + part
        xs = (plgpu.load(xs_ref.at[pl.ds(m0, bm), k0 // width], mask=m_mask, other=0.0) if x_steps
              else jnp.ones((bm,), jnp.float32))
        ws = ws_ref[n0 // FP8_BLOCK, k0 // FP8_BLOCK] if per_block else 1.0
        return acc + part * (xs[None, :] * ws if swap else xs[:, None] * ws)

    acc = jax.lax.fori_loop(0, pl.cdiv(K, bk), body, jnp.zeros((bn, bm) if swap else (bm, bn), jnp.float32))
    xs = (jnp.ones((bm,), jnp.float32) if x_steps
          else plgpu.load(xs_ref.at[pl.ds(m0, bm), jnp.int32(0)], mask=m_mask, other=0.0))
    ws = jnp.ones((bn,), jnp.float32) if per_block else plgpu.load(ws_ref.at[pl.ds(n0, bn)], mask=n_mask, other=0.0)
    if not (x_steps and per_block):
        acc = acc * (ws[:, None] * xs[None, :] if swap else xs[:, None] * ws[None, :])
    store_tile(o_ref, 0, acc, m0, n0, m_mask, n_mask, swap)


@functools.partial(jax.jit, static_argnames=("out_dtype", "blocks", "interpret", "per_block", "name"))
def _fp8_call(x, w, wscale, *, out_dtype, blocks: QuantBlocks, interpret: bool, per_block: bool, name: str):
    M, K = x.shape
    N = w.shape[0]
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    if per_block and (FP8_BLOCK % bn or FP8_BLOCK % bk):
        raise ShapeError(f"{name}: block_n={bn} and block_k={bk} must divide the 128-wide scale blocks")
    xq, xs, width = fp8_groups(x, FP8_BLOCK if per_block else None)     # [M, K], [M, K/width]
    if width < K and width % bk:
        raise ShapeError(f"{name}: block_k={bk} must divide the activations' {width}-column scale groups")
    num_m, num_n = pl.cdiv(M, bm), pl.cdiv(N, bn)
    kernel = functools.partial(_fp8_kernel, M=M, N=N, K=K, bm=bm, bn=bn, bk=bk, num_m=num_m, width=width,
                               per_block=per_block, upcast=interpret, swap=blocks.swap)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((1, M, N), out_dtype), grid=(num_m * num_n,),
        compiler_params=compiler_params(blocks.num_warps, blocks.num_stages), interpret=interpret, name=name,
    )(xq, xs, w, wscale)[0]


def fp8_gemm_blocks(N: int, K: int, *, per_block: bool) -> QuantBlocks:
    """Best of the H200 sweeps (benchmarks/notes/quant.md): 64x128 tiles, 4 warps, 4 stages; the row-scaled GEMM
    with the weight tile as the A operand."""
    return QuantBlocks(block_m=64, block_n=128, block_k=128, split_k=1, num_warps=4, num_stages=4,
                       swap=not per_block)


def fp8_block_gemm(x, w, scale, *, out_dtype=None, interpret: bool = False, blocks: QuantBlocks | None = None):
    """x [M, K] @ block-scaled E4M3 w [N, K] on the FP8 matrix units (activations quantized per row per 128)."""
    blk = fit_blocks(blocks or fp8_gemm_blocks(*w.shape, per_block=True), x.shape[0], w.shape[1], k_unit=2)
    return _fp8_call(x, w, scale, out_dtype=jnp.dtype(out_dtype or x.dtype), blocks=blk, interpret=interpret,
                     per_block=True, name="w8a16_gemm_pipelined")


def fp8_gemm_t_pallas(x, w, scale, *, out_dtype=None, interpret: bool = False, blocks: QuantBlocks | None = None):
    """The pre-dequantized FP8 prefill GEMM; same call and result as `fp8_gemm_t_reference`."""
    _check_fp8_rows(x, w, scale)
    blk = fit_blocks(blocks or fp8_gemm_blocks(*w.shape, per_block=False), x.shape[0], w.shape[1], k_unit=2)
    return _fp8_call(x, w, scale, out_dtype=jnp.dtype(out_dtype or x.dtype), blocks=blk, interpret=interpret,
                     per_block=False, name="fp8_gemm_t")


registry.register("fp8_gemm_t", reference=fp8_gemm_t_reference, pallas=fp8_gemm_t_pallas)
for _name in ("fp8_gemm_t",):   # gradients to the activations only
    registry.register(_name, grad_wrt=registry.ACTIVATIONS)
