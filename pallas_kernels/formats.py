"""Number formats the kernels read and their references use: E4M3 (FP8) and E2M1 (FP4), block scales, packing,
activation quantization at run time.

Pure jnp / numpy functions, no kernels; the library's `weights.quant_formats` re-exports them beside the
checkpoint writers. Conventions, as ModelOpt / DeepSeek checkpoints store them:
- FP8 block-scaled: E4M3 weight [N, K], f32 scale per 128x128 block [ceil(N/128), ceil(K/128)],
  multiplied in (w = q * scale).
- FP8 per-tensor (ModelOpt FP8): E4M3 weight, one f32 `weight_scale`.
- NVFP4: E2M1 codes packed two per byte along K (low nibble = even element) [N, K/2], E4M3 scale
  per 16 elements along K [N, K/16], f32 global scale `weight_scale_2`; w = e2m1 * scale * global.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.errors import ShapeError

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_BLOCK = 128
NVFP4_GROUP = 16
# rounding thresholds between E2M1 magnitude codes c and c+1; ties go to the even code (0, 1.0, 2.0, 4.0)
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def block_grid(n: int, k: int, block: int = FP8_BLOCK) -> tuple[int, int]:
    """Shape of a 128x128 block-scale grid for an [n, k] weight."""
    return math.ceil(n / block), math.ceil(k / block)


# ---- E2M1 codes -------------------------------------------------------------------------------
def e2m1_encode_jnp(x: jax.Array) -> jax.Array:
    """jnp twin of `quant_formats.e2m1_encode` (int32 codes), for quantizing activations at run time."""
    mag = jnp.abs(x.astype(jnp.float32))
    code = jnp.zeros(x.shape, jnp.int32)
    for c, t in enumerate(E2M1_MIDPOINTS):
        code = code + ((mag > t) if c % 2 == 0 else (mag >= t)).astype(jnp.int32)
    return code | jnp.where(x < 0, 8, 0)


def e2m1_decode(codes):
    """E2M1 codes (any integer array, numpy or jnp) -> float32 values.

    Bit trick, no table: the code's bits placed as a float16 bit pattern give value * 2^-14
    (code 1 lands on the f16 subnormal 2^-15 = 0.5 * 2^-14), so one multiply restores the value.
    Triton lowers every step, so the kernels use this same function.
    """
    xp = jnp if isinstance(codes, jax.Array) else np
    c = codes.astype(xp.int32)
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    if xp is np:
        return bits.astype(np.uint16).view(np.float16).astype(np.float32) * np.float32(16384.0)
    f16 = jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)
    return f16.astype(jnp.float32) * 16384.0


def pack_nibbles(codes):
    """[..., K] codes (0..15) -> [..., K/2] uint8, low nibble = even element (numpy or jnp)."""
    xp = jnp if isinstance(codes, jax.Array) else np
    codes = xp.asarray(codes).astype(xp.uint8)
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles: last dimension must be even, got {codes.shape[-1]}")
    return (codes[..., 0::2] & 15) | ((codes[..., 1::2] & 15) << 4)


def unpack_nibbles(packed):
    """[..., K/2] uint8 -> [..., K] codes (numpy or jnp), low nibble = even element."""
    xp = jnp if isinstance(packed, jax.Array) else np
    p = packed.astype(xp.int32)
    both = xp.stack([p & 15, p >> 4], axis=-1)
    return both.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ---- FP8 ---------------------------------------------------------------------------------------
def expand_block_scale(scale, n: int, k: int, block: int = FP8_BLOCK):
    """[ceil(n/b), ceil(k/b)] -> [n, k] (numpy or jnp)."""
    xp = jnp if isinstance(scale, jax.Array) else np
    s = xp.repeat(xp.repeat(scale, block, axis=0), block, axis=1)
    return s[:n, :k]


# ---- NVFP4 -------------------------------------------------------------------------------------
def nvfp4_global_scale(amax):
    """ModelOpt's weight_scale_2: amax / (6 * 448), so the largest block scale lands on 448; 1.0 for amax 0.
    A float gives an np.float32; a jax array (any shape: per tensor or per row) an f32 array on its device."""
    if isinstance(amax, jax.Array):
        return jnp.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), 1.0).astype(jnp.float32)
    return np.float32(amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else 1.0)


def dequantize_nvfp4(packed, scale, global_scale):
    """(packed [N, K/2], E4M3 scale [N, K/16], global) -> f32 [N, K] (numpy or jnp)."""
    xp = jnp if isinstance(packed, jax.Array) else np
    vals = e2m1_decode(unpack_nibbles(packed))
    n, k = vals.shape
    s = scale.astype(xp.float32)
    w = vals.reshape(n, k // NVFP4_GROUP, NVFP4_GROUP) * s[..., None]
    return w.reshape(n, k) * xp.asarray(global_scale, xp.float32)


def round_e4m3(v: jax.Array) -> jax.Array:
    """float32 v (|v| <= 448) -> the nearest E4M3FN value (ties to even) as float32: the same numbers as
    v.astype(float8_e4m3fn).astype(float32), but through reduce_precision and round, which XLA keeps in jitted
    code; XLA GPU may drop a narrowing convert that is converted straight back (excess precision), so that
    round trip gives other numbers jitted on the GPU than op by op."""
    normal = jax.lax.reduce_precision(v, exponent_bits=5, mantissa_bits=3)   # 3 mantissa bits, E4M3's normals
    subnormal = jnp.round(v * 512.0) / 512.0                                 # E4M3 subnormals: steps of 2^-9
    return jnp.where(jnp.abs(v) < 2.0 ** -6, subnormal, normal)


@jax.custom_jvp
def straight_through(x: jax.Array, rounded: jax.Array) -> jax.Array:
    """`rounded` (x quantized and dequantized), differentiated as the identity in x: the straight-through estimator
    of fake-quantized activations. The rounding's own derivative is zero almost everywhere (E2M1 codes), or
    JAX rounds the cotangent through the narrow dtype (a float8 cast passes its cotangent through E4M3: 3 mantissa
    bits), so without it the activations' gradients vanish or lose all but 3 bits."""
    return rounded


@straight_through.defjvp
def _straight_through_jvp(primals, tangents):
    x, rounded = primals
    return rounded, tangents[0].astype(rounded.dtype)


def nvfp4_fake_quant(x: jax.Array, global_scale: jax.Array) -> jax.Array:
    """Quantize-dequantize activations [M, K] to NVFP4 (per 16 along K); global_scale [M] or scalar.

    Returns x's dtype. Each product e2m1 * E4M3 is exact in bfloat16; the global scale is applied
    in float32 before the one rounding. Differentiated straight through (`straight_through`).
    """
    m, k = x.shape
    g = jnp.broadcast_to(jnp.asarray(global_scale, jnp.float32).reshape(-1, 1, 1), (m, 1, 1))
    groups = x.astype(jnp.float32).reshape(m, k // NVFP4_GROUP, NVFP4_GROUP)
    # one division by a product: XLA rewrites a chain (a / 6) / g as a / (6 g) in jitted code, and bf16 inputs put
    # many group scales exactly on an E4M3 midpoint, where that last-bit difference picks the other neighbour
    block = jnp.max(jnp.abs(groups), axis=-1, keepdims=True) / (E2M1_MAX * g)
    s = round_e4m3(jnp.clip(block, -E4M3_MAX, E4M3_MAX))
    denom = s * g
    scaled = jnp.where(denom > 0, groups / jnp.where(denom > 0, denom, 1.0), 0.0)
    q = e2m1_decode(e2m1_encode_jnp(scaled)) * s * g
    return straight_through(x, q.reshape(m, k).astype(x.dtype))


def nvfp4_activation_global(x: jax.Array, input_scale: jax.Array | None) -> jax.Array:
    """Global scale of W4A4 activations: the checkpoint's static input_scale, else per row amax/(6*448).

    Per row (not per tensor) so a row's result never depends on the other rows of the batch.
    """
    if input_scale is not None:
        return jnp.asarray(input_scale, jnp.float32).reshape(())
    return nvfp4_global_scale(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1))


# ---- activation quantization for the FP8 matrix-unit kernels ------------------------------------
def _scaled_rows_fp8(x: jax.Array, block: int | None) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (x / its scale, clipped to the E4M3 range, f32 [M, K]; f32 scale [M, ceil(K/block)], or [M]
    per row when block is None): what the E4M3 quantizers round."""
    if block is None:
        xf = x.astype(jnp.float32)
        amax = jnp.max(jnp.abs(xf), axis=1)
        scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
        return jnp.clip(xf / scale[:, None], -E4M3_MAX, E4M3_MAX), scale
    m, k = x.shape
    kb = math.ceil(k / block)
    xf = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, kb * block - k)))
    amax = jnp.max(jnp.abs(xf.reshape(m, kb, block)), axis=-1)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    q = (xf.reshape(m, kb, block) / scale[..., None]).reshape(m, kb * block)[:, :k]
    return jnp.clip(q, -E4M3_MAX, E4M3_MAX), scale


def quantize_rows_fp8_blocks(x: jax.Array, block: int = FP8_BLOCK) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (E4M3 [M, K], f32 scale [M, ceil(K/block)]): one scale per row per `block` columns."""
    scaled, scale = _scaled_rows_fp8(x, block)
    return scaled.astype(jnp.float8_e4m3fn), scale


def quantize_rows_fp8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (E4M3 [M, K], f32 scale [M]): one scale per row (token)."""
    scaled, scale = _scaled_rows_fp8(x, None)
    return scaled.astype(jnp.float8_e4m3fn), scale


# ---- activations quantized by their producer ------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Activations:
    """Activations already quantized to E4M3 by the kernel that produced them (a fused norm), in the layout
    the FP8-matrix-unit arms read: q E4M3 [M, K]; scale f32 [M] (one per row) or [M, ceil(K/group)] (one per
    row per `group` columns, a multiple of 128: 128 is w8a16_gemm_pipelined's own quantization, a norm group
    what the gated norm's parallel kernel emits). `dtype` is the unquantized activations' dtype (the arms'
    default output dtype); shape / ndim are q's, so shape checks of x apply unchanged."""

    q: jax.Array
    scale: jax.Array
    dtype: jnp.dtype = dataclasses.field(default=jnp.dtype(jnp.bfloat16), metadata=dict(static=True))
    group: int = dataclasses.field(default=FP8_BLOCK, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def ndim(self) -> int:
        return self.q.ndim

    @property
    def width(self) -> int:
        """Columns per scale: K when quantized per row."""
        return self.q.shape[1] if self.scale.ndim == 1 else self.group

    def dequantize(self) -> jax.Array:
        """float32 [M, K]: q times its scales."""
        return fp8_dequantized(self, None)


def _producer_quantized(x: Fp8Activations) -> tuple[jax.Array, jax.Array, int]:
    m, k = x.q.shape
    grouped = x.scale.ndim == 2
    want = (m, math.ceil(k / x.group)) if grouped else (m,)
    if (jnp.dtype(x.q.dtype) != jnp.dtype(jnp.float8_e4m3fn) or jnp.dtype(x.scale.dtype) != jnp.dtype(jnp.float32)
            or tuple(x.scale.shape) != want):
        raise ShapeError(f"x (Fp8Activations): expected q float8_e4m3fn [M, K] and scale float32 {list(want)} "
                         f"({f'per row per {x.group} columns' if grouped else 'per row'}), got q "
                         f"{jnp.dtype(x.q.dtype).name}{list(x.q.shape)}, scale "
                         f"{jnp.dtype(x.scale.dtype).name}{list(x.scale.shape)}")
    if grouped and (x.group <= 0 or x.group % FP8_BLOCK):
        raise ShapeError(f"x (Fp8Activations): group must be a positive multiple of {FP8_BLOCK} columns, "
                         f"got {x.group}")
    return x.q, (x.scale if grouped else x.scale[:, None]), x.width


def fp8_groups(x, group: int | None) -> tuple[jax.Array, jax.Array, int]:
    """(E4M3 [M, K], f32 scale [M, ceil(K/width)], width): bf16 x quantized per row (group None; width K) or
    per row per `group` columns; Fp8Activations as their producer quantized them (per row or per a multiple
    of 128 columns)."""
    if isinstance(x, Fp8Activations):
        return _producer_quantized(x)
    scaled, s, width = _scaled_groups(x, group)
    return scaled.astype(jnp.float8_e4m3fn), s, width


def _scaled_groups(x: jax.Array, group: int | None) -> tuple[jax.Array, jax.Array, int]:
    """(x / its scales clipped to the E4M3 range f32 [M, K], f32 scale [M, ceil(K/width)], width), per row
    (group None; width K) or per row per `group` columns: what fp8_groups rounds to E4M3."""
    scaled, s = _scaled_rows_fp8(x, group)
    return (scaled, s[:, None], x.shape[1]) if group is None else (scaled, s, group)


def _times_scales(v: jax.Array, s: jax.Array, width: int) -> jax.Array:
    """v [M, K] times its scales [M, ceil(K/width)], each over `width` columns."""
    return v * jnp.repeat(s, width, axis=1)[:, :v.shape[1]]


def fp8_dequantized(x, group: int | None) -> jax.Array:
    """float32 [M, K]: x rounded through E4M3 as `fp8_groups` quantizes it (the references' activations);
    bf16 / f32 x is differentiated straight through (`straight_through`)."""
    if isinstance(x, Fp8Activations):
        q, s, width = _producer_quantized(x)
        return _times_scales(q.astype(jnp.float32), s, width)
    # round_e4m3, not a float8 round trip: XLA GPU may drop a narrowing convert converted straight back
    scaled, s, width = _scaled_groups(x, group)
    return straight_through(x, _times_scales(round_e4m3(scaled), s, width))
