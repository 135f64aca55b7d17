"""Mosaic GPU arms of the NVFP4 prefill GEMMs (pallas_kernels/mgpu_gemm_nvfp4.py: transposed and plain layout)
against `w4a16_t_reference` / `w4a16_reference` and float64 numpy.

On the CPU the kernel runs in GPU interpret mode (tiny shapes, a 2-SM persistent grid so each CTA loops over
several output tiles, the jnp nibble decoder); on a GPU the same tests run compiled (METRALE_TEST_GPU=1) with
the PTX decoder."""

import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.errors import ShapeError
from metrale_jax.weights import quant_formats as qf
from pallas_kernels import mgpu_gemm_nvfp4 as mn
from pallas_kernels import registry
from pallas_kernels.w4a16 import w4a16_reference, w4a16_t_reference
from tests.kernels.ptx_emulator import bf16_pairs, element_map, run_ptx
from tests.numpy_refs import rel_err

TOL = 2e-5      # bf16 products are exact; only the f32 summation order differs


@pytest.fixture(autouse=True)
def _reset_interpreter():
    yield
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    ipc.reset_gpu_interpret_mode_state()


def _operands(rng, m, n, k):
    x = jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.2, 4.0, (m, 1)), jnp.bfloat16)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.1, 3.0, (n, 1))).astype(np.float32)
    p, s, g = qf.quantize_nvfp4(w)
    return x, jnp.asarray(p.T), jnp.asarray(s.T), g


def _want(x, pt, st, g):
    """float64 numpy: dequantize (exact) then matmul."""
    w = np.asarray(qf.dequantize_nvfp4(np.asarray(pt).T, np.asarray(st).T, g), np.float64)
    return np.asarray(x, np.float64) @ w.T


def _check(y, want, m, n, tol):
    y = np.asarray(jnp.asarray(y, jnp.float32))
    assert y.shape == (m, n)
    assert np.all(np.isfinite(y)), "unwritten or non-finite outputs"
    assert rel_err(y, want) < tol


# M ragged (padded to tile_m inside); 2 SMs x 2-4 output tiles; both output dtypes
CASES = [(100, 256, 512, mn.Nvfp4Tiles(tile_m=64, stages=2), jnp.float32),
         (200, 128, 256, mn.Nvfp4Tiles(tile_m=128, stages=3, grid_minor="n", grid_tile_width=2), jnp.bfloat16)]


@pytest.mark.parametrize("m,n,k,tiles,out_dtype", CASES)
def test_w4a16_gemm_t_mosaic(rng, interpret, m, n, k, tiles, out_dtype):
    x, pt, st, g = _operands(rng, m, n, k)
    y = mn.w4a16_gemm_t_mosaic(x, pt, st, g, out_dtype=out_dtype, interpret=interpret, tiles=tiles)
    ref = w4a16_t_reference(x, pt, st, g, out_dtype=jnp.float32)
    tol = TOL if out_dtype == jnp.float32 else 1e-2
    _check(y, np.asarray(ref, np.float64), m, n, tol)
    _check(y, _want(x, pt, st, g), m, n, tol)


def _e2m1(codes):
    return np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])[codes]


def test_decoder_ptx_and_register_plan_give_the_dequantized_tile(rng):
    """The decoder of the GPU (its PTX run lane by lane for a whole warpgroup, shuffles included,
    through the same register plan as the kernel, on Mosaic's register layouts) yields weight * 2^-8 at every
    element of the [64, 128] A tile, exactly: every packed byte, every finite E4M3 scale (subnormals too)."""
    import ml_dtypes
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    p = rng.permutation(np.resize(np.arange(256, dtype=np.uint8), 64 * 64)).reshape(64, 64)
    finite = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    sc = rng.choice(finite, (64, 8)).view(ml_dtypes.float8_e4m3fn).astype(np.float64)              # [64 rows, 8 groups]
    s_tile = np.asarray(mn.prepare_scales(jnp.asarray(sc, jnp.float8_e4m3fn)))                       # [64, 16] bf16
    assert s_tile.shape == (64, 16) and s_tile.dtype == jnp.bfloat16
    src_map = element_map(fa.WGMMA_LAYOUT_UPCAST_4X, (64, 64))
    scl_map = element_map(mn.SCALE_LAYOUT.to_mgpu(), (64, 16))
    s_bits = s_tile.view(np.uint16).ravel()
    src, scl = np.empty(src_map.shape[1:-1], object), np.empty(scl_map.shape[1:-1], object)
    for idx in np.ndindex(src.shape):
        src[idx] = p.ravel()[src_map[(slice(None), *idx)]]                                          # [128, 8] u8
    for idx in np.ndindex(scl.shape):
        scl[idx] = s_bits[scl_map[(slice(None), *idx)]]                                              # [128, 8] u16

    def words(r):                                       # [128, n] lanes' vector -> its 32-bit words, low bytes first
        per = 4 // r.dtype.itemsize
        return [sum(r[:, per * i + b].astype(np.uint32) << (8 * r.dtype.itemsize * b) for b in range(per))
                for i in range(r.shape[1] // per)]
    want = np.stack([_e2m1(p & 15), _e2m1(p >> 4)], -1).reshape(64, 128) * np.repeat(sc, 16, axis=1) * 2.0 ** -8
    out = mn.natural_registers(src, scl, lambda tpl, n, ins: run_ptx(tpl, n, *ins, threads=128), words, lambda v: v)
    dst_map = element_map(fa.WGMMA_LAYOUT, (64, 128))
    got = np.full(64 * 128, np.nan)
    for idx in np.ndindex(out.shape):
        got[dst_map[(slice(None), *idx)]] = bf16_pairs(out[idx])
    np.testing.assert_array_equal(got.reshape(64, 128), want)
    assert np.array_equal(np.signbit(got.reshape(64, 128)), np.signbit(want))


def test_prepared_weights_same_result(rng, interpret):
    """The prepared-weights entry (weights relaid out once) gives the same bits as the per-call arm."""
    x, pt, st, g = _operands(rng, 64, 128, 256)
    t = mn.Nvfp4Tiles(tile_m=64, stages=2)
    p, s = mn.prepare_weights(pt, st)
    assert p.shape == (128, 128) and s.shape == (128, 32) and s.dtype == jnp.bfloat16
    a = mn.w4a16_gemm_t_mosaic(x, pt, st, g, out_dtype=jnp.float32, interpret=interpret, tiles=t)
    b = mn.w4a16_gemm_t_prepared(x, p, s, g, out_dtype=jnp.float32, interpret=interpret, tiles=t)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _check(a, _want(x, pt, st, g), 64, 128, TOL)


def test_plain_layout_arm_same_bits_as_the_transposed_one(rng, interpret):
    """w4a16_gemm's Mosaic arm takes packed [N, K/2] as the kernel's weight layout (no transpose): the same bits
    as the transposed arm on the same weights, and right against w4a16_reference / float64."""
    x, pt, st, g = _operands(rng, 100, 256, 512)
    t = mn.Nvfp4Tiles(tile_m=64, stages=2)
    y = mn.w4a16_gemm_mosaic(x, pt.T, st.T, g, out_dtype=jnp.float32, interpret=interpret, tiles=t)
    yt = mn.w4a16_gemm_t_mosaic(x, pt, st, g, out_dtype=jnp.float32, interpret=interpret, tiles=t)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(yt))
    _check(y, np.asarray(w4a16_reference(x, pt.T, st.T, g, out_dtype=jnp.float32), np.float64), 100, 256, TOL)
    _check(y, _want(x, pt, st, g), 100, 256, TOL)
    with pytest.raises(ShapeError, match=r"w4a16_gemm\(mosaic\): N=64 \(weight rows\) is not a multiple of 128"):
        mn.w4a16_gemm_mosaic(x, pt.T[:64], st.T[:64], g, interpret=True)
    with pytest.raises(ShapeError, match="w4a16_gemm: packed weight expected uint8"):
        mn.w4a16_gemm_mosaic(x, pt.T.astype(jnp.int8), st.T, g, interpret=True)


def test_argument_errors(rng):
    x, pt, st, g = _operands(rng, 64, 128, 256)
    with pytest.raises(ShapeError, match=r"N=64 .* not a multiple of 128"):
        mn.w4a16_gemm_t_mosaic(x, pt[:, :64], st[:, :64], g, interpret=True)
    x2, pt2, st2, g2 = _operands(rng, 64, 128, 128)
    with pytest.raises(ShapeError, match=r"K=128 .* not a multiple of 256"):
        mn.w4a16_gemm_t_mosaic(x2, pt2, st2, g2, interpret=True)
    with pytest.raises(ShapeError, match="scale expected float8_e4m3fn"):
        mn.w4a16_gemm_t_mosaic(x, pt, st.astype(jnp.float32), g, interpret=True)
    with pytest.raises(ShapeError, match="tile_m=96 must be one of"):
        mn.w4a16_gemm_t_mosaic(x, pt, st, g, interpret=True, tiles=mn.Nvfp4Tiles(tile_m=96))
    with pytest.raises(ShapeError, match="bytes of shared memory"):
        mn.w4a16_gemm_t_mosaic(x, pt, st, g, interpret=True, tiles=mn.Nvfp4Tiles(tile_m=256, stages=4))
    with pytest.raises(ShapeError, match="prepared weights expected"):
        mn.w4a16_gemm_t_prepared(x, pt.T, st.T, g, interpret=True)


def test_registered_beside_triton():
    """The three names carry the Mosaic arm; calls it does not take (shapes, f32 x) go to the Triton arm."""
    for name in ("w4a16_gemm_t", "w4a16_gemm_t_m128"):
        spec = registry._KERNELS[name]
        assert spec.pallas is not None and spec.mosaic is not None
        assert registry.resolve(name, "mosaic", platform="gpu").impl == "mosaic"
        assert registry.resolve(name, "triton", platform="gpu").impl == "pallas"
        assert registry.resolve(name, "auto", platform="gpu").impl == "mosaic"         # the GPU default
        x = jnp.zeros((7, 4096), jnp.bfloat16)
        for (n, k), ok in (((18560, 4096), True), ((4096, 8192), True), ((200, 4096), False), ((256, 400), False)):
            pt = jnp.zeros((k // 2, n), jnp.uint8)
            st = jnp.zeros((k // 16, n), jnp.float8_e4m3fn)
            assert spec.mosaic_supports(x[:, :k], pt, st, 1.0) is ok
            assert spec.mosaic_supports(x[:, :k].astype(jnp.float32), pt, st, 1.0) is False
    spec = registry._KERNELS["w4a16_gemm"]
    assert spec.gpu_default == "mosaic" and registry.resolve("w4a16_gemm", "auto", platform="gpu").impl == "mosaic"
    x = jnp.zeros((7, 4096), jnp.bfloat16)
    for (n, k), ok in (((18560, 4096), True), ((4096, 8192), True), ((200, 4096), False), ((256, 400), False)):
        p, s = jnp.zeros((n, k // 2), jnp.uint8), jnp.zeros((n, k // 16), jnp.float8_e4m3fn)
        assert spec.mosaic_supports(x[:, :k], p, s, 1.0) is ok
        assert spec.mosaic_supports(x[:, :k], p, s, 1.0, out_dtype=jnp.int8) is False


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(18560, 4096), (4096, 8192)])
def test_plain_and_transposed_arms_at_8b_shapes_on_gpu(rng, n, k):
    """Compiled at the Nemotron-H-8B projection shapes with the default tiles (M = 300: padded to 256-row tiles):
    the plain-layout arm gives the transposed arm's bits and matches the reference."""
    x, pt, st, g = _operands(rng, 300, n, k)
    y = mn.w4a16_gemm_mosaic(x, pt.T, st.T, g, out_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(y, np.float32),
                                  np.asarray(mn.w4a16_gemm_t_mosaic(x, pt, st, g, out_dtype=jnp.bfloat16), np.float32))
    assert rel_err(y, w4a16_reference(x, pt.T, st.T, g, out_dtype=jnp.float32)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(18560, 4096), (4096, 8192)])
@pytest.mark.parametrize("tiles,out_dtype", [(mn.Nvfp4Tiles(tile_m=256, stages=2), jnp.bfloat16),
                                             (mn.Nvfp4Tiles(tile_m=128, stages=3), jnp.float32)])
def test_plain_arm_at_8b_shapes_on_gpu(rng, n, k, tiles, out_dtype):
    """The PTX decoder compiled at the 8B shapes (M = 300, padded): against the reference at f32 summation-order
    tolerance (f32 out) or bf16 rounding (bf16 out), every row written."""
    x, pt, st, g = _operands(rng, 300, n, k)
    y = mn.w4a16_gemm_mosaic(x, pt.T, st.T, g, out_dtype=out_dtype, tiles=tiles)
    _check(y, np.asarray(w4a16_reference(x, pt.T, st.T, g, out_dtype=jnp.float32), np.float64), 300, n,
           TOL if out_dtype == jnp.float32 else 1e-2)
