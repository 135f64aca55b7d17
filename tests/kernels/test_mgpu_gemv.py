"""Mosaic GPU arms of w8a16_gemv / w4a16_gemv (pallas_kernels/mgpu_gemv.py) against their dequantize-then-matmul
references: GPU interpret mode on the CPU at tiny shapes (outputs start as NaN there), compiled on a GPU at the
8B shapes. Rows must be batch-invariant: a row's result is bit-identical whatever M."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.errors import ShapeError
from metrale_jax.weights import quant_formats as qf
from pallas_kernels import mgpu_gemv as mg
from pallas_kernels import registry, w4a16, w8a16
from pallas_kernels.mgpu_gemv import GemvConfig
from tests.numpy_refs import rel_err

F32 = jnp.float32


@pytest.fixture(autouse=True)
def _reset_interpreter():
    """The GPU interpreter keeps global state that an exception leaves dirty."""
    yield
    if jax.default_backend() != "gpu":
        from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state
        reset_gpu_interpret_mode_state()


def _x(rng, m, k):
    return jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)


def _w(rng, n, k):
    return (rng.standard_normal((n, k)) * rng.uniform(0.1, 3.0, (n, 1))).astype(np.float32)


def _fp8(rng, n, k):
    return tuple(jnp.asarray(a) for a in qf.quantize_fp8_block(_w(rng, n, k)))


def _nvfp4(rng, n, k):
    return tuple(jnp.asarray(a) for a in qf.quantize_nvfp4(_w(rng, n, k)))


def _finite(y):
    assert np.all(np.isfinite(np.asarray(y, np.float32)))


# (M, N, K, config): N = 192 with 128-row tiles leaves a half-empty last tile; M = 17 pads x rows to 24;
# split_k=2 takes the float32-partials output path, bf16 outputs the direct (transposed-store) path.
W8_CASES = [(3, 192, 384, GemvConfig(64, 2)),
            (5, 192, 512, GemvConfig(128, 3, 2)),
            (17, 128, 256, GemvConfig(64, 4, load="direct"))]


@pytest.mark.parametrize("M,N,K,config", W8_CASES, ids=lambda v: str(v))
def test_w8a16_mosaic_matches_reference(rng, interpret, M, N, K, config):
    x, (q, s) = _x(rng, M, K), _fp8(rng, N, K)
    ref = w8a16.w8a16_reference(x, q, s, out_dtype=F32)
    y = mg.w8a16_gemv_mosaic(x, q, s, out_dtype=F32, interpret=interpret, config=config)
    _finite(y)
    assert y.shape == (M, N) and y.dtype == F32
    assert rel_err(y, ref) < 1e-5
    yb = mg.w8a16_gemv_mosaic(x, q, s, interpret=interpret, config=config)      # bf16 out (direct when no split)
    _finite(yb)
    assert yb.dtype == jnp.bfloat16 and rel_err(yb, ref) < 4e-3


W4_CASES = [(3, 192, 1024, GemvConfig(128, 2)),
            (6, 128, 1024, GemvConfig(64, 1, 2, load="direct")),
            (17, 64, 512, GemvConfig(64, 2))]


@pytest.mark.parametrize("M,N,K,config", W4_CASES, ids=lambda v: str(v))
def test_w4a16_mosaic_matches_reference(rng, interpret, M, N, K, config):
    x, (p, s, g) = _x(rng, M, K), _nvfp4(rng, N, K)
    ref = w4a16.w4a16_reference(x, p, s, g, out_dtype=F32)
    y = mg.w4a16_gemv_mosaic(x, p, s, g, out_dtype=F32, interpret=interpret, config=config)
    _finite(y)
    assert y.shape == (M, N) and rel_err(y, ref) < 1e-5
    yb = mg.w4a16_gemv_mosaic(x, p, s, g, interpret=interpret, config=config)
    _finite(yb)
    assert yb.dtype == jnp.bfloat16 and rel_err(yb, ref) < 4e-3


def test_every_e2m1_code_and_scale_decodes(rng, interpret):
    """All 16 codes in both nibbles, scales across the E4M3 range (subnormals included), one-hot activations:
    each output is one dequantized weight times the global scale, so it must match exactly."""
    N, K = 64, 512
    packed = jnp.asarray(rng.integers(0, 256, (N, K // 2)), jnp.uint8)
    sv = np.concatenate([2.0 ** np.arange(-9, 9), rng.uniform(0.002, 448, 14)])           # 32 groups
    scale = jnp.asarray(np.tile(sv, (N, 1)), F32).astype(jnp.float8_e4m3fn)
    g = jnp.float32(0.75)
    cols = rng.choice(K, 16, replace=False)
    x = jnp.zeros((16, K), jnp.bfloat16).at[np.arange(16), cols].set(1.0)
    y = mg.w4a16_gemv_mosaic(x, packed, scale, g, out_dtype=F32, interpret=interpret, config=GemvConfig(64, 1))
    want = np.asarray(qf.dequantize_nvfp4(packed, scale, g))[:, cols].T
    np.testing.assert_array_equal(np.asarray(y), want)


@pytest.mark.parametrize("kernel", ["w8a16", "w4a16"])
def test_rows_are_batch_invariant(rng, interpret, kernel):
    """Row i of an M=16 (and M=3) batch is bit-identical to the same row computed alone."""
    N, K = 128, 512
    x16 = _x(rng, 16, K)
    if kernel == "w8a16":
        args = _fp8(rng, N, K)
        run = lambda x: mg.w8a16_gemv_mosaic(x, *args, out_dtype=F32, interpret=interpret)
    else:
        args = _nvfp4(rng, N, K)
        run = lambda x: mg.w4a16_gemv_mosaic(x, *args, out_dtype=F32, interpret=interpret)
    y16, y3 = np.asarray(run(x16)), np.asarray(run(x16[5:8]))
    for i in (0, 6, 15):
        np.testing.assert_array_equal(np.asarray(run(x16[i:i + 1]))[0], y16[i])
    np.testing.assert_array_equal(y3, y16[5:8])


def test_no_races_in_the_pipeline(rng):
    """The interpreter's happens-before race detector over a multi-step, multi-stage call."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if jax.default_backend() == "gpu":
        pytest.skip("interpret-mode check")
    x, (q, s) = _x(rng, 2, 512), _fp8(rng, 64, 512)
    y = mg.w8a16_gemv_mosaic(x, q, s, out_dtype=F32, interpret=plgpu.InterpretGPUParams(detect_races=True),
                             config=GemvConfig(64, 2))
    assert rel_err(y, w8a16.w8a16_reference(x, q, s, out_dtype=F32)) < 1e-5
    assert not get_races().races_found


def test_bad_inputs_raise_typed_errors(rng):
    x, (q, s) = _x(rng, 2, 256), _fp8(rng, 128, 256)
    with pytest.raises(ShapeError, match="K % 128"):
        mg.w8a16_gemv_mosaic(_x(rng, 2, 320), *_fp8(rng, 128, 320))
    with pytest.raises(ShapeError, match="N % 64"):
        mg.w8a16_gemv_mosaic(x, *_fp8(rng, 200, 256))
    with pytest.raises(ShapeError, match="x expected bfloat16"):
        mg.w8a16_gemv_mosaic(x.astype(F32), q, s)
    with pytest.raises(ShapeError, match="scale expected"):
        mg.w8a16_gemv_mosaic(x, q, s[:, :1])
    with pytest.raises(ShapeError, match="block_n"):
        mg.w8a16_gemv_mosaic(x, q, s, config=GemvConfig(block_n=32))
    with pytest.raises(ShapeError, match="split_k=3"):
        mg.w8a16_gemv_mosaic(x, q, s, config=GemvConfig(split_k=3), interpret=True)
    p, s4, g = _nvfp4(rng, 64, 768)
    with pytest.raises(ShapeError, match="K % 512"):
        mg.w4a16_gemv_mosaic(_x(rng, 2, 768), p, s4, g)
    with pytest.raises(ShapeError, match="scale expected"):
        mg.w4a16_gemv_mosaic(_x(rng, 2, 768), p, s4.astype(F32), g)


def test_registry_serves_the_mosaic_arm():
    for name, fn in (("w8a16_gemv", mg.w8a16_gemv_mosaic), ("w4a16_gemv", mg.w4a16_gemv_mosaic)):
        res = registry.resolve(name, "mosaic", platform="gpu")
        assert res.impl == "mosaic" and res.fn.func is fn
        assert registry.resolve(name, "triton", platform="gpu").impl == "pallas"
        assert registry.resolve(name, "auto", platform="cpu").impl == "reference"
        with pytest.raises(Exception, match="no mosaic implementation"):
            registry.resolve(name, "mosaic", platform="cpu")
    # GPU defaults from the H200 benchmark: Mosaic won w8a16_gemv, Triton kept w4a16_gemv.
    assert registry.resolve("w8a16_gemv", "auto", platform="gpu").impl == "mosaic"
    assert registry.resolve("w4a16_gemv", "auto", platform="gpu").impl == "pallas"


def test_supports_matches_the_typed_errors():
    assert mg.supports("w8a16_gemv", 18560, 4096, jnp.bfloat16) and mg.supports("w4a16_gemv", 4096, 8192, jnp.bfloat16)
    assert not mg.supports("w8a16_gemv", 200, 256, jnp.bfloat16)
    assert not mg.supports("w8a16_gemv", 128, 320, jnp.bfloat16)
    assert not mg.supports("w4a16_gemv", 64, 768, jnp.bfloat16)
    assert not mg.supports("w8a16_gemv", 128, 256, jnp.float32)


def test_split_k_partials_sum_in_a_fixed_order():
    """The split-K epilogue adds partials as ((p0 + p1) + p2) + p3 for every M (no shape-dependent reduce)."""
    rng = np.random.default_rng(0)
    parts = jnp.asarray(rng.standard_normal((4, 64, 16)), F32)
    want = (((parts[0] + parts[1]) + parts[2]) + parts[3]).T
    for m in (1, 4, 16):
        np.testing.assert_array_equal(np.asarray(mg._finish(parts, False, m, F32)), np.asarray(want[:m]))


# ---- compiled on the GPU at the 8B shapes ------------------------------------------------------------------------
SHAPES_8B = [(18560, 4096), (4096, 8192)]


@pytest.mark.gpu
@pytest.mark.parametrize("widen", ["ptx", "jnp"])
@pytest.mark.parametrize("N,K", SHAPES_8B)
def test_w8a16_mosaic_8b_shapes_on_gpu(rng, N, K, widen):
    (q, s) = _fp8(rng, N, K)
    x16 = _x(rng, 16, K)
    cfg = dataclasses.replace(mg.w8a16_gemv_blocks(N, K), widen=widen)
    y16 = mg.w8a16_gemv_mosaic(x16, q, s, out_dtype=F32, config=cfg)
    assert rel_err(y16, w8a16.w8a16_reference(x16, q, s, out_dtype=F32)) < 1e-5
    for m in (1, 4):
        np.testing.assert_array_equal(np.asarray(mg.w8a16_gemv_mosaic(x16[:m], q, s, out_dtype=F32, config=cfg)),
                                      np.asarray(y16[:m]))
    yb = mg.w8a16_gemv_mosaic(x16, q, s, config=cfg)
    np.testing.assert_array_equal(np.asarray(mg.w8a16_gemv_mosaic(x16[3:4], q, s, config=cfg)), np.asarray(yb[3:4]))
    assert rel_err(yb, y16) < 4e-3


@pytest.mark.gpu
def test_ptx_widening_is_exact_for_every_e4m3_code():
    """All 256 E4M3 codes (NaN codes excepted) through the PTX widening: one-hot x picks single weights."""
    n, k = np.meshgrid(np.arange(128), np.arange(128), indexing="ij")
    w = jnp.asarray(((k + 16 * n) % 256).astype(np.uint8)).view(jnp.float8_e4m3fn)   # rows 0-15, cols 0-15: all codes
    w = jnp.where(jnp.isnan(w.astype(F32)), jnp.zeros_like(w), w)
    s = jnp.full((1, 1), 0.75, F32)
    x = jnp.eye(16, 128, dtype=jnp.bfloat16)
    for cfg in (GemvConfig(64, 1, widen="ptx"), GemvConfig(128, 1, widen="ptx", load="direct")):
        y = mg.w8a16_gemv_mosaic(x, w, s, out_dtype=F32, config=cfg)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(w.astype(F32)[:, :16].T * 0.75))


@pytest.mark.gpu
@pytest.mark.parametrize("widen", ["ptx", "jnp"])
@pytest.mark.parametrize("N,K", SHAPES_8B)
def test_w4a16_mosaic_8b_shapes_on_gpu(rng, N, K, widen):
    p, s, g = _nvfp4(rng, N, K)
    x16 = _x(rng, 16, K)
    cfg = dataclasses.replace(mg.w4a16_gemv_blocks(N, K), widen=widen)
    y16 = mg.w4a16_gemv_mosaic(x16, p, s, g, out_dtype=F32, config=cfg)
    assert rel_err(y16, w4a16.w4a16_reference(x16, p, s, g, out_dtype=F32)) < 1e-5
    for m in (1, 4):
        np.testing.assert_array_equal(np.asarray(mg.w4a16_gemv_mosaic(x16[:m], p, s, g, out_dtype=F32, config=cfg)),
                                      np.asarray(y16[:m]))
