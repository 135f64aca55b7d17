"""W4A4: NVFP4 weights with NVFP4 activations, quantized on the fly per 16 along K.

Hopper has no FP4 math, so both operands are dequantized: the activations are quantized and
dequantized in one XLA pass (global scale: the checkpoint's input_scale, else per row amax / (6 * 448),
so a row never depends on the rest of the batch), then the W4A16 kernel runs on them. The reference
does the same activation pass and then dequantize-then-matmul.

w4a4_gemm(x, packed, scale, global_scale, input_scale=None, *, decode=False): `decode` picks the
GEMV tiles (16-row blocks, independent of M, for decode steps) instead of the prefill GEMM tiles.
"""

from __future__ import annotations

import jax.numpy as jnp

from metrale_jax.weights.quant_formats import nvfp4_activation_global, nvfp4_fake_quant
from pallas_kernels import registry
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


registry.register("w4a4_gemm", reference=w4a4_reference, pallas=w4a4_gemm_pallas)
