"""w8a8_gemv: the decode GEMV on the FP8 matrix units (x rounded to E4M3 per row per 128 columns, Mosaic arm in
pallas_kernels/mgpu_gemv_w8.py) against its reference (quantize, dequantize, matmul in float32): GPU interpret mode
on the CPU at tiny shapes (outputs start as NaN there), compiled on a GPU at the 8B shapes. Rows must be
batch-invariant: a row's result is bit-identical whatever M."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.errors import ShapeError
from metrale_jax.weights import quant_formats as qf
from pallas_kernels import epilogues, registry, w8a16
from pallas_kernels import mgpu_gemv_w8 as w8m
from pallas_kernels.formats import Fp8Activations
from pallas_kernels.mgpu_gemv import GemvConfig
from tests.kernels.mosaic_smem import check_lowered
from tests.kernels.test_mgpu_gemv import _fp8, _reset_interpreter  # noqa: F401 (an autouse fixture)
from tests.numpy_refs import rel_err

F32 = jnp.float32


def _tol(interpret: bool) -> float:
    """Against the float32 reference: interpret mode multiplies in float32; the GPU's FP8 wgmma accumulates each
    K block's E4M3 products with less than float32 precision (the bound the FP8 prefill GEMM's tests state,
    test_mgpu_gemm.TOL), before the block's float32 scaling and sum."""
    return 1e-5 if interpret else 2e-3


def _x(rng, m, k):
    """bf16 rows of different magnitudes (each row gets its own E4M3 scales)."""
    return jnp.asarray(rng.standard_normal((m, k)) * rng.uniform(0.05, 20.0, (m, 1)), jnp.bfloat16)


def _group_quantized(x, group: int) -> Fp8Activations:
    """x quantized per row per `group` columns, as the gated norm's per-group kernel hands it over."""
    q, s = qf.quantize_rows_fp8_blocks(x, group)
    return Fp8Activations(q, s, group=group)


# (M, N, K, config): the direct bf16 / float32-partials outputs, a half-empty 128-row tile, M = 17 padded to 24,
# several x tiles per CTA, two and four K blocks per pipeline step
CASES = [(3, 192, 384, GemvConfig(64, 2)),
         (5, 192, 512, GemvConfig(128, 3, 2)),
         (17, 128, 256, GemvConfig(64, 4)),
         (40, 192, 384, GemvConfig(64, 2)),
         (5, 128, 1024, GemvConfig(64, 2, 2, k_blocks=2)),
         (3, 192, 1024, GemvConfig(128, 3, k_blocks=4))]


@pytest.mark.parametrize("M,N,K,config", CASES, ids=str)
def test_w8a8_mosaic_matches_reference(rng, interpret, M, N, K, config):
    x, (q, s) = _x(rng, M, K), _fp8(rng, N, K)
    ref = w8a16.w8a8_gemv_reference(x, q, s, out_dtype=F32)
    y = w8m.w8a8_gemv_mosaic(x, q, s, out_dtype=F32, interpret=interpret, config=config)
    assert y.shape == (M, N) and y.dtype == F32 and np.all(np.isfinite(np.asarray(y)))
    assert rel_err(y, ref) < _tol(interpret)
    assert rel_err(y, w8a16.w8a16_reference(x, q, s, out_dtype=F32)) > 1e-3     # x really went through E4M3
    yb = w8m.w8a8_gemv_mosaic(x, q, s, interpret=interpret, config=config)
    assert yb.dtype == jnp.bfloat16 and rel_err(yb, ref) < 4e-3


@pytest.mark.parametrize("group", [128, 256])
def test_producer_quantized_activations(rng, interpret, group):
    """x quantized by its producer (per 128 columns, or per norm group: the scales are repeated per 128 in the
    wrapper) gives the reference of those E4M3 values; per 128 it equals quantizing bf16 x in the arm."""
    M, N, K = 5, 128, 512
    x, (q, s) = _x(rng, M, K), _fp8(rng, N, K)
    xa = _group_quantized(x, group)
    y = w8m.w8a8_gemv_mosaic(xa, q, s, out_dtype=F32, interpret=interpret, config=GemvConfig(64, 2))
    assert rel_err(y, w8a16.w8a8_gemv_reference(xa, q, s, out_dtype=F32)) < _tol(interpret)
    if group == 128:
        mine = w8m.w8a8_gemv_mosaic(x, q, s, out_dtype=F32, interpret=interpret, config=GemvConfig(64, 2))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(mine))
    with pytest.raises(ShapeError, match="Fp8Activations"):
        w8m.w8a8_gemv_mosaic(Fp8Activations(xa.q, xa.scale[:, :1], group=group), q, s, interpret=interpret)


@pytest.mark.parametrize("M,N,K,config", [CASES[0], CASES[1], CASES[3]], ids=str)
def test_epilogue_equals_the_unfused_composition(rng, interpret, M, N, K, config):
    """relu^2 in the kernel's direct store or after the split-K sum: bit for bit relu^2 on the float32 output,
    then the cast; so do the Triton arm and the reference."""
    x, (q, s) = _x(rng, M, K), _fp8(rng, N, K)
    for arm, kw in ((w8m.w8a8_gemv_mosaic, dict(interpret=interpret, config=config)),
                    (w8a16.w8a8_gemv_pallas, dict(interpret=interpret)), (w8a16.w8a8_gemv_reference, {})):
        y = arm(x, q, s, out_dtype=F32, **kw)
        assert (np.asarray(y) < 0).mean() > 0.2
        for out_dtype in (jnp.bfloat16, F32):
            got = arm(x, q, s, out_dtype=out_dtype, epilogue="relu2", **kw)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(epilogues.relu2(y).astype(out_dtype)))
    with pytest.raises(ShapeError, match="epilogue expected None or one of"):
        w8m.w8a8_gemv_mosaic(x, q, s, epilogue="gelu", interpret=interpret, config=config)


def test_rows_are_batch_invariant(rng, interpret):
    """A row of an M = 16 / 40 batch is bit-identical to the same row alone (one 8-row tile, an n8 wgmma) and to
    one 16-row tile per CTA; in interpret mode the emulated wgmma is XLA's CPU dot, whose blocking depends on N,
    so there n8 is compared with n8 and several tiles per CTA with one to a tolerance (as for w8a16_gemv)."""
    N, K = 128, 512
    args = _fp8(rng, N, K)
    config = w8m.w8a16_gemv_blocks(N, K)
    run = lambda x, **kw: np.asarray(w8m.w8a8_gemv_mosaic(x, *args, out_dtype=F32, interpret=interpret,
                                                          config=dataclasses.replace(config, **kw)))
    x16 = _x(rng, 16, K)
    y16, y8 = run(x16), run(x16[:8])
    for i in (0, 6):
        np.testing.assert_array_equal(run(x16[i:i + 1])[0], y8[i])
        if not interpret:
            np.testing.assert_array_equal(run(x16[i:i + 1])[0], y16[i])
    for i in (0, 15):
        np.testing.assert_array_equal(run(x16[i:i + 1], small_m=False)[0], y16[i])
    x40 = jnp.concatenate([x16, _x(rng, 24, K)])
    np.testing.assert_array_equal(run(x40, m_tiles=1)[:16], y16)
    if interpret:
        assert rel_err(run(x40)[:16], y16) < 1e-6
    else:
        np.testing.assert_array_equal(run(x40)[:16], y16)


def test_tail_split_matches_reference(rng, interpret, monkeypatch):
    """The unsplit launch with its tail row blocks in K pieces (float32 partials added by XLA in interpret mode)."""
    sms = w8m.H200_SMS if not interpret else 4
    monkeypatch.setattr(w8m, "H200_SMS", sms)
    M, N, K = 3, 64 * (sms + 1), 256
    x, (q, s) = _x(rng, M, K), _fp8(rng, N, K)
    y = w8m.w8a8_gemv_mosaic(x, q, s, out_dtype=F32, interpret=interpret, config=GemvConfig(64, 2, 1, tail_split=2))
    assert rel_err(y, w8a16.w8a8_gemv_reference(x, q, s, out_dtype=F32)) < _tol(interpret)


def test_bad_inputs_raise_typed_errors(rng):
    x, (q, s) = _x(rng, 2, 256), _fp8(rng, 128, 256)
    with pytest.raises(ShapeError, match="K % 128"):
        w8m.w8a8_gemv_mosaic(_x(rng, 2, 320), *_fp8(rng, 128, 320))
    with pytest.raises(ShapeError, match="N % 64"):
        w8m.w8a8_gemv_mosaic(x, *_fp8(rng, 200, 256))
    with pytest.raises(ShapeError, match="w8a8_gemv: scale expected"):
        w8m.w8a8_gemv_mosaic(x, q, s[:, :1])
    with pytest.raises(ShapeError, match="w8a8_gemv: w expected float8_e4m3fn"):
        w8m.w8a8_gemv_mosaic(x, q.astype(jnp.bfloat16), s)
    with pytest.raises(ShapeError, match="w8a8_gemv: x expected shape"):
        w8m.w8a8_gemv_mosaic(x[:, :128], q, s)
    with pytest.raises(ShapeError, match="block_n"):
        w8m.w8a8_gemv_mosaic(x, q, s, config=GemvConfig(block_n=32))


def test_registry_serves_the_triton_arm_by_default_and_the_mosaic_one_when_asked():
    """The Mosaic arm is registered but not the GPU default until it passes its GPU tests (gemv.md)."""
    spec = registry._KERNELS["w8a8_gemv"]
    assert spec.gpu_default == "triton" and spec.mosaic is w8m.w8a8_gemv_mosaic
    assert spec.reference is w8a16.w8a8_gemv_reference and spec.pallas is w8a16.w8a8_gemv_pallas
    sd = jax.ShapeDtypeStruct
    w = sd((192, 256), jnp.float8_e4m3fn)
    assert spec.mosaic_supports(sd((2, 256), jnp.bfloat16), w, None)
    assert spec.mosaic_supports(Fp8Activations(jnp.zeros((2, 256), jnp.float8_e4m3fn), jnp.ones((2, 2), F32)), w, None)
    assert not spec.mosaic_supports(sd((2, 256), F32), w, None)                  # the Triton arm quantizes f32 x
    assert not spec.mosaic_supports(sd((2, 256), jnp.bfloat16), sd((200, 256), jnp.float8_e4m3fn), None)


@pytest.mark.parametrize("N,K", [(18560, 4096), (4096, 8192), (4096, 21504)])
@pytest.mark.parametrize("M", [1, 16, 40, 256])
def test_lowers_for_cuda_at_the_8b_shapes(N, K, M):
    """The default launches (in_proj's tail pieces in 2-CTA clusters, out_proj's / down_proj's split-K partials,
    several x tiles per CTA) lower for CUDA on the CPU (layout inference included) on every output path. x comes
    producer-quantized (lowering the Triton quantizer needs a GPU)."""
    sd = jax.ShapeDtypeStruct
    x = Fp8Activations(sd((M, K), jnp.float8_e4m3fn), sd((M, K // 128), F32))
    for out_dtype, epilogue in ((jnp.bfloat16, None), (F32, None), (jnp.bfloat16, "relu2")):
        fn = lambda x, w, s: w8m.w8a8_gemv_mosaic(x, w, s, out_dtype=out_dtype, epilogue=epilogue)
        check_lowered(jax.jit(fn).trace(x, sd((N, K), jnp.float8_e4m3fn), sd((N // 128, K // 128), F32)).lower(
            lowering_platforms=("cuda",)))


@pytest.mark.parametrize("M,N,K,config", CASES, ids=str)
def test_shared_memory_stages_are_tma_aligned(M, N, K, config):
    """Every config the GPU tests run lowers with each shared-memory buffer, and each pipeline stage of it, on 128
    bytes (TMA's alignment; the x scales' 32-byte stages once failed every GPU test), x producer-quantized."""
    sd = jax.ShapeDtypeStruct
    x = Fp8Activations(sd((M, K), jnp.float8_e4m3fn), sd((M, K // 128), F32))
    fn = lambda x, w, s: w8m.w8a8_gemv_mosaic(x, w, s, out_dtype=F32, config=config)
    buffers = check_lowered(jax.jit(fn).trace(x, sd((N, K), jnp.float8_e4m3fn), sd((-(-N // 128), K // 128), F32))
                            .lower(lowering_platforms=("cuda",)))
    scales = [b for b in buffers if b.dtype == "f32" and len(b.shape) == 3]      # [stages, K blocks, columns]
    assert len(scales) == 1 and scales[0].shape[-1] % 32 == 0            # the x scales' pipeline buffer is there


def test_the_alignment_check_sees_unpadded_scales(monkeypatch):
    """The check above fails on the layout that failed on the GPU: x scales padded to the tile's rows only."""
    monkeypatch.setattr(w8m, "x_scale_cols", lambda xr: xr)
    jax.clear_caches()                                   # an earlier trace of the same launch would be reused
    try:
        with pytest.raises(AssertionError, match="a stage of 32 bytes"):
            test_shared_memory_stages_are_tma_aligned(*CASES[0])
    finally:
        jax.clear_caches()


# ---- compiled on the GPU at the 8B shapes ------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(18560, 4096), (4096, 8192), (21504, 4096), (4096, 21504)])
def test_w8a8_8b_shapes_on_gpu(rng, N, K):
    """Every M the engine decodes at: right against the reference, rows bit-identical to the same rows at M = 256
    (several x tiles per CTA), alone (n8) and in a 16 / 40-row batch, bf16 and relu^2 outputs alike."""
    q, s = _fp8(rng, N, K)
    x = _x(rng, 256, K)
    y = w8m.w8a8_gemv_mosaic(x, q, s, out_dtype=F32)
    assert rel_err(y, w8a16.w8a8_gemv_reference(x, q, s, out_dtype=F32)) < _tol(False)
    for rows in (slice(0, 1), slice(0, 16), slice(0, 40), slice(200, 201)):
        np.testing.assert_array_equal(np.asarray(w8m.w8a8_gemv_mosaic(x[rows], q, s, out_dtype=F32)),
                                      np.asarray(y[rows]))
    for epilogue in (None, "relu2"):
        yb = w8m.w8a8_gemv_mosaic(x, q, s, epilogue=epilogue)
        np.testing.assert_array_equal(np.asarray(w8m.w8a8_gemv_mosaic(x[7:8], q, s, epilogue=epilogue)),
                                      np.asarray(yb[7:8]))
        np.testing.assert_array_equal(np.asarray(yb), np.asarray(epilogues.apply(y, epilogue).astype(jnp.bfloat16)))
