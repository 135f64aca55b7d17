"""W4A4: NVFP4 weights with NVFP4 activations, quantized on the fly per 16 along K.

Hopper has no FP4 math, so both operands are dequantized: the activations are quantized and
dequantized in one XLA pass (global scale: the checkpoint's input_scale, else per row amax / (6 * 448),
so a row never depends on the rest of the batch), then the W4A16 kernel runs on them. The reference
does the same activation pass and then dequantize-then-matmul.

w4a4_gemm(x, packed, scale, global_scale, input_scale=None, *, decode=False): `decode` picks the
GEMV tiles (16-row blocks, independent of M, for decode steps) instead of the prefill GEMM tiles.
On Hopper the decode calls go to the Mosaic GEMV of w4a16_gemv (pallas_kernels/mgpu_gemv.py; 2x the Triton
GEMV at M = 1, several x tiles per CTA at large batch); prefill calls and shapes it does not take to Triton.
"""

from __future__ import annotations

import jax.numpy as jnp

from metrale_jax.weights.quant_formats import nvfp4_activation_global, nvfp4_fake_quant
from metrale_jax.errors import ShapeError
from pallas_kernels import mgpu_gemv, registry
from pallas_kernels.w4a16 import (check_nvfp4_args, w4a16_gemm_pallas, w4a16_gemv_pallas, w4a16_reference)


def quantize_activations_nvfp4(x, input_scale=None):
    """x [M, K] -> x rounded through NVFP4 (per 16 along K), in x's dtype."""
    return nvfp4_fake_quant(x, nvfp4_activation_global(x, input_scale))


def w4a4_reference(x, packed, scale, global_scale, input_scale=None, *, out_dtype=None, decode=False):
    del decode
    check_nvfp4_args("w4a4_gemm", x, packed, scale, global_scale, transposed=False)
    return w4a16_reference(quantize_activations_nvfp4(x, input_scale), packed, scale, global_scale,
                           out_dtype=out_dtype or x.dtype)


def w4a4_gemm_pallas(x, packed, scale, global_scale, input_scale=None, *, out_dtype=None, decode=False,
                     interpret=False, blocks=None):
    """Same call and result as `w4a4_reference`."""
    check_nvfp4_args("w4a4_gemm", x, packed, scale, global_scale, transposed=False)
    xq = quantize_activations_nvfp4(x, input_scale)
    run = w4a16_gemv_pallas if decode else w4a16_gemm_pallas
    return run(xq, packed, scale, global_scale, out_dtype=jnp.dtype(out_dtype or x.dtype), interpret=interpret,
               blocks=blocks)


def w4a4_gemm_mosaic(x, packed, scale, global_scale, input_scale=None, *, out_dtype=None, decode=False,
                     interpret=False, config=None):
    """Mosaic arm, decode only: the same activation pass, then the Mosaic w4a16 GEMV (bf16 x, N % 64 == 0,
    K % 512 == 0). Same call and result as `w4a4_reference`."""
    check_nvfp4_args("w4a4_gemm", x, packed, scale, global_scale, transposed=False)
    if not decode:
        raise ShapeError("w4a4_gemm(mosaic): serves decode=True only (the Mosaic NVFP4 GEMM takes the transposed "
                         "prefill layout); use the Triton arm for prefill")
    return mgpu_gemv.w4a16_gemv_mosaic(quantize_activations_nvfp4(x, input_scale), packed, scale, global_scale,
                                       out_dtype=out_dtype or x.dtype, interpret=interpret, config=config)


def _mosaic_supports(x, packed, *_, decode=False, **__) -> bool:
    return decode and mgpu_gemv.supports("w4a16_gemv", packed.shape[0], 2 * packed.shape[1], x.dtype)


registry.register("w4a4_gemm", reference=w4a4_reference, pallas=w4a4_gemm_pallas, mosaic=w4a4_gemm_mosaic,
                  mosaic_supports=_mosaic_supports, gpu_default="mosaic")
