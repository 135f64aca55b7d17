"""Mosaic GPU prefill GEMMs (pallas_kernels.mgpu_gemm) against the jnp references and float64 numpy.

On the CPU the kernels run in GPU interpret mode (tiny shapes, small tiles, a 2-SM persistent grid so the
tile loop runs more than once per CTA); on a GPU the same tests run compiled (METRALE_TEST_GPU=1)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.errors import ShapeError
from metrale_jax.weights import quant_formats as qf
from pallas_kernels import fp8_gemm, mgpu_gemm, registry, w8a16
from pallas_kernels.mgpu_gemm import MgpuTiles
from tests.numpy_refs import rel_err

K = 256
# interpret mode: np.matmul in f32; compiled: FP8 wgmma accumulation (less than f32 precision) + f32 epilogue
TOL = {True: 1e-5, False: 2e-3}


@pytest.fixture(autouse=True)
def _reset_interpreter():
    yield
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    ipc.reset_gpu_interpret_mode_state()


def _x(rng, m, k=K):
    return jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.2, 4.0, (m, 1)), jnp.bfloat16)


def _w(rng, n, k=K):
    return (rng.standard_normal((n, k)) * rng.uniform(0.1, 3.0, (n, 1))).astype(np.float32)


def _check(y, want, m, n, tol):
    y = np.asarray(jnp.asarray(y, jnp.float32))
    assert y.shape == (m, n)
    assert np.all(np.isfinite(y)), "unwritten (NaN-poisoned) or non-finite outputs"
    assert rel_err(y, want) < tol


# M ragged (padded to the CTA rows inside); tiles small enough for interpret mode; wg_dim both ways
ROW_CASES = [(150, 256, MgpuTiles(64, 64, "m", stages=2, grid_tile_width=2), jnp.float32),
             (100, 192, MgpuTiles(64, 64, "m", stages=3, grid_minor="n", delay_release=1), jnp.bfloat16),
             (64, 256, MgpuTiles(64, 64, "n", stages=2), jnp.float32),
             (100, 512, MgpuTiles(64, 256, "m", stages=3), jnp.bfloat16)]     # the out_proj default's shape


@pytest.mark.parametrize("m,n,tiles,out_dtype", ROW_CASES)
def test_fp8_gemm_t_mosaic(rng, interpret, m, n, tiles, out_dtype):
    x = _x(rng, m)
    q, s = (jnp.asarray(a) for a in qf.quantize_fp8_rows(_w(rng, n)))
    y = mgpu_gemm.fp8_gemm_t_mosaic(x, q, s, out_dtype=out_dtype, interpret=interpret, tiles=tiles)
    assert y.dtype == out_dtype
    ref = fp8_gemm.fp8_gemm_t_reference(x, q, s, out_dtype=jnp.float32)
    tol = TOL[interpret] if out_dtype == jnp.float32 else 1e-2
    _check(y, ref, m, n, tol)


def test_fp8_gemm_t_mosaic_against_numpy(rng, interpret):
    """Independent check in float64: quantized activations (per row) x E4M3 weights (per row)."""
    m, n = 70, 128
    x = _x(rng, m)
    q, s = qf.quantize_fp8_rows(_w(rng, n))
    xq, xs = qf.quantize_rows_fp8(x)
    want = (np.asarray(xq, np.float64) * np.asarray(xs, np.float64)[:, None]) @ \
        (q.astype(np.float64) * s.astype(np.float64)[:, None]).T
    y = mgpu_gemm.fp8_gemm_t_mosaic(x, jnp.asarray(q), jnp.asarray(s), out_dtype=jnp.float32,
                                    interpret=interpret, tiles=MgpuTiles(64, 64, "m", stages=2))
    _check(y, want, m, n, TOL[interpret])


BLOCK_CASES = [(150, 256, MgpuTiles(64, 128, "m", stages=3, grid_tile_width=2), jnp.float32),
               (60, 384, MgpuTiles(64, 128, "m", stages=2, grid_minor="n"), jnp.bfloat16),
               (130, 256, MgpuTiles(128, 128, "m", stages=2, epi_bytes=64), jnp.float32)]


@pytest.mark.parametrize("m,n,tiles,out_dtype", BLOCK_CASES)
def test_w8a16_gemm_pipelined_mosaic(rng, interpret, m, n, tiles, out_dtype):
    k = 512 if tiles.tile_m == 128 else 384
    x = _x(rng, m, k=k)
    q, s = (jnp.asarray(a) for a in qf.quantize_fp8_block(_w(rng, n, k=k)))
    y = mgpu_gemm.w8a16_gemm_pipelined_mosaic(x, q, s, out_dtype=out_dtype, interpret=interpret, tiles=tiles)
    assert y.dtype == out_dtype
    ref = w8a16.w8a16_pipelined_reference(x, q, s, out_dtype=jnp.float32)
    tol = TOL[interpret] if out_dtype == jnp.float32 else 1e-2
    _check(y, ref, m, n, tol)
    # the activations really were quantized per 128 columns (not per row, not exact)
    exact = w8a16.w8a16_reference(x, q, s, out_dtype=jnp.float32)
    assert rel_err(np.asarray(y, np.float32), exact) > 1e-4


def _grouped(rng, m, k, group):
    """Fp8Activations quantized per row per `group` columns, with scales spread over 1e-2..1e2 so a missed
    rescale at a group boundary shows."""
    x = _x(rng, m, k) * jnp.asarray(10.0 ** rng.uniform(-2, 2, (1, k // group)).repeat(group, 1), jnp.bfloat16)
    q, s = qf.quantize_rows_fp8_blocks(x, group)
    return qf.Fp8Activations(q, s, jnp.dtype(jnp.bfloat16), group)


@pytest.mark.parametrize("group,tiles", [(128, MgpuTiles(64, 64, "m", stages=2)),
                                         (256, MgpuTiles(64, 64, "n", stages=3, delay_release=1)),
                                         (256, MgpuTiles(64, 256, "m", stages=2))])
def test_fp8_gemm_t_mosaic_grouped_activations(rng, interpret, group, tiles):
    """x quantized per group of columns (the gated norm's output): the accumulator changes units at each group,
    checked against float64 numpy."""
    m, n, k = 100, 256, 512
    xa = _grouped(rng, m, k, group)
    q, s = qf.quantize_fp8_rows(_w(rng, n, k))
    want = np.asarray(xa.dequantize(), np.float64) @ (q.astype(np.float64) * s.astype(np.float64)[:, None]).T
    y = mgpu_gemm.fp8_gemm_t_mosaic(xa, jnp.asarray(q), jnp.asarray(s), out_dtype=jnp.float32,
                                    interpret=interpret, tiles=tiles)
    _check(y, want, m, n, TOL[interpret])


@pytest.mark.parametrize("group", [None, 256])
def test_w8a16_gemm_pipelined_mosaic_against_numpy(rng, interpret, group):
    """Block-scaled weights with x per 128 columns (its own quantization), per row or per 256 columns (a
    producer's): float64 numpy of the dequantized operands."""
    m, n, k = 70, 256, 512
    w = _w(rng, n, k) * np.repeat(10.0 ** rng.uniform(-1, 1, (1, k // 128)), 128, 1).astype(np.float32)
    q, s = qf.quantize_fp8_block(w)
    if group is None:
        xq, xs = qf.quantize_rows_fp8(_x(rng, m, k))
        x = qf.Fp8Activations(xq, xs, jnp.dtype(jnp.bfloat16))
    else:
        x = _grouped(rng, m, k, group)
    want = np.asarray(x.dequantize(), np.float64) @ qf.dequantize_fp8_block(q, s).astype(np.float64).T
    y = mgpu_gemm.w8a16_gemm_pipelined_mosaic(x, jnp.asarray(q), jnp.asarray(s), out_dtype=jnp.float32,
                                              interpret=interpret, tiles=MgpuTiles(64, 128, "m", stages=2))
    _check(y, want, m, n, TOL[interpret])


def test_block_scaled_zero_scale_blocks(rng, interpret):
    """A zero block scale (a checkpoint's all-zero block) would make the rescaling kernel's scale ratio infinite:
    Projection.prepare clears such blocks (codes 0, scale 1; same dequantized weight), and the Mosaic arm then
    matches float64 numpy of the original weight, with finite outputs."""
    from metrale_jax.layers.projection import Projection
    from metrale_jax.weights import containers as C
    m, n, k = 70, 256, 512
    q, s = qf.quantize_fp8_block(_w(rng, n, k))
    s[1, 2] = 0.0                                        # codes stay non-zero: only the scale zeroes the block
    w = C.Fp8Weight(jnp.asarray(q), jnp.asarray(s))
    got = Projection("m.out_proj", n, k, kernels="reference").prepare("fp8_native", w)
    assert float(got.scale[1, 2]) == 1.0 and not np.any(np.asarray(got.weight[128:256, 256:384], np.float32))
    np.testing.assert_array_equal(np.asarray(got.dequantize()), np.asarray(w.dequantize()))
    x = qf.Fp8Activations(*qf.quantize_rows_fp8_blocks(_x(rng, m, k)))
    want = np.asarray(x.dequantize(), np.float64) @ np.asarray(w.dequantize(), np.float64).T
    y = mgpu_gemm.w8a16_gemm_pipelined_mosaic(x, got.weight, got.scale, out_dtype=jnp.float32, interpret=interpret,
                                              tiles=MgpuTiles(64, 128, "m", stages=2))
    _check(y, want, m, n, TOL[interpret])


@pytest.mark.gpu
def test_mosaic_default_tiles_on_gpu(rng):
    """The default (benchmarked) tiles at a mid-size shape, compiled."""
    m, n, k = 512, 1024, 1024
    x = _x(rng, m, k)
    q, s = (jnp.asarray(a) for a in qf.quantize_fp8_rows(_w(rng, n, k)))
    _check(mgpu_gemm.fp8_gemm_t_mosaic(x, q, s, out_dtype=jnp.float32),
           fp8_gemm.fp8_gemm_t_reference(x, q, s, out_dtype=jnp.float32), m, n, TOL[False])
    qb, sb = (jnp.asarray(a) for a in qf.quantize_fp8_block(_w(rng, n, k)))
    _check(mgpu_gemm.w8a16_gemm_pipelined_mosaic(x, qb, sb, out_dtype=jnp.float32),
           w8a16.w8a16_pipelined_reference(x, qb, sb, out_dtype=jnp.float32), m, n, TOL[False])


def test_mosaic_argument_errors(rng):
    x = _x(rng, 64)
    q, s = (jnp.asarray(a) for a in qf.quantize_fp8_rows(_w(rng, 200)))
    with pytest.raises(ShapeError, match=r"fp8_gemm_t: w has N=200 rows, not a multiple of .* 128"):
        mgpu_gemm.fp8_gemm_t_mosaic(x, q, s, interpret=True)
    q2, s2 = (jnp.asarray(a) for a in qf.quantize_fp8_rows(_w(rng, 128, k=200)))
    with pytest.raises(ShapeError, match=r"fp8_gemm_t: K=200 .* not a multiple of 128"):
        mgpu_gemm.fp8_gemm_t_mosaic(_x(rng, 64, k=200), q2, s2, interpret=True)
    with pytest.raises(ShapeError, match="fp8_gemm_t: w expected float8_e4m3fn"):
        mgpu_gemm.fp8_gemm_t_mosaic(x, q.astype(jnp.bfloat16), s, interpret=True)
    qb, sb = (jnp.asarray(a) for a in qf.quantize_fp8_block(_w(rng, 256)))
    with pytest.raises(ShapeError, match=r"w8a16_gemm_pipelined: scale expected float32\[2, 2\]"):
        mgpu_gemm.w8a16_gemm_pipelined_mosaic(x, qb, sb[:1], interpret=True)
    with pytest.raises(ShapeError, match="tiles.wg_dim must be 'm' and tile_n 128"):
        mgpu_gemm.w8a16_gemm_pipelined_mosaic(x, qb, sb, interpret=True, tiles=MgpuTiles(64, 128, "n"))
    with pytest.raises(ShapeError, match="epi_m=32 must be a multiple of 64"):
        mgpu_gemm.fp8_gemm_t_mosaic(x, q[:128], s[:128], interpret=True, tiles=MgpuTiles(64, 64, epi_m=32))
    with pytest.raises(ShapeError, match="tile_m=32 must be a multiple of 64"):
        mgpu_gemm.fp8_gemm_t_mosaic(x, q[:128], s[:128], interpret=True, tiles=MgpuTiles(32, 64))
    with pytest.raises(ShapeError, match="bytes of shared memory"):
        mgpu_gemm.fp8_gemm_t_mosaic(x, q[:128], s[:128], interpret=True, tiles=MgpuTiles(128, 128, stages=8))
    with pytest.raises(ShapeError, match=r"N=128 rows, not a multiple of the Mosaic tile's 256 columns"):
        mgpu_gemm.fp8_gemm_t_mosaic(x, q[:128], s[:128], interpret=True, tiles=MgpuTiles(64, 256))


def test_mosaic_arms_registered():
    """Mosaic is the GPU default of both names; shapes its tiles do not take go to the Triton arm."""
    for name in ("fp8_gemm_t", "w8a16_gemm_pipelined"):
        assert registry.resolve(name, "mosaic", platform="gpu").impl == "mosaic"
        assert registry.resolve(name, "pallas", platform="gpu").impl == "mosaic"
        assert registry.resolve(name, "triton", platform="gpu").impl == "pallas"
        spec = registry._KERNELS[name]
        x = jnp.zeros((7, 4096), jnp.bfloat16)
        for (n, k), ok in (((18560, 4096), True), ((4096, 8192), True), ((200, 4096), False), ((256, 200), False)):
            assert mgpu_gemm.supports(name, n, k) is ok
            assert spec.mosaic_supports(x[:, :k], jnp.zeros((n, k), jnp.float8_e4m3fn), None) is ok
    if jax.default_backend() == "cpu":
        assert registry.resolve("fp8_gemm_t", "auto").impl == "reference"


def test_fused_activation_quantization(rng, interpret):
    """The one-pass quantizers give quant_formats' numbers (E4M3 bits and scales; the block scales transposed)."""
    m, k = 128, 512
    x = _x(rng, m, k)
    q, s = mgpu_gemm.quantize_rows_fused(x, interpret=interpret)
    q0, s0 = qf.quantize_rows_fp8(x)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))
    assert np.mean(np.asarray(q.view(jnp.uint8)) != np.asarray(q0.view(jnp.uint8))) <= 1e-4
    qb, sb_t = mgpu_gemm.quantize_blocks_fused_t(x, interpret=interpret)
    qb0, sb0 = qf.quantize_rows_fp8_blocks(x)
    np.testing.assert_array_equal(np.asarray(sb_t), np.asarray(sb0).T)
    assert np.mean(np.asarray(qb.view(jnp.uint8)) != np.asarray(qb0.view(jnp.uint8))) <= 1e-4
    assert not mgpu_gemm.fused_quant_ok(100, 512) and not mgpu_gemm.fused_quant_ok(128, 384)


@pytest.mark.parametrize("m,k", [(1, 384), (5, 1280), (33, 1024)])
def test_any_rows_block_quantization(rng, interpret, m, k):
    """Below 64 rows (decode) the per-128-column quantization is one Triton pass for any K multiple of 128 (rows
    past M masked): quant_formats' numbers, an all-zero block (scale 1) included; `_quantized_x` takes it there,
    with the bits of the XLA path."""
    x = _x(rng, m, k).at[0, 128:256].set(0)
    q, s = mgpu_gemm.quantize_blocks_any_rows(x, interpret=interpret)
    q0, s0 = qf.quantize_rows_fp8_blocks(x)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s0))
    assert np.asarray(s)[0, 1] == 1.0
    assert np.mean(np.asarray(q.view(jnp.uint8)) != np.asarray(q0.view(jnp.uint8))) <= 1e-4
    fused = mgpu_gemm._quantized_x(x, 128, m, k, interpret, "fused", None)
    xla = mgpu_gemm._quantized_x(x, 128, m, k, interpret, "xla", None)
    for a, b in zip(fused, xla):
        np.testing.assert_array_equal(np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32))
    with pytest.raises(ShapeError, match="K a multiple of 128"):
        mgpu_gemm.quantize_blocks_any_rows(x[:, :200], interpret=interpret)


@pytest.mark.parametrize("name", ["fp8_gemm_t", "w8a16_gemm_pipelined"])
def test_mosaic_arms_with_fused_quantization(rng, interpret, name):
    m, n, k = 128, 128, 256
    x = _x(rng, m, k)
    if name == "fp8_gemm_t":
        q, s = (jnp.asarray(a) for a in qf.quantize_fp8_rows(_w(rng, n, k)))
        y = mgpu_gemm.fp8_gemm_t_mosaic(x, q, s, out_dtype=jnp.float32, interpret=interpret, act_quant="fused",
                                        tiles=MgpuTiles(64, 64, "m", stages=2))
        ref = fp8_gemm.fp8_gemm_t_reference(x, q, s, out_dtype=jnp.float32)
    else:
        q, s = (jnp.asarray(a) for a in qf.quantize_fp8_block(_w(rng, n, k)))
        y = mgpu_gemm.w8a16_gemm_pipelined_mosaic(x, q, s, out_dtype=jnp.float32, interpret=interpret,
                                                  act_quant="fused", tiles=MgpuTiles(64, 128, "m", stages=2))
        ref = w8a16.w8a16_pipelined_reference(x, q, s, out_dtype=jnp.float32)
    _check(y, ref, m, n, TOL[interpret])
