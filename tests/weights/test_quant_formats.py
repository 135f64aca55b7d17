"""Number formats: E2M1 codes, nibble packing, FP8 / NVFP4 quantizers and their error bounds."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from metrale_jax.weights import quant_formats as qf
from tests.numpy_refs import rel_err


def test_e2m1_decode_every_code_numpy_and_jnp():
    codes = np.arange(16, dtype=np.uint8)
    want = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    np.testing.assert_array_equal(qf.e2m1_decode(codes), want)
    np.testing.assert_array_equal(np.asarray(qf.e2m1_decode(jnp.asarray(codes))), want)
    assert np.signbit(qf.e2m1_decode(codes)[8])


def test_e2m1_encode_rounds_to_nearest_ties_to_even(rng):
    x = rng.uniform(-7, 7, 4000).astype(np.float32)
    codes = qf.e2m1_encode(x)
    got = qf.E2M1_VALUES[codes]
    grid = qf.E2M1_VALUES[:8]
    nearest = np.min(np.abs(np.abs(x)[:, None] - grid[None, :]), axis=1)
    assert np.all(np.abs(np.abs(got) - np.minimum(np.abs(x), 6)) <= nearest + 1e-7)
    assert np.all((np.sign(got) == np.sign(x)) | (got == 0))
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, 9.0], np.float32)
    np.testing.assert_array_equal(qf.E2M1_VALUES[qf.e2m1_encode(ties)], [0, 1, 1, 2, 2, 4, 4, -1, 6])
    np.testing.assert_array_equal(np.asarray(qf.e2m1_encode_jnp(jnp.asarray(ties))), qf.e2m1_encode(ties))
    zeros = np.array([-0.1, -0.25, -0.0, 0.0, 0.1], np.float32)           # ModelOpt: sign bit iff x < 0
    np.testing.assert_array_equal(qf.e2m1_encode(zeros), [8, 8, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(qf.e2m1_encode_jnp(jnp.asarray(zeros))), [8, 8, 0, 0, 0])
    assert np.all(qf.e2m1_decode(np.array([8])) == 0)


def test_pack_unpack_low_nibble_is_even(rng):
    codes = rng.integers(0, 16, (3, 10)).astype(np.uint8)
    packed = qf.pack_nibbles(codes)
    assert packed.shape == (3, 5)
    np.testing.assert_array_equal(packed[:, 0] & 15, codes[:, 0])
    np.testing.assert_array_equal(packed[:, 0] >> 4, codes[:, 1])
    np.testing.assert_array_equal(qf.unpack_nibbles(packed), codes)
    np.testing.assert_array_equal(np.asarray(qf.unpack_nibbles(jnp.asarray(packed))), codes)


def test_fp8_block_quantization(rng):
    w = rng.standard_normal((200, 300)).astype(np.float32) * rng.uniform(0.01, 10, (200, 1)).astype(np.float32)
    q, s = qf.quantize_fp8_block(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and s.shape == (2, 3) and s.dtype == np.float32
    wd = qf.dequantize_fp8_block(q, s)
    blk = np.abs(w) / qf.expand_block_scale(s, 200, 300)
    assert blk.max() <= 448 * (1 + 1e-6)
    # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 for normal numbers
    big = np.abs(w) > 2 ** -6 * qf.expand_block_scale(s, 200, 300)
    assert np.all(np.abs(wd - w)[big] <= np.abs(w)[big] * 2 ** -4 + 1e-12)
    # on-device quantization (the benchmarks' random 8B weights): same scales up to XLA's division rounding,
    # so the same codes except where a value sits on a rounding boundary
    qj, sj = qf.quantize_fp8_block(jnp.asarray(w))
    assert isinstance(qj, jax.Array) and qj.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(sj), s, rtol=3e-7)
    assert np.mean(np.asarray(qj).view(np.uint8) == q.view(np.uint8)) > 0.999


def test_nvfp4_quantization_error_and_scales(rng):
    w = rng.standard_normal((64, 256)).astype(np.float32)
    packed, scale, g = qf.quantize_nvfp4(w)
    assert packed.shape == (64, 128) and scale.shape == (64, 16) and scale.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_allclose(g, np.abs(w).max() / (6 * 448), rtol=1e-6)
    wd = qf.dequantize_nvfp4(packed, scale, g)
    rel = np.linalg.norm(wd - w) / np.linalg.norm(w)
    assert 0.02 < rel < 0.15                       # NVFP4 on Gaussian weights: ~9%
    # the largest element of each group lands within one E4M3 step of 6 * scale
    gmax = np.abs(w.reshape(64, 16, 16)).max(-1)
    np.testing.assert_allclose(scale.astype(np.float32) * g * 6, gmax, rtol=2 ** -3)
    with pytest.raises(ValueError, match="multiple of 16"):
        qf.quantize_nvfp4(w[:, :40])


def test_nvfp4_fake_quant_matches_weight_quantizer(rng):
    """Activation fake-quant (jnp) and the weight quantizer (numpy) agree when given the same global."""
    x = rng.standard_normal((4, 64)).astype(np.float32)
    for m in range(4):
        p, s, g = qf.quantize_nvfp4(x[m:m + 1])
        want = qf.dequantize_nvfp4(p, s, g)
        got = qf.nvfp4_fake_quant(jnp.asarray(x[m:m + 1]), jnp.float32(g))
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=0)
    per_row = qf.nvfp4_activation_global(jnp.asarray(x), None)
    np.testing.assert_allclose(np.asarray(per_row), np.abs(x).max(1) / (6 * 448), rtol=1e-6)


def test_nvfp4_weight_quantizer_is_modelopts_recipe_at_ties(rng):
    """bf16 weights put group scales amax / (6 g) on E4M3 midpoints for some globals g: there the quantizer must
    divide once by the product (ModelOpt, and the activation pass), not by 6 and then by g; all-zero groups store
    scale 1.0; the jnp path (quantizing on the device) gives the numpy path's bits but at rare ties."""
    w = np.array(jnp.asarray(rng.standard_normal((256, 512)), jnp.bfloat16).astype(jnp.float32))
    w[3, 16:32] = 0.0                                                            # one all-zero group
    amax = np.abs(w.reshape(256, 32, 16)).max(-1)
    e4m3 = lambda v: np.clip(v, 0, 448).astype(qf.E4M3).astype(np.float32)
    for row in range(256):              # a global like W4A4's per-row one (a row's amax / 2688), with ties
        g = np.float32(np.abs(w[row]).max() / np.float32(6 * 448))
        once, twice = e4m3(amax / (np.float32(6) * g)), e4m3(amax / np.float32(6) / g)
        if np.any(once != twice):
            break
    assert np.any(once != twice), "no global among 256 rows put a group scale on an E4M3 midpoint"
    p, s, g2 = qf.quantize_nvfp4(w, global_scale=g)
    got = s.astype(np.float32)
    np.testing.assert_array_equal(got[amax > 0], once[amax > 0])
    assert got[3, 1] == 1.0 and not np.any(qf.unpack_nibbles(p)[3, 16:32] & 7)
    pj, sj, gj = qf.quantize_nvfp4(jnp.asarray(w))               # on the device, the global from the tensor
    pn, sn, gn = qf.quantize_nvfp4(w)
    assert isinstance(pj, jax.Array) and pj.dtype == jnp.uint8 and sj.dtype == jnp.float8_e4m3fn
    np.testing.assert_allclose(float(gj), float(gn), rtol=1e-7)
    # XLA rewrites a division by a broadcast operand as a multiply by its reciprocal (not IEEE): bf16 weights put
    # ~0.1% of the scaled values on an E2M1 midpoint, where that last bit may pick the other code
    assert np.mean(np.asarray(sj).view(np.uint8) == sn.view(np.uint8)) > 0.99
    assert np.mean(np.asarray(pj) == pn) > 0.99


def test_round_e4m3_is_the_e4m3_round_trip_and_survives_jit(rng):
    """Every E4M3 value, every midpoint (ties to even) and its neighbours, random values over the whole range and
    the subnormals: the same numbers as a round trip through float8_e4m3fn; and the jitted activation fake-quant
    keeps an explicit rounding op (XLA GPU may fold a convert pair away, so it must not rely on one)."""
    vals = np.unique(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    vals = vals[np.isfinite(vals)]
    mids = (vals[1:] + vals[:-1]) / 2
    v = np.concatenate([vals, mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf)),
                        rng.uniform(-448, 448, 20000), rng.uniform(-2 ** -5, 2 ** -5, 20000)]).astype(np.float32)
    v = np.clip(v, -448, 448)
    want = v.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(qf.round_e4m3)(jnp.asarray(v))), want)
    for fake_quant in (lambda x: qf.nvfp4_fake_quant(x, 1.0), lambda x: qf.fp8_dequantized(x, 128),
                       lambda x: qf.fp8_dequantized(x, None)):
        hlo = jax.jit(fake_quant).lower(jnp.ones((2, 256), jnp.bfloat16)).as_text("hlo")
        assert "reduce-precision" in hlo and "f8e4m3fn" not in hlo
    x = jnp.asarray(rng.standard_normal((3, 300)) * 5, jnp.bfloat16)
    for group in (None, 128):                      # the same numbers as the E4M3 codes the kernels are handed
        q, s, width = qf.fp8_groups(x, group)
        want = np.asarray(q, np.float32) * np.repeat(np.asarray(s), width, axis=1)[:, :300]
        np.testing.assert_array_equal(np.asarray(jax.jit(qf.fp8_dequantized, static_argnums=1)(x, group)), want)


def test_fp8_activation_quantizers(rng):
    x = jnp.asarray(rng.standard_normal((3, 300)), jnp.bfloat16)
    q, s = qf.quantize_rows_fp8_blocks(x)
    assert q.shape == (3, 300) and s.shape == (3, 3)
    back = np.asarray(q, np.float32) * np.repeat(np.asarray(s), 128, 1)[:, :300]
    assert np.linalg.norm(back - np.asarray(x, np.float32)) / np.linalg.norm(np.asarray(x, np.float32)) < 0.04
    q, s = qf.quantize_rows_fp8(x)
    np.testing.assert_allclose(np.abs(np.asarray(q, np.float32)).max(1), 448)


def test_checked_constructors_build_containers_from_checkpoint_arrays(rng):
    """fp8_weight / nvfp4_weight (weights.containers): the arrays a checkpoint holds become a checked container
    that dequantizes to the tensor quantized; a wrong scale shape or dtype is a WeightFormatError naming it."""
    from metrale_jax.errors import WeightFormatError
    from metrale_jax.weights.containers import fp8_weight, nvfp4_weight

    w = jnp.asarray(rng.standard_normal((256, 384)), jnp.float32)
    q, scale = qf.quantize_fp8_block(w)
    fp8 = fp8_weight("layers.0.in_proj", np.asarray(q), np.asarray(scale), shape=(256, 384))
    assert rel_err(np.asarray(fp8.dequantize(jnp.float32)), np.asarray(w)) < 0.05
    with pytest.raises(WeightFormatError, match=r"layers.0.in_proj: block scale .* \[2, 3\]"):
        fp8_weight("layers.0.in_proj", q, scale[:1])
    packed, s, g = qf.quantize_nvfp4(w)
    nv = nvfp4_weight("layers.0.out_proj", packed, s, g, shape=(256, 384))
    assert rel_err(np.asarray(nv.dequantize(jnp.float32)), np.asarray(w)) < 0.2
    with pytest.raises(WeightFormatError, match="layers.0.out_proj: packed weight must be"):
        nvfp4_weight("layers.0.out_proj", packed, s, g, shape=(256, 512))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_activation_fake_quant_is_differentiated_straight_through(rng, dtype):
    """The E4M3 (per row, per 128 columns) and NVFP4 activation round trips pass the cotangent through unchanged:
    not rounded to E4M3 (what a float8 cast's derivative does) and not stopped at the E2M1 codes (whose derivative
    is zero)."""
    x = jnp.asarray(rng.standard_normal((3, 256)) * rng.uniform(0.1, 10, (3, 1)), dtype)
    r = jnp.asarray(rng.standard_normal((3, 256)), jnp.float32)             # 24 mantissa bits, not E4M3 values
    quantizers = {"e4m3 rows": lambda v: qf.fp8_dequantized(v, None),
                  "e4m3 blocks": lambda v: qf.fp8_dequantized(v, 128),
                  "nvfp4": lambda v: qf.nvfp4_fake_quant(v, qf.nvfp4_activation_global(v, None))}
    for name, fq in quantizers.items():
        out, pull = jax.vjp(fq, x)
        (grad,) = pull(r.astype(out.dtype))
        np.testing.assert_array_equal(np.asarray(grad), np.asarray(r.astype(out.dtype).astype(dtype)), err_msg=name)
        # it rounds (which values: the tests above; under jax.vjp XLA may divide by the scale a last bit apart
        # from a plain call, which moves a value sitting at a rounding midpoint)
        assert not np.array_equal(np.asarray(out, np.float32), np.asarray(x, np.float32)), name
