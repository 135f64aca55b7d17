"""W4A4: NVFP4 weights with NVFP4 activations, quantized on the fly per 16 along K.

Hopper has no FP4 math, so both operands are dequantized: the activations are quantized and
dequantized in one XLA pass (global scale: the checkpoint's input_scale, else per row amax / (6 * 448),
so a row never depends on the rest of the batch), then the W4A16 kernel runs on them. The reference
does the same activation pass and then dequantize-then-matmul.

w4a4_gemm(x, packed, scale, global_scale, input_scale=None, *, decode=False): `decode` picks the
GEMV tiles (16-row blocks, independent of M, for decode steps) instead of the prefill GEMM tiles.
On Hopper the Mosaic arm runs the same activation pass, then for decode the Mosaic GEMV of w4a16_gemv
(pallas_kernels/mgpu_gemv_w4.py) and for prefill the Mosaic NVFP4 GEMM on
the plain layout (pallas_kernels/mgpu_gemm_nvfp4.py); shapes they do not take go to Triton.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.formats import nvfp4_activation_global, nvfp4_fake_quant
from pallas_kernels import mgpu_gemm_nvfp4, mgpu_gemv, mgpu_gemv_w4, registry
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
                     interpret=False):
    """Mosaic arm: the same activation pass, then the Mosaic w4a16 GEMV (decode: bf16 x, N % 64 == 0,
    K % 512 == 0) or the Mosaic NVFP4 GEMM (prefill: N % 128 == 0, K % 256 == 0). Same call and result as
    `w4a4_reference`."""
    check_nvfp4_args("w4a4_gemm", x, packed, scale, global_scale, transposed=False)
    xq = quantize_activations_nvfp4(x, input_scale)
    out_dtype = out_dtype or x.dtype
    if decode:
        return mgpu_gemv_w4.w4a16_gemv_mosaic(xq, packed, scale, global_scale, out_dtype=out_dtype, interpret=interpret)
    return mgpu_gemm_nvfp4.w4a16_gemm_mosaic(xq, packed, scale, global_scale, out_dtype=out_dtype,
                                             interpret=interpret, name="w4a4_gemm")


def _mosaic_supports(x, packed, scale, global_scale, input_scale=None, *, out_dtype=None, decode=False, **_) -> bool:
    N, K = packed.shape[0], 2 * packed.shape[1]
    if decode:
        return mgpu_gemv.supports("w4a16_gemv", N, K, x.dtype)
    return mgpu_gemm_nvfp4.supports_shape(N, K, x.dtype, out_dtype or x.dtype)


registry.register("w4a4_gemm", reference=w4a4_reference, pallas=w4a4_gemm_pallas, mosaic=w4a4_gemm_mosaic,
                  mosaic_supports=_mosaic_supports, gpu_default="mosaic", grad_wrt=registry.ACTIVATIONS)
