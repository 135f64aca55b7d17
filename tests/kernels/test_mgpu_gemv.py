"""Mosaic GPU arms of w8a16_gemv / w4a16_gemv (pallas_kernels/mgpu_gemv*.py) against their dequantize-then-matmul
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
from pallas_kernels import mgpu_gemv_w4 as w4m
from pallas_kernels import mgpu_gemv_w8 as w8m
from pallas_kernels import epilogues, registry, w4a16, w8a16
from pallas_kernels.mgpu_gemv import GemvConfig
from pallas_kernels.split_partials import SplitPartials, split_halves
from tests.kernels.mosaic_smem import check_lowered
from tests.kernels.ptx_emulator import bf16_pairs, element_map, run_ptx
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


# (M, N, K, config): N = 192 with 128-row tiles leaves a half-empty last tile (64-row tiles: N = 128, two row
# blocks, is enough); M = 17 pads x rows to 24; K = 384 with 2 stages reuses a stage's buffers;
# split_k=2 takes the float32-partials output path, bf16 outputs the direct (transposed-store) path.
W8_CASES = [(3, 128, 384, GemvConfig(64, 2)),
            (5, 192, 512, GemvConfig(128, 3, 2)),
            (17, 128, 256, GemvConfig(64, 4)),
            # several 16-row x tiles per CTA: auto (M = 40: three, the last one part-filled) and a fixed 2 of 5
            (40, 128, 384, GemvConfig(64, 2)),
            (70, 128, 512, GemvConfig(128, 2, 2, m_tiles=2)),
            # several 128-wide K blocks per pipeline step, split and unsplit
            (5, 128, 1024, GemvConfig(64, 2, 2, k_blocks=2)),
            (3, 192, 1024, GemvConfig(128, 3, k_blocks=4))]


@pytest.mark.parametrize("M,N,K,config", W8_CASES, ids=lambda v: str(v))
def test_w8a16_mosaic_matches_reference(rng, interpret, M, N, K, config):
    x, (q, s) = _x(rng, M, K), _fp8(rng, N, K)
    ref = w8a16.w8a16_reference(x, q, s, out_dtype=F32)
    y = w8m.w8a16_gemv_mosaic(x, q, s, out_dtype=F32, interpret=interpret, config=config)
    _finite(y)
    assert y.shape == (M, N) and y.dtype == F32
    assert rel_err(y, ref) < 1e-5
    yb = w8m.w8a16_gemv_mosaic(x, q, s, interpret=interpret, config=config)      # bf16 out (direct when no split)
    _finite(yb)
    assert yb.dtype == jnp.bfloat16 and rel_err(yb, ref) < 4e-3


W4_CASES = [(3, 192, 1024, GemvConfig(128, 2)),
            (6, 128, 1024, GemvConfig(64, 2, 2)),
            (17, 64, 512, GemvConfig(64, 2)),
            # several 16-row x tiles per CTA: auto (M = 40: three) and a fixed 2 of 5, split
            (40, 128, 1024, GemvConfig(64, 2)),
            (70, 192, 1024, GemvConfig(128, 2, 2, m_tiles=2)),
            (3, 128, 2048, GemvConfig(64, 2, 2, k_blocks=2))]


@pytest.mark.parametrize("M,N,K,config", W4_CASES, ids=lambda v: str(v))
def test_w4a16_mosaic_matches_reference(rng, interpret, M, N, K, config):
    x, (p, s, g) = _x(rng, M, K), _nvfp4(rng, N, K)
    ref = w4a16.w4a16_reference(x, p, s, g, out_dtype=F32)
    y = w4m.w4a16_gemv_mosaic(x, p, s, g, out_dtype=F32, interpret=interpret, config=config)
    _finite(y)
    assert y.shape == (M, N) and rel_err(y, ref) < 1e-5
    yb = w4m.w4a16_gemv_mosaic(x, p, s, g, interpret=interpret, config=config)
    _finite(yb)
    assert yb.dtype == jnp.bfloat16 and rel_err(yb, ref) < 4e-3


# (kernel, M, N, K, config): the direct bf16 store (relu^2 in the kernel), split-K partials (relu^2 after XLA's sum),
# several x tiles per CTA, and w4's split halves
EPILOGUE_CASES = [("w8a16", 3, 128, 384, GemvConfig(64, 2)),
                  ("w8a16", 5, 192, 512, GemvConfig(128, 3, 2)),
                  ("w8a16", 40, 128, 384, GemvConfig(64, 2)),
                  ("w4a16", 3, 192, 1024, GemvConfig(128, 2)),
                  ("w4a16", 6, 128, 1024, GemvConfig(64, 2, 2))]


def _arms(kernel, rng, N, K):
    """(weight args, Mosaic arm, Triton arm, reference) of a GEMV kernel."""
    if kernel == "w8a16":
        return _fp8(rng, N, K), w8m.w8a16_gemv_mosaic, w8a16.w8a16_gemv_pallas, w8a16.w8a16_reference
    return _nvfp4(rng, N, K), w4m.w4a16_gemv_mosaic, w4a16.w4a16_gemv_pallas, w4a16.w4a16_reference


@pytest.mark.parametrize("kernel,M,N,K,config", EPILOGUE_CASES, ids=str)
def test_epilogue_equals_the_unfused_composition(rng, interpret, kernel, M, N, K, config):
    """relu^2 in the kernel (before the direct bf16 store) or after the split-K sum gives, bit for bit, relu^2 on
    the arm's own float32 output and then the cast; so do the Triton arm and the reference (outputs start as NaN
    in interpret mode: an unwritten row fails)."""
    x = _x(rng, M, K)
    args, mosaic, triton, reference = _arms(kernel, rng, N, K)
    for arm, kw in ((mosaic, dict(interpret=interpret, config=config)), (triton, dict(interpret=interpret)),
                    (reference, {})):
        y = arm(x, *args, out_dtype=F32, **kw)
        assert (np.asarray(y) < 0).mean() > 0.2                       # relu has work to do
        for out_dtype in (jnp.bfloat16, F32):
            got = arm(x, *args, out_dtype=out_dtype, epilogue="relu2", **kw)
            assert got.dtype == out_dtype
            np.testing.assert_array_equal(np.asarray(got), np.asarray(epilogues.relu2(y).astype(out_dtype)))
    with pytest.raises(ShapeError, match="epilogue expected None or one of"):
        mosaic(x, *args, epilogue="gelu", interpret=interpret, config=config)


def test_tail_split_epilogue_matches_the_unfused_composition(rng, interpret, monkeypatch):
    """The tail-split launch: whole row blocks put relu^2 in their direct store, the tail pieces after their sum."""
    sms = w8m.H200_SMS if not interpret else 4
    monkeypatch.setattr(w8m, "H200_SMS", sms)
    M, N, K = 3, 64 * (sms + 1), 256
    x, (q, s) = _x(rng, M, K), _fp8(rng, N, K)
    config = GemvConfig(64, 2, 1, tail_split=2)
    y = w8m.w8a16_gemv_mosaic(x, q, s, out_dtype=F32, interpret=interpret, config=config)
    got = w8m.w8a16_gemv_mosaic(x, q, s, epilogue="relu2", interpret=interpret, config=config)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(epilogues.relu2(y).astype(jnp.bfloat16)))


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
    y = w4m.w4a16_gemv_mosaic(x, packed, scale, g, out_dtype=F32, interpret=interpret, config=GemvConfig(64, 2))
    want = np.asarray(qf.dequantize_nvfp4(packed, scale, g))[:, cols].T
    np.testing.assert_array_equal(np.asarray(y), want)


# w4 with 2 stages (instead of the shape's default 3) changes the pipeline depth, not a row's arithmetic: --run-slow
# (the 2-stage w4 pipeline runs in W4_CASES and EPILOGUE_CASES, w4 batch invariance in the default-config case)
@pytest.mark.parametrize("kernel,config", [("w8a16", None), ("w4a16", None),
                                           pytest.param("w4a16", GemvConfig(64, 2), marks=pytest.mark.slow)],
                         ids=str)
def test_rows_are_batch_invariant(rng, interpret, kernel, config):
    """Row i of an M=16 (and M=8) batch is bit-identical to the same row computed alone. M <= 8 runs one 8-row x
    tile (an n8 wgmma), larger M 16-row tiles: on the GPU rows agree across the two (the hardware computes each
    output column alike whatever N); in interpret mode the emulated wgmma is XLA's CPU dot, whose blocking depends
    on N, so there the classes are compared within themselves (and bitwise across them with small_m=False), and
    a CTA's several x tiles (one wider wgmma) against one tile per CTA to a tolerance."""
    N, K = 128, 512
    x16 = _x(rng, 16, K)

    gemv, blocks = (w8m.w8a16_gemv_mosaic, w8m.w8a16_gemv_blocks) if kernel == "w8a16" else (
        w4m.w4a16_gemv_mosaic, w4m.w4a16_gemv_blocks)
    args = _fp8(rng, N, K) if kernel == "w8a16" else _nvfp4(rng, N, K)
    config = config or blocks(N, K)
    run = lambda x, **kw: np.asarray(gemv(x, *args, out_dtype=F32, interpret=interpret,
                                          config=dataclasses.replace(config, **kw)))
    y16, y8 = run(x16), run(x16[:8])
    for i in (0, 6):
        np.testing.assert_array_equal(run(x16[i:i + 1])[0], y8[i])                 # n8 against n8
        if not interpret:
            np.testing.assert_array_equal(run(x16[i:i + 1])[0], y16[i])            # n8 against n16 (hardware)
    for i in (0, 15):                                                                 # 16-row tiles at every M
        np.testing.assert_array_equal(run(x16[i:i + 1], small_m=False)[0], y16[i])
    x40 = jnp.concatenate([x16, _x(rng, 24, K)])
    np.testing.assert_array_equal(run(x40, m_tiles=1)[:16], y16)                     # one 16-row tile per CTA
    if interpret:        # n48 against n16: XLA's CPU dot blocks by N on some CPUs (AMD EPYC)
        assert rel_err(run(x40)[:16], y16) < 1e-6
    else:                                                                             # several tiles per CTA
        np.testing.assert_array_equal(run(x40)[:16], y16)


def test_no_races_in_the_pipeline(rng):
    """The interpreter's happens-before race detector over a multi-step, multi-stage call."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if jax.default_backend() == "gpu":
        pytest.skip("interpret-mode check")
    x, (q, s) = _x(rng, 2, 512), _fp8(rng, 64, 512)
    y = w8m.w8a16_gemv_mosaic(x, q, s, out_dtype=F32, interpret=plgpu.InterpretGPUParams(detect_races=True),
                             config=GemvConfig(64, 2))
    assert rel_err(y, w8a16.w8a16_reference(x, q, s, out_dtype=F32)) < 1e-5
    assert not get_races().races_found


def test_bad_inputs_raise_typed_errors(rng):
    x, (q, s) = _x(rng, 2, 256), _fp8(rng, 128, 256)
    with pytest.raises(ShapeError, match="K % 128"):
        w8m.w8a16_gemv_mosaic(_x(rng, 2, 320), *_fp8(rng, 128, 320))
    with pytest.raises(ShapeError, match="N % 64"):
        w8m.w8a16_gemv_mosaic(x, *_fp8(rng, 200, 256))
    with pytest.raises(ShapeError, match="x expected bfloat16"):
        w8m.w8a16_gemv_mosaic(x.astype(F32), q, s)
    with pytest.raises(ShapeError, match="scale expected"):
        w8m.w8a16_gemv_mosaic(x, q, s[:, :1])
    with pytest.raises(ShapeError, match="block_n"):
        w8m.w8a16_gemv_mosaic(x, q, s, config=GemvConfig(block_n=32))
    with pytest.raises(ShapeError, match="split_k=3"):
        w8m.w8a16_gemv_mosaic(x, q, s, config=GemvConfig(split_k=3), interpret=True)
    with pytest.raises(ShapeError, match="stages >= 1 .w4: >= 2"):
        w4m.w4a16_gemv_mosaic(_x(rng, 2, 512), *_nvfp4(rng, 64, 512), config=GemvConfig(64, 1))
    with pytest.raises(ShapeError, match="config.m_tiles expects 0 .auto. to 16"):
        w8m.w8a16_gemv_mosaic(x, q, s, config=GemvConfig(m_tiles=17))
    with pytest.raises(ShapeError, match="config.m_tiles=16 needs 327680 bytes of shared memory with 4 stages"):
        w8m.w8a16_gemv_mosaic(_x(rng, 2, 512), *_fp8(rng, 64, 512), config=GemvConfig(64, 4, m_tiles=16),
                             interpret=True)
    with pytest.raises(ShapeError, match="config.k_blocks expects 1 to 4"):
        w8m.w8a16_gemv_mosaic(x, q, s, config=GemvConfig(k_blocks=5))
    with pytest.raises(ShapeError, match="K=384 is not a multiple of the 256-wide pipeline step .k_blocks=2."):
        w8m.w8a16_gemv_mosaic(_x(rng, 2, 384), *_fp8(rng, 64, 384), config=GemvConfig(64, 2, k_blocks=2))
    with pytest.raises(ShapeError, match="w4: 2; Mosaic finds no bank-conflict-free scale load"):
        w4m.w4a16_gemv_mosaic(_x(rng, 2, 1024), *_nvfp4(rng, 64, 1024), config=GemvConfig(64, 2, k_blocks=4))
    with pytest.raises(ShapeError, match="config.tail_split expects 0 .off. to 16, and only for w8"):
        w8m.w8a16_gemv_mosaic(x, q, s, config=GemvConfig(64, 2, tail_split=17))
    with pytest.raises(ShapeError, match="config.tail_split expects"):
        w4m.w4a16_gemv_mosaic(_x(rng, 2, 512), *_nvfp4(rng, 64, 512), config=GemvConfig(tail_split=1))
    with pytest.raises(ShapeError, match=r"reduce='cluster' needs at most 8 split CTAs and \(split - 1\) x 64 x 128"):
        w4m.w4a16_gemv_mosaic(_x(rng, 256, 2048), *_nvfp4(rng, 64, 2048),
                             config=GemvConfig(64, 2, 8, m_tiles=8, reduce="cluster"))
    with pytest.raises(ShapeError, match="config.reduce expects 'xla' or 'cluster' .a portable cluster: split_k and "
                                         "tail_split <= 8"):
        w8m.w8a16_gemv_mosaic(x, q, s, config=GemvConfig(split_k=1, tail_split=16, reduce="cluster"))
    with pytest.raises(ShapeError, match="config.reduce expects"):
        w4m.w4a16_gemv_mosaic(_x(rng, 2, 512), *_nvfp4(rng, 64, 512), config=GemvConfig(split_k=16, reduce="cluster"))
    with pytest.raises(ShapeError, match="w8: the tail pieces of an unsplit launch, split_k=1"):
        w8m.w8a16_gemv_mosaic(x, q, s, config=GemvConfig(split_k=2, reduce="cluster"))
    with pytest.raises(ShapeError, match="config.reduce expects"):
        w8m.w8a16_gemv_mosaic(x, q, s, config=GemvConfig(tail_split=2, reduce="atomic"))
    with pytest.raises(ShapeError, match="tail_split=2 does not divide the 3 K steps of 128"):
        w8m.w8a16_gemv_mosaic(_x(rng, 2, 384), *_fp8(rng, 64 * 133, 384), config=GemvConfig(64, 2, 1, tail_split=2),
                             interpret=True)
    p, s4, g = _nvfp4(rng, 64, 768)
    with pytest.raises(ShapeError, match="K % 512"):
        w4m.w4a16_gemv_mosaic(_x(rng, 2, 768), p, s4, g)
    with pytest.raises(ShapeError, match="scale expected"):
        w4m.w4a16_gemv_mosaic(_x(rng, 2, 768), p, s4.astype(F32), g)


def test_registry_serves_the_mosaic_arm():
    for name, fn in (("w8a16_gemv", w8m.w8a16_gemv_mosaic), ("w4a16_gemv", w4m.w4a16_gemv_mosaic)):
        res = registry.resolve(name, "mosaic", platform="gpu")
        assert res.impl == "mosaic" and res.kernel.func is fn
        assert registry.resolve(name, "triton", platform="gpu").impl == "pallas"
        assert registry.resolve(name, "auto", platform="cpu").impl == "reference"
        with pytest.raises(Exception, match="no mosaic implementation"):
            registry.resolve(name, "mosaic", platform="cpu")
    # GPU defaults from the H200 benchmark: Mosaic won both (pallas_kernels/mgpu_gemv.py, registry comment)
    assert registry.resolve("w8a16_gemv", "auto", platform="gpu").impl == "mosaic"
    assert registry.resolve("w4a16_gemv", "auto", platform="gpu").impl == "mosaic"


def test_supports_matches_the_typed_errors():
    assert mg.supports("w8a16_gemv", 18560, 4096, jnp.bfloat16) and mg.supports("w4a16_gemv", 4096, 8192, jnp.bfloat16)
    assert not mg.supports("w8a16_gemv", 200, 256, jnp.bfloat16)
    assert not mg.supports("w8a16_gemv", 128, 320, jnp.bfloat16)
    assert not mg.supports("w4a16_gemv", 64, 768, jnp.bfloat16)
    assert not mg.supports("w8a16_gemv", 128, 256, jnp.float32)


def test_w8_defaults_and_k_blocks_resolution():
    """in_proj-like shapes (>= 2 row blocks per SM) run unsplit with two K blocks per step, others split K; auto
    multi-tile launches (M > 16) fall back to one block per step, explicit m_tiles keep what was asked."""
    cfg = w8m.w8a16_gemv_blocks(18560, 4096)
    assert (cfg.split_k, cfg.k_blocks) == (1, 2)
    assert (w8m.w8a16_gemv_blocks(4096, 8192).split_k, w8m.w8a16_gemv_blocks(4096, 8192).k_blocks) == (8, 1)
    assert w8m.w8a16_gemv_blocks(18560, 3840).reduce == "xla"           # no tail pieces: nothing for a cluster to add
    assert [mg.resolve_k_blocks(cfg, m).k_blocks for m in (1, 16, 17, 256)] == [2, 2, 1, 1]
    assert mg.resolve_k_blocks(dataclasses.replace(cfg, m_tiles=2), 64).k_blocks == 2


def test_w4_defaults_add_split_halves_in_clusters_up_to_m64():
    """w4 in_proj (split 2): the halves meet in 2-CTA clusters at M <= 64 and in XLA's sum above (the same bits
    either way; benchmarks/notes/gemv.md); out_proj's split 4 in XLA."""
    assert [w4m.w4a16_gemv_blocks(18560, 4096, m).reduce for m in (1, 16, 64, 65, 256)] == ["cluster"] * 3 + ["xla"] * 2
    assert w4m.w4a16_gemv_blocks(18560, 4096).split_k == 2
    assert {w4m.w4a16_gemv_blocks(4096, 8192, m).reduce for m in (1, 256)} == {"xla"}


def test_tail_split_blocks_and_default():
    """in_proj's 290 row blocks: 264 (two per SM) whole, the last 26 in two K pieces; shapes without a tail (a whole
    number of blocks per SM, or fewer blocks than SMs) are unchanged."""
    assert w8m.w8a16_gemv_blocks(18560, 4096).tail_split == 2
    assert w8m.w8a16_gemv_blocks(18560, 3840).tail_split == 0          # 15 two-block steps: no whole halves
    assert w8m.tail_blocks(290, 2) == (264, 26)
    assert w8m.tail_blocks(290, 0) == (290, 0) and w8m.tail_blocks(264, 2) == (264, 0)
    assert w8m.tail_blocks(64, 8) == (64, 0)


def test_tail_split_matches_reference(rng, interpret, monkeypatch):
    """One row block more than the SMs the split counts (132 on the GPU, 4 here in interpret mode): the last block
    runs as two K pieces whose float32 partials are added in order (XLA in interpret mode, a CTA cluster compiled);
    the whole blocks keep the unsplit launch's bits and every row (outputs start as NaN in interpret mode) matches
    the reference."""
    sms = w8m.H200_SMS if not interpret else 4
    monkeypatch.setattr(w8m, "H200_SMS", sms)
    assert w8m.tail_blocks(sms + 1, 2) == (sms, 1)                 # the launch below has its one tail block
    M, N, K = 3, 64 * (sms + 1), 256
    x, (q, s) = _x(rng, M, K), _fp8(rng, N, K)
    ref = w8a16.w8a16_reference(x, q, s, out_dtype=F32)
    base = GemvConfig(64, 2, 1)
    y = np.asarray(w8m.w8a16_gemv_mosaic(x, q, s, out_dtype=F32, interpret=interpret,
                                        config=dataclasses.replace(base, tail_split=2)))
    _finite(y)
    y0 = np.asarray(w8m.w8a16_gemv_mosaic(x, q, s, out_dtype=F32, interpret=interpret, config=base))
    np.testing.assert_array_equal(y[:, :sms * 64], y0[:, :sms * 64])
    assert rel_err(y[:, sms * 64:], ref[:, sms * 64:]) < 1e-5 and rel_err(y, ref) < 1e-5
    yb = w8m.w8a16_gemv_mosaic(x, q, s, interpret=interpret, config=dataclasses.replace(base, tail_split=2))
    _finite(yb)
    assert yb.dtype == jnp.bfloat16 and rel_err(yb, ref) < 4e-3


def test_split_k_partials_sum_in_a_fixed_order():
    """The split-K epilogue adds partials (stored as uint16 halves) as ((p0 + p1) + p2) + p3 for every M (no
    shape-dependent reduce), and hands them on unreduced when asked."""
    rng = np.random.default_rng(0)
    parts = jnp.asarray(rng.standard_normal((4, 16, 64)), F32)
    halves = jnp.stack(split_halves(parts))                                      # [2, 4, 16, 64]
    want = ((parts[0] + parts[1]) + parts[2]) + parts[3]
    for m in (1, 4, 16):
        np.testing.assert_array_equal(np.asarray(mg._finish(halves, False, m, F32)), np.asarray(want[:m]))
    unreduced = mg._finish(halves, False, 1, F32, unreduced=True)
    assert isinstance(unreduced, SplitPartials) and unreduced.values is halves


# ---- the NVFP4 decoder's PTX, run by a small PTX emulator, and its register map against Mosaic's layouts ------
def test_e2m1_ptx_is_exact_for_every_code_and_scale():
    """Every packed byte (two E2M1 codes) times every finite E4M3 scale: value * scale * 2^-8, exactly."""
    scales = np.arange(256, dtype=np.uint32)
    (sc,) = run_ptx(w4m._E4M3_TO_BF16X2_SCALE, 1, scales)
    sv = scales.astype(np.uint8).view(jnp.float8_e4m3fn).astype(np.float64)
    fin = ~np.isnan(sv)
    np.testing.assert_array_equal(bf16_pairs(sc)[fin], np.stack([sv, sv], -1)[fin] * 2.0 ** 118)
    b = np.arange(256, dtype=np.uint32)
    words = b | (np.roll(b, 1) << 8) | (np.roll(b, 2) << 16) | (np.roll(b, 3) << 24)
    outs = run_ptx(w4m._E2M1X8_TO_BF16, 4, words[:, None], sc[None, fin])    # [256 words, finite scales]
    e2m1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    for k, o in enumerate(outs):
        byte = np.roll(b, k)[:, None]
        want = np.stack([e2m1[byte & 15], e2m1[byte >> 4]], -1) * sv[fin][None, :, None] * 2.0 ** -8
        np.testing.assert_array_equal(bf16_pairs(o), want)


def test_e2m1_register_map_matches_the_permutation():
    """The decoder re-labels registers without moving data: for every thread, the element it places at logical
    column L (WGMMA layout) must be the loaded element at physical column perm64[L], in the same row."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    src = element_map(fa.WGMMA_LAYOUT_UPCAST_4X, (64, 128))
    dst4 = element_map(fa.WGMMA_LAYOUT, (64, 256))
    scl = element_map(w4m.W4_SCALE_LAYOUT.to_mgpu(), (64, 16))
    perm = w4m.perm64(np.arange(256)[None])[0]
    for c, h, i, u in np.ndindex(4, 2, 8, 2):                                    # w4: vector (c, h), byte i, nibble u
        prow, pbyte = np.divmod(src[:, 0, c, 0, 0, h, 0, 0, 0, 0, i], 128)
        srow, sgroup = np.divmod(scl[:, 0, 0, 0, 0, h, 0, 0, c, 0, 0, 0, 0], 16)
        lrow, lcol = np.divmod(dst4[:, 0, 8 * c + i, 0, 0, h, 0, 0, 0, 0, u], 256)
        assert np.array_equal(prow, lrow) and np.array_equal(prow, srow)
        assert np.array_equal(perm[lcol], 2 * pbyte + u) and np.array_equal(pbyte // 8, sgroup)


def test_perm64_is_a_permutation():
    k = np.arange(256)[None]
    assert np.array_equal(np.sort(w4m.perm64(k)), k) and not np.array_equal(w4m.perm64(k), k)


# ---- compiled on the GPU at the 8B shapes ------------------------------------------------------------------------
SHAPES_8B = [(18560, 4096), (4096, 8192)]


W8_GPU_CONFIGS = [GemvConfig(64, 6), None, GemvConfig(64, 3, 2, k_blocks=2)]
# None = the default for the shape. 64/4 gave wrong, M-dependent rows before each step waited for its own wgmmas
# (_w4_kernel; ptxas had not serialized them): kept as the regression case.
W4_GPU_CONFIGS = [None, GemvConfig(64, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", W8_GPU_CONFIGS, ids=str)
@pytest.mark.parametrize("N,K", SHAPES_8B)
def test_w8a16_mosaic_8b_shapes_on_gpu(rng, N, K, cfg):
    (q, s) = _fp8(rng, N, K)
    x16 = _x(rng, 16, K)
    y16 = w8m.w8a16_gemv_mosaic(x16, q, s, out_dtype=F32, config=cfg)
    assert rel_err(y16, w8a16.w8a16_reference(x16, q, s, out_dtype=F32)) < 1e-5
    for m in (1, 4):
        np.testing.assert_array_equal(np.asarray(w8m.w8a16_gemv_mosaic(x16[:m], q, s, out_dtype=F32, config=cfg)),
                                      np.asarray(y16[:m]))
    yb = w8m.w8a16_gemv_mosaic(x16, q, s, config=cfg)
    np.testing.assert_array_equal(np.asarray(w8m.w8a16_gemv_mosaic(x16[3:4], q, s, config=cfg)), np.asarray(yb[3:4]))
    assert rel_err(yb, y16) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["w8a16", "w4a16"])
@pytest.mark.parametrize("N,K", SHAPES_8B)
def test_k_blocks_keep_the_bits_on_gpu(rng, N, K, kernel):
    """Two or four K blocks per pipeline step change when wgmmas are awaited, not what a row computes: the same
    bits as one block per step at the same split (what lets resolve_k_blocks choose k_blocks from M)."""
    if kernel == "w8a16":
        args, fn, base = _fp8(rng, N, K), w8m.w8a16_gemv_mosaic, GemvConfig(64, 2, 2)
    else:
        args, fn, base = _nvfp4(rng, N, K), w4m.w4a16_gemv_mosaic, GemvConfig(64, 3, 2)
    for m in (1, 16):
        x = _x(rng, m, K)
        y1 = np.asarray(fn(x, *args, out_dtype=F32, config=base))
        for kb in (2, 4) if kernel == "w8a16" else (2,):
            np.testing.assert_array_equal(np.asarray(fn(x, *args, out_dtype=F32,
                                                        config=dataclasses.replace(base, k_blocks=kb))), y1)


@pytest.mark.gpu
def test_gpu_widening_is_exact_for_every_e4m3_code():
    """All 256 E4M3 codes (NaN codes excepted) through the compiled widening: one-hot x picks single weights."""
    n, k = np.meshgrid(np.arange(128), np.arange(256), indexing="ij")
    w = jnp.asarray(((k + 16 * n) % 256).astype(np.uint8)).view(jnp.float8_e4m3fn)   # every row: all codes
    w = jnp.where(jnp.isnan(w.astype(F32)), jnp.zeros_like(w), w)
    s = jnp.asarray([[0.75, 1.5]], F32)
    x = jnp.eye(16, 256, dtype=jnp.bfloat16)
    for cfg in (GemvConfig(64, 1), GemvConfig(128, 2)):
        y = w8m.w8a16_gemv_mosaic(x, w, s, out_dtype=F32, config=cfg)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(w.astype(F32)[:, :16].T * 0.75))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["w8a16", "w4a16"])
@pytest.mark.parametrize("N,K", SHAPES_8B)
def test_mosaic_gemv_large_batch_on_gpu(rng, N, K, kernel):
    """Decode at batch 256 (several x tiles per CTA, one m64 x n(16 m_tiles) wgmma against one widened weight
    tile): rows bit-identical to the same rows at M = 1, 16 (n16) and 40 (n48), and right against the reference."""
    if kernel == "w8a16":
        args, fn, ref = _fp8(rng, N, K), w8m.w8a16_gemv_mosaic, w8a16.w8a16_reference
    else:
        args, fn, ref = _nvfp4(rng, N, K), w4m.w4a16_gemv_mosaic, w4a16.w4a16_reference
    x = _x(rng, 256, K)
    y = fn(x, *args, out_dtype=F32)
    assert rel_err(y, ref(x, *args, out_dtype=F32)) < 1e-5
    for rows in (slice(0, 16), slice(0, 40), slice(200, 201)):
        np.testing.assert_array_equal(np.asarray(fn(x[rows], *args, out_dtype=F32)), np.asarray(y[rows]))
    yb = fn(x, *args)
    np.testing.assert_array_equal(np.asarray(fn(x[100:101], *args)), np.asarray(yb[100:101]))


@pytest.mark.gpu
@pytest.mark.parametrize("tail", [2, 4])
def test_tail_cluster_reduction_on_gpu(rng, tail):
    """in_proj's tail blocks in K pieces: the in-kernel cluster reduction gives the bits of the XLA-summed
    partials, right against the reference, at one and at several x tiles per CTA."""
    N, K = SHAPES_8B[0]
    q, s = _fp8(rng, N, K)
    base = dataclasses.replace(w8m.w8a16_gemv_blocks(N, K), tail_split=tail)
    for m in (1, 40):
        x = _x(rng, m, K)
        ref = w8a16.w8a16_reference(x, q, s, out_dtype=F32)
        for od in (F32, jnp.bfloat16):
            yc = np.asarray(w8m.w8a16_gemv_mosaic(x, q, s, out_dtype=od, config=base).astype(F32))
            yx = np.asarray(w8m.w8a16_gemv_mosaic(x, q, s, out_dtype=od, config=dataclasses.replace(
                base, reduce="xla")).astype(F32))
            np.testing.assert_array_equal(yc, yx)
            assert rel_err(yc[:, 264 * 64:], ref[:, 264 * 64:]) < (1e-5 if od == F32 else 4e-3)


@pytest.mark.gpu
def test_split_k_cluster_reduction_on_gpu(rng):
    """w4 split-K partials added in the kernel (reduce='cluster', the in_proj default up to M = 64; here at
    out_proj's split 4) give the bits of XLA's sum."""
    N, K = SHAPES_8B[1]
    args, fn, base, ref = _nvfp4(rng, N, K), w4m.w4a16_gemv_mosaic, w4m.w4a16_gemv_blocks(N, K), w4a16.w4a16_reference
    for m in (1, 40):
        x = _x(rng, m, K)
        for od in (F32, jnp.bfloat16):
            yc = np.asarray(fn(x, *args, out_dtype=od, config=dataclasses.replace(base, reduce="cluster")).astype(F32))
            yx = np.asarray(fn(x, *args, out_dtype=od, config=dataclasses.replace(base, reduce="xla")).astype(F32))
            np.testing.assert_array_equal(yc, yx)
            assert rel_err(yc, ref(x, *args, out_dtype=F32)) < (1e-5 if od == F32 else 4e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", W4_GPU_CONFIGS, ids=str)
@pytest.mark.parametrize("N,K", SHAPES_8B)
def test_w4a16_mosaic_8b_shapes_on_gpu(rng, N, K, cfg):
    cfg = cfg or w4m.w4a16_gemv_blocks(N, K)
    p, s, g = _nvfp4(rng, N, K)
    x16 = _x(rng, 16, K)
    y16 = w4m.w4a16_gemv_mosaic(x16, p, s, g, out_dtype=F32, config=cfg)
    assert rel_err(y16, w4a16.w4a16_reference(x16, p, s, g, out_dtype=F32)) < 1e-5
    for m in (1, 4):
        np.testing.assert_array_equal(np.asarray(w4m.w4a16_gemv_mosaic(x16[:m], p, s, g, out_dtype=F32, config=cfg)),
                                      np.asarray(y16[:m]))


def _lowering_cases():
    """Every (split, output dtype, epilogue) for one K block per step; with 2 or 4 K blocks (a change to the K loop,
    not to the stores) both splits with the direct bf16 store + relu^2 and the float32 output, the other two output
    combinations with --run-slow."""
    for kernel, config in [("w8a16", GemvConfig()), ("w4a16", GemvConfig()), ("w8a16", GemvConfig(k_blocks=2)),
                           ("w8a16", GemvConfig(k_blocks=4)), ("w4a16", GemvConfig(k_blocks=2))]:
        for split in (1, 2):
            for out_dtype in (jnp.bfloat16, F32):
                for epilogue in (None, "relu2"):
                    more = config.k_blocks > 1 and (out_dtype, epilogue) not in ((jnp.bfloat16, "relu2"), (F32, None))
                    yield pytest.param(kernel, config, split, out_dtype, epilogue,
                                       marks=pytest.mark.slow if more else (),
                                       id=f"{epilogue}-{jnp.dtype(out_dtype).name}-{split}-{kernel}-{config}")


@pytest.mark.parametrize("kernel,config,split,out_dtype,epilogue", list(_lowering_cases()))
def test_lowers_for_cuda_on_every_output_path(kernel, config, split, out_dtype, epilogue):
    """Lower for CUDA on the CPU (layout inference included; interpret mode cannot see these errors), with the direct
    bf16 store (unsplit; relu^2 on the accumulator's registers first) and the float32 partials."""
    N, K, sd = 256, 2048, jax.ShapeDtypeStruct
    config = dataclasses.replace(config, block_n=64, stages=2, split_k=split)
    x = sd((1, K), jnp.bfloat16)
    kw = dict(out_dtype=out_dtype, epilogue=epilogue, config=config)
    if kernel == "w8a16":
        args = (sd((N, K), jnp.float8_e4m3fn), sd((N // 128, K // 128), F32))
        fn = lambda x, w, s: w8m.w8a16_gemv_mosaic(x, w, s, **kw)
    else:
        args = (sd((N, K // 2), jnp.uint8), sd((N, K // 16), jnp.float8_e4m3fn), sd((), F32))
        fn = lambda x, p, s, g: w4m.w4a16_gemv_mosaic(x, p, s, g, **kw)
    check_lowered(jax.jit(fn).trace(x, *args).lower(lowering_platforms=("cuda",)))


@pytest.mark.parametrize("reduce", ["cluster", "xla"])
@pytest.mark.parametrize("M", [1, 16, 40, 256])
def test_tail_split_lowers_for_cuda(M, reduce):
    """The in_proj default's tail split (a 2-CTA cluster with a shared-memory reduction, or float32 partials)
    lowers for CUDA at one to eight x tiles per CTA (M = 40: three, 192-byte float32 rows), both output paths."""
    N, K, sd = 18560, 4096, jax.ShapeDtypeStruct
    config = dataclasses.replace(w8m.w8a16_gemv_blocks(N, K), reduce=reduce)
    for out_dtype, epilogue in ((jnp.bfloat16, None), (F32, None), (jnp.bfloat16, "relu2")):
        fn = lambda x, w, s: w8m.w8a16_gemv_mosaic(x, w, s, out_dtype=out_dtype, epilogue=epilogue, config=config)
        check_lowered(jax.jit(fn).trace(sd((M, K), jnp.bfloat16), sd((N, K), jnp.float8_e4m3fn),
                                        sd((N // 128, K // 128), F32)).lower(lowering_platforms=("cuda",)))


@pytest.mark.parametrize("M", [1, 16, 40])
def test_split_k_cluster_reduction_lowers_for_cuda(M):
    """w4's split-K launch with reduce='cluster' (the split CTAs of a tile as one cluster, partials added in CTA 0's
    shared memory, bf16 straight out) lowers for CUDA, for both output paths."""
    N, K, sd = 4096, 8192, jax.ShapeDtypeStruct
    x = sd((M, K), jnp.bfloat16)
    for out_dtype, epilogue in ((jnp.bfloat16, None), (F32, None), (jnp.bfloat16, "relu2")):
        config = dataclasses.replace(w4m.w4a16_gemv_blocks(N, K), reduce="cluster")
        args = (sd((N, K // 2), jnp.uint8), sd((N, K // 16), jnp.float8_e4m3fn), sd((), F32))
        fn = lambda x, p, s, g: w4m.w4a16_gemv_mosaic(x, p, s, g, out_dtype=out_dtype, epilogue=epilogue,
                                                      config=config)
        assert config.split_k > 1
        check_lowered(jax.jit(fn).trace(x, *args).lower(lowering_platforms=("cuda",)))


@pytest.mark.parametrize("kernel", ["w8a16", "w4a16"])
@pytest.mark.parametrize("M", [1, 16, 256])
def test_up_proj_relu2_epilogue_lowers_for_cuda(kernel, M):
    """The 8B MLP's up_proj (N = 21504, K = 4096) with relu^2 in the default launch's epilogue lowers for CUDA."""
    N, K, sd = 21504, 4096, jax.ShapeDtypeStruct
    x = sd((M, K), jnp.bfloat16)
    if kernel == "w8a16":
        args = (sd((N, K), jnp.float8_e4m3fn), sd((N // 128, K // 128), F32))
        fn = lambda x, w, s: w8m.w8a16_gemv_mosaic(x, w, s, epilogue="relu2")
    else:
        args = (sd((N, K // 2), jnp.uint8), sd((N, K // 16), jnp.float8_e4m3fn), sd((), F32))
        fn = lambda x, p, s, g: w4m.w4a16_gemv_mosaic(x, p, s, g, epilogue="relu2")
    check_lowered(jax.jit(fn).trace(x, *args).lower(lowering_platforms=("cuda",)))
