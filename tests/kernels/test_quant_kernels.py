"""Quantized projection kernels (W8A16, W4A16, FP8 GEMMs, W4A4) against their dequantize-then-matmul
references, and the references against float64 numpy. Interpret mode on the CPU, compiled on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.errors import ShapeError
from metrale_jax.weights import quant_formats as qf
from pallas_kernels import fp8_gemm, registry, w4a4, w4a16, w8a16
from pallas_kernels.w4a16 import W4Blocks
from pallas_kernels.w8a16 import QuantBlocks
from tests.numpy_refs import rel_err

M, N, K = 5, 200, 320          # ragged on purpose: N and K are not multiples of the tiles


def _x(rng, m=M, k=K, dtype=jnp.bfloat16):
    return jnp.asarray(rng.standard_normal((m, k)), dtype)


def _w(rng, n=N, k=K):
    return (rng.standard_normal((n, k)) * rng.uniform(0.1, 3.0, (n, 1))).astype(np.float32)


def _f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _fp8_args(rng):
    q, s = qf.quantize_fp8_block(_w(rng))
    return jnp.asarray(q), jnp.asarray(s)


def _nvfp4_args(rng):
    p, s, g = qf.quantize_nvfp4(_w(rng))
    return jnp.asarray(p), jnp.asarray(s), jnp.asarray(g)


def _finite(y):
    assert np.all(np.isfinite(np.asarray(y, np.float32)))     # interpret mode starts outputs as NaN


# ---- references against float64 numpy ------------------------------------------------------------------
def test_w8a16_reference_against_numpy(rng):
    x, (q, s) = _x(rng), _fp8_args(rng)
    wd = _f64(q) * np.repeat(np.repeat(np.asarray(s, np.float64), 128, 0), 128, 1)[:N, :K]
    want = _f64(x) @ wd.T
    assert rel_err(w8a16.w8a16_reference(x, q, s, out_dtype=jnp.float32), want) < 1e-6


def test_w4a16_reference_against_numpy(rng):
    x, (p, s, g) = _x(rng), _nvfp4_args(rng)
    codes = np.stack([np.asarray(p) & 15, np.asarray(p) >> 4], -1).reshape(N, K)
    wd = qf.E2M1_VALUES[codes].astype(np.float64) * np.repeat(_f64(s), 16, 1) * float(g)
    want = _f64(x) @ wd.T
    assert rel_err(w4a16.w4a16_reference(x, p, s, g, out_dtype=jnp.float32), want) < 1e-6
    assert rel_err(w4a16.w4a16_t_reference(x, p.T, s.T, g, out_dtype=jnp.float32), want) < 1e-6


def test_fp8_activation_references_quantize_activations(rng):
    """The FP8 matrix-unit references see E4M3-rounded activations: ~2% off the exact product, not 0."""
    x, (q, s) = _x(rng), _fp8_args(rng)
    exact = w8a16.w8a16_reference(x, q, s, out_dtype=jnp.float32)
    pipelined = w8a16.w8a16_pipelined_reference(x, q, s, out_dtype=jnp.float32)
    assert 1e-4 < rel_err(pipelined, exact) < 0.05
    xq, xs = qf.quantize_rows_fp8_blocks(x)
    assert xq.dtype == jnp.float8_e4m3fn and xs.shape == (M, 3)
    assert np.all(np.abs(_f64(xq)) <= 448)
    np.testing.assert_allclose(np.abs(_f64(xq)).reshape(M, -1).max(1), 448.0)  # each row's block 0 hits 448


# ---- kernels against references ----------------------------------------------------------------------------
W8 = [("w8a16_gemv", w8a16.w8a16_gemv_pallas, w8a16.w8a16_reference, None),
      ("w8a16_gemv", w8a16.w8a16_gemv_pallas, w8a16.w8a16_reference, QuantBlocks(16, 32, 64, split_k=5)),
      ("w8a16_gemv", w8a16.w8a16_gemv_pallas, w8a16.w8a16_reference, QuantBlocks(16, 64, 128, swap=False)),
      ("w8a16_gemm", w8a16.w8a16_gemm_pallas, w8a16.w8a16_reference, None),
      ("w8a16_gemm_pipelined", w8a16.w8a16_gemm_pipelined_pallas, w8a16.w8a16_pipelined_reference, None),
      ("w8a16_gemm_pipelined", w8a16.w8a16_gemm_pipelined_pallas, w8a16.w8a16_pipelined_reference,
       QuantBlocks(64, 128, 128, num_warps=4, swap=True))]


@pytest.mark.parametrize("name,fn,ref,blocks", W8, ids=lambda v: v if isinstance(v, str) else "")
def test_w8a16_kernels(rng, interpret, name, fn, ref, blocks):
    x, (q, s) = _x(rng), _fp8_args(rng)
    y = fn(x, q, s, out_dtype=jnp.float32, interpret=interpret, blocks=blocks)
    _finite(y)
    assert y.shape == (M, N) and y.dtype == jnp.float32
    assert rel_err(y, ref(x, q, s, out_dtype=jnp.float32)) < 1e-5


def test_w8a16_gemv_float32_activations(rng, interpret):
    x, (q, s) = _x(rng, dtype=jnp.float32), _fp8_args(rng)
    y = w8a16.w8a16_gemv_pallas(x, q, s, interpret=interpret)
    assert y.dtype == jnp.float32 and rel_err(y, w8a16.w8a16_reference(x, q, s)) < 1e-5


@pytest.mark.parametrize("swap", [False, True])
def test_fp8_gemm_t(rng, interpret, swap):
    x = _x(rng)
    q, s = (jnp.asarray(a) for a in qf.quantize_fp8_rows(_w(rng)))
    y = fp8_gemm.fp8_gemm_t_pallas(x, q, s, out_dtype=jnp.float32, interpret=interpret,
                                   blocks=QuantBlocks(64, 64, 128, num_warps=4, swap=swap))
    _finite(y)
    assert rel_err(y, fp8_gemm.fp8_gemm_t_reference(x, q, s, out_dtype=jnp.float32)) < 1e-5


@pytest.mark.parametrize("group", [None, 128, 256])
def test_fp8_arms_take_producer_quantized_activations(rng, interpret, group):
    """Fp8Activations per row or per group of columns (scales 1e-2..1e2 apart, so a scale applied to the wrong
    columns shows) into both Triton FP8 arms, against float64 numpy of the dequantized operands."""
    k = 512
    x = _x(rng, k=k) * jnp.asarray(10.0 ** rng.uniform(-2, 2, (1, k // 128)).repeat(128, 1), jnp.bfloat16)
    if group is None:
        xa = qf.Fp8Activations(*qf.quantize_rows_fp8(x), jnp.dtype(jnp.bfloat16))
    else:
        xa = qf.Fp8Activations(*qf.quantize_rows_fp8_blocks(x, group), jnp.dtype(jnp.bfloat16), group)
    xd = _f64(xa.dequantize())
    qr, sr = qf.quantize_fp8_rows(_w(rng, k=k))
    y = fp8_gemm.fp8_gemm_t_pallas(xa, jnp.asarray(qr), jnp.asarray(sr), out_dtype=jnp.float32,
                                   interpret=interpret, blocks=QuantBlocks(16, 64, 128, num_warps=4, swap=True))
    _finite(y)
    assert y.dtype == jnp.float32 and rel_err(y, xd @ (qr.astype(np.float64) * sr[:, None]).T) < 1e-5
    qb, sb = qf.quantize_fp8_block(_w(rng, k=k))
    y = w8a16.w8a16_gemm_pipelined_pallas(xa, jnp.asarray(qb), jnp.asarray(sb), out_dtype=jnp.float32,
                                          interpret=interpret)
    _finite(y)
    assert rel_err(y, xd @ qf.dequantize_fp8_block(qb, sb).astype(np.float64).T) < 1e-5


def test_fp8_activations_errors(rng):
    x = _x(rng, k=256)
    q, s = qf.quantize_rows_fp8_blocks(x, 256)
    qr, sr = (jnp.asarray(a) for a in qf.quantize_fp8_rows(_w(rng, k=256)))
    with pytest.raises(ShapeError, match=r"scale float32 \[5, 2\] \(per row per 128 columns\)"):
        fp8_gemm.fp8_gemm_t_pallas(qf.Fp8Activations(q, s), qr, sr, interpret=True)      # group left at 128
    with pytest.raises(ShapeError, match="group must be a positive multiple of 128 columns, got 64"):
        fp8_gemm.fp8_gemm_t_pallas(qf.Fp8Activations(q, jnp.repeat(s, 4, 1), group=64), qr, sr, interpret=True)
    with pytest.raises(ShapeError, match="expected q float8_e4m3fn"):
        fp8_gemm.fp8_gemm_t_pallas(qf.Fp8Activations(q.astype(jnp.bfloat16), s, group=256), qr, sr, interpret=True)


W4 = [("w4a16_gemv", w4a16.w4a16_gemv_pallas, False, None),
      ("w4a16_gemv", w4a16.w4a16_gemv_pallas, False, W4Blocks(16, 32, 64, split_k=5)),
      ("w4a16_gemv", w4a16.w4a16_gemv_pallas, False, W4Blocks(16, 64, 128, swap=False)),
      ("w4a16_gemm", w4a16.w4a16_gemm_pallas, False, W4Blocks(64, 64, 64, swap=True)),
      ("w4a16_gemm", w4a16.w4a16_gemm_pallas, False, None),
      ("w4a16_gemm_t", w4a16.w4a16_gemm_t_pallas, True, None),
      ("w4a16_gemm_t_m128", w4a16.w4a16_gemm_t_m128_pallas, True, None)]


@pytest.mark.parametrize("name,fn,transposed,blocks", W4, ids=lambda v: v if isinstance(v, str) else "")
def test_w4a16_kernels(rng, interpret, name, fn, transposed, blocks):
    x, (p, s, g) = _x(rng), _nvfp4_args(rng)
    args = (p.T, s.T) if transposed else (p, s)
    y = fn(x, *args, g, out_dtype=jnp.float32, interpret=interpret, blocks=blocks)
    _finite(y)
    assert rel_err(y, w4a16.w4a16_reference(x, p, s, g, out_dtype=jnp.float32)) < 1e-5


@pytest.mark.gpu
def test_w4a16_asm_decode_on_gpu(rng):
    """The PTX nibble decoder gives the arithmetic decoder's numbers (every code and scale exercised)."""
    x = _x(rng, k=512)
    p, s, g = (jnp.asarray(a) for a in qf.quantize_nvfp4(_w(rng, k=512)))
    ref = w4a16.w4a16_reference(x, p, s, g, out_dtype=jnp.float32)
    for blk in (W4Blocks(16, 64, 256, decode="asm", swap=True), W4Blocks(64, 128, 128, decode="asm")):
        assert rel_err(w4a16.w4a16_gemv_pallas(x, p, s, g, out_dtype=jnp.float32, blocks=blk), ref) < 1e-5
    t = W4Blocks(64, 128, 128, decode="asm")
    assert rel_err(w4a16.w4a16_gemm_t_pallas(x, p.T, s.T, g, out_dtype=jnp.float32, blocks=t), ref) < 1e-5


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_w4a4(rng, interpret, decode, static):
    x, (p, s, g) = _x(rng), _nvfp4_args(rng)
    inp = jnp.float32(float(np.abs(np.asarray(x, np.float32)).max()) / (6 * 448)) if static else None
    ref = w4a4.w4a4_reference(x, p, s, g, inp, out_dtype=jnp.float32)
    y = w4a4.w4a4_gemm_pallas(x, p, s, g, inp, out_dtype=jnp.float32, decode=decode, interpret=interpret)
    _finite(y)
    assert rel_err(y, ref) < 1e-5
    w4 = w4a16.w4a16_reference(x, p, s, g, out_dtype=jnp.float32)
    assert 1e-3 < rel_err(ref, w4) < 0.3          # the activations really were quantized


@pytest.mark.parametrize("m,decode", [(3, True), (40, True), (70, False)])
def test_w4a4_mosaic_arm(rng, interpret, m, decode):
    """The Mosaic arm (compiled on a GPU, GPU interpret mode on the CPU): the same activation pass and result as
    the reference, decode through the Mosaic GEMV (M = 40: several x tiles per CTA), prefill through the Mosaic
    NVFP4 GEMM on the plain layout; calls they do not take go to the Triton arm."""
    x, (p, s, g) = _x(rng, m=m, k=512), (jnp.asarray(a) for a in qf.quantize_nvfp4(_w(rng, n=128, k=512)))
    try:
        y = w4a4.w4a4_gemm_mosaic(x, p, s, g, out_dtype=jnp.float32, decode=decode, interpret=interpret)
    finally:
        if interpret:
            from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state
            reset_gpu_interpret_mode_state()
    _finite(y)
    assert y.shape == (m, 128) and rel_err(y, w4a4.w4a4_reference(x, p, s, g, out_dtype=jnp.float32)) < 1e-5
    spec = registry._KERNELS["w4a4_gemm"]
    assert spec.gpu_default == "mosaic"
    assert spec.mosaic_supports(x, p, s, g, None, decode=decode)
    assert not spec.mosaic_supports(x.astype(jnp.float32), p, s, g, decode=decode)   # f32 x: Triton
    assert spec.mosaic_supports(x[:, :256], p[:, :128], s[:, :16], g, decode=decode) is (not decode)  # K = 256
    assert not spec.mosaic_supports(x, p[:64], s[:64], g, decode=False)              # N % 128 != 0: Triton


def test_w4a4_activation_pass_same_bits_jitted_and_eager(rng):
    """The W4A4 activation pass gives the same bits op by op (the graph-veto path) and jitted: on the GPU XLA may
    fold a convert round trip in jitted code, which once made the two differ by an E4M3 step per group."""
    x = _x(rng, m=16, k=8192) * 3
    eager = np.asarray(w4a4.quantize_activations_nvfp4(x), np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(w4a4.quantize_activations_nvfp4)(x), np.float32), eager)
    inp = jnp.float32(0.01)
    np.testing.assert_array_equal(np.asarray(jax.jit(w4a4.quantize_activations_nvfp4)(x, inp), np.float32),
                                  np.asarray(w4a4.quantize_activations_nvfp4(x, inp), np.float32))


def test_gemv_row_does_not_depend_on_batch(rng, interpret):
    """Decode tiles never depend on M: row 0 alone and inside 7 rows are bit-identical."""
    x, (q, s), (p, s4, g) = _x(rng, m=7), _fp8_args(rng), _nvfp4_args(rng)
    for fn, args in ((w8a16.w8a16_gemv_pallas, (q, s)), (w4a16.w4a16_gemv_pallas, (p, s4, g))):
        one = fn(x[:1], *args, interpret=interpret)
        many = fn(x, *args, interpret=interpret)
        np.testing.assert_array_equal(np.asarray(one, np.float32), np.asarray(many[:1], np.float32))


# ---- argument errors ------------------------------------------------------------------------------------
def test_kernel_argument_errors(rng):
    x, (q, s), (p, s4, g) = _x(rng), _fp8_args(rng), _nvfp4_args(rng)
    with pytest.raises(ShapeError, match=r"w8a16_gemv: scale expected float32\[2, 3\]"):
        w8a16.w8a16_gemv_pallas(x, q, s[:1], interpret=True)
    with pytest.raises(ShapeError, match="w8a16_gemm: w expected float8_e4m3fn"):
        w8a16.w8a16_gemm_pallas(x, q.astype(jnp.bfloat16), s, interpret=True)
    with pytest.raises(ShapeError, match=r"x expected shape \[M, 320\]"):
        w8a16.w8a16_gemv_pallas(x[:, :64], q, s, interpret=True)
    with pytest.raises(ShapeError, match="w4a16_gemv: scale expected float8_e4m3fn"):
        w4a16.w4a16_gemv_pallas(x, p, s4.astype(jnp.float32), g, interpret=True)
    with pytest.raises(ShapeError, match="packed weight expected uint8"):
        w4a16.w4a16_gemm_t_pallas(x, p.T.astype(jnp.int8), s4.T, g, interpret=True)
    with pytest.raises(ShapeError, match="fp8_gemm_t: scale expected float32"):
        fp8_gemm.fp8_gemm_t_pallas(x, q, s, interpret=True)
    with pytest.raises(ShapeError, match="split_k=2 does not divide"):
        w8a16.w8a16_gemv_pallas(x, q, s, interpret=True, blocks=QuantBlocks(16, 64, 128, split_k=2))


def test_every_quant_kernel_registered():
    names = ("w8a16_gemv", "w8a16_gemm", "w8a16_gemm_pipelined", "w4a16_gemv", "w4a16_gemm", "w4a16_gemm_t",
             "w4a16_gemm_t_m128", "fp8_gemm_t", "w4a4_gemm")
    for n in names:
        assert registry.resolve(n, "interpret").impl == "interpret"
        assert registry.resolve(n, "reference").impl == "reference"
        assert registry.resolve(n, "triton", platform="gpu").impl == "pallas"          # every one has a Triton arm
        default = registry._KERNELS[n].gpu_default
        assert registry.resolve(n, "pallas", platform="gpu").impl == ("mosaic" if default == "mosaic" else "pallas")
    if jax.default_backend() == "cpu":
        assert all(registry.resolve(n, "auto").impl == "reference" for n in names)
