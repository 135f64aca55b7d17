"""Number formats of the quantized checkpoints: E4M3 (FP8) and E2M1 (FP4), their block scales, packing.

The checkpoint writers (numpy in, numpy out; exact round trips) live here; the format numerics the kernels read
(constants, decoding, block-scale expansion, activation quantization, Fp8Activations) live in
`pallas_kernels.formats` and are re-exported here. Conventions: see `pallas_kernels.formats`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels.formats import (E2M1_MAX, E2M1_MIDPOINTS, E4M3_MAX, FP8_BLOCK, NVFP4_GROUP,  # noqa: F401
                                    Fp8Activations, block_grid, dequantize_nvfp4, e2m1_decode, e2m1_encode_jnp,
                                    expand_block_scale, fp8_dequantized, fp8_groups, nvfp4_activation_global,
                                    nvfp4_fake_quant, nvfp4_global_scale, pack_nibbles, quantize_rows_fp8,
                                    quantize_rows_fp8_blocks, round_e4m3, unpack_nibbles)

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
# value of each 4-bit code: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


# ---- E2M1 codes -------------------------------------------------------------------------------
def e2m1_encode(x: np.ndarray) -> np.ndarray:
    """Round float values (already divided by their scale) to E2M1 codes, ties to even; saturates at 6. Negative
    values keep the sign bit even when they round to zero (code 8, -0), as ModelOpt's exporter writes them."""
    x = np.asarray(x, np.float32)
    mag = np.abs(x)
    code = np.zeros(x.shape, np.uint8)
    for c, t in enumerate(E2M1_MIDPOINTS):
        code += (mag > t) if c % 2 == 0 else (mag >= t)
    return code | (x < 0).astype(np.uint8) << 3


# ---- FP8 ---------------------------------------------------------------------------------------
def quantize_fp8_block(w, block: int = FP8_BLOCK):
    """[N, K] float -> (E4M3 [N, K], f32 scale [ceil(N/b), ceil(K/b)]) with w ~ q * scale.
    numpy in, numpy out; a jax array is quantized on its device (the benchmarks' 8B random weights)."""
    xp = jnp if isinstance(w, jax.Array) else np
    w = xp.asarray(w, xp.float32)
    n, k = w.shape
    nb, kb = block_grid(n, k, block)
    pad = xp.pad(xp.abs(w), ((0, nb * block - n), (0, kb * block - k)))
    amax = pad.reshape(nb, block, kb, block).max(axis=(1, 3))
    scale = xp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(xp.float32)
    q = xp.clip(w / expand_block_scale(scale, n, k, block), -E4M3_MAX, E4M3_MAX).astype(E4M3)
    return q, scale


def quantize_fp8_tensor(w: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """[N, K] float -> (E4M3 [N, K], f32 scalar scale), ModelOpt FP8 per-tensor."""
    w = np.asarray(w, np.float32)
    amax = float(np.abs(w).max()) if w.size else 0.0
    scale = np.float32(amax / E4M3_MAX if amax > 0 else 1.0)
    return np.clip(w / scale, -E4M3_MAX, E4M3_MAX).astype(E4M3), scale


def quantize_fp8_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, K] float -> (E4M3 [N, K], f32 scale per row [N]); the pre-dequantized prefill copy."""
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    return np.clip(w / scale[:, None], -E4M3_MAX, E4M3_MAX).astype(E4M3), scale


def dequantize_fp8_block(q, scale):
    n, k = q.shape
    xp = jnp if isinstance(q, jax.Array) else np
    return q.astype(xp.float32) * expand_block_scale(scale, n, k)


# ---- NVFP4 -------------------------------------------------------------------------------------
def quantize_nvfp4(w, global_scale: float | None = None):
    """[N, K] float (K % 16 == 0) -> (packed uint8 [N, K/2], E4M3 scale [N, K/16], f32 global).

    ModelOpt's recipe bit for bit: group scale amax / (6 g) (one division by the product, as the activation pass
    `nvfp4_fake_quant` does), 1.0 for an all-zero group, then E4M3; codes of w / (scale g), ties to even.
    numpy in, numpy out; a jax array is quantized on its device (the benchmarks' 8B random weights).
    """
    xp = jnp if isinstance(w, jax.Array) else np
    w = xp.asarray(w, xp.float32)
    n, k = w.shape
    if k % NVFP4_GROUP:
        raise ValueError(f"quantize_nvfp4: K={k} is not a multiple of {NVFP4_GROUP}")
    if global_scale is not None:
        g = xp.float32(global_scale) if xp is np else jnp.asarray(global_scale, jnp.float32)
    elif xp is np:
        g = nvfp4_global_scale(float(np.abs(w).max()) if w.size else 0.0)
    else:
        g = nvfp4_global_scale(jnp.max(jnp.abs(w)))
    groups = w.reshape(n, k // NVFP4_GROUP, NVFP4_GROUP)
    block_scale = xp.abs(groups).max(axis=-1) / (xp.float32(E2M1_MAX) * g)
    block_scale = xp.where(block_scale == 0, xp.float32(1.0), block_scale)
    scale = xp.clip(block_scale, -E4M3_MAX, E4M3_MAX).astype(E4M3 if xp is np else jnp.float8_e4m3fn)
    denom = scale.astype(xp.float32)[..., None] * g
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = xp.where(denom > 0, groups / xp.where(denom > 0, denom, 1.0), 0.0)
    codes = (e2m1_encode if xp is np else e2m1_encode_jnp)(scaled).reshape(n, k)
    return pack_nibbles(codes), scale, g
