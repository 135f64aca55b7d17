"""Norms with E4M3 output (pallas_kernels/norm_fp8.py) and the FP8 arms that take them pre-quantized."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax import ModelConfig, ModelLevers, NemotronMamba2Layer
from metrale_jax.errors import ShapeError
from metrale_jax.init import random_norm, random_ssm_weights
from metrale_jax.layers.projection import Projection
from metrale_jax.weights import containers as C
from metrale_jax.weights import quant_formats as qf
from pallas_kernels import norm_fp8, norms, registry
from tests.numpy_refs import rel_err


def _bits(a: qf.Fp8Activations):
    return np.asarray(a.q.view(jnp.uint8)), np.asarray(a.scale)


def _same(got: qf.Fp8Activations, ref: qf.Fp8Activations, exact: bool):
    """Interpret mode: the same bits up to rare one-step flips. The kernel's f32 sum of squares runs over its
    [rows, group] tile, the reference's over the whole array, and XLA picks the reduction tree per shape, so one
    norm value can round to the neighbouring bf16 (seed 1452713893: 1 code of 5120 one step off): codes then
    differ by one E4M3 step, or, if that value is its block's amax, the block's scale by at most 1%. Compiled:
    the same kind of differences, in rare elements."""
    (q, s), (rq, rs) = _bits(got), _bits(ref)
    if exact:
        s, rs = s.reshape(len(q), -1), rs.reshape(len(q), -1)                      # per row: [M] -> [M, 1]
        moved = np.repeat(s != rs, q.shape[1] // s.shape[1], axis=1)               # blocks whose amax moved
        assert np.sum(s != rs) <= 1 and np.all(np.abs(s - rs) <= 1e-2 * rs)
        off = (q != rq) & ~moved
        assert off.sum() <= max(2, 2e-4 * off.size)
        assert np.all(np.abs(q[off].astype(np.int16) - rq[off]) == 1)           # one E4M3 step, same sign
    else:
        assert np.mean(q != rq) < 1e-3
        assert np.max(np.abs(s - rs) / rs) < 1e-2


def _check_case(rng, M, W, GS, per_block, interpret, nb=None, amp=3.0):
    y = jnp.asarray(rng.standard_normal((M, W)) * amp, jnp.bfloat16)
    z = jnp.asarray(rng.standard_normal((M, W)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.5, 1.5, W), jnp.bfloat16)
    got = norm_fp8.gated_rmsnorm_fp8_pallas(y, z, w, group_size=GS, eps=1e-5, per_block=per_block,
                                            interpret=interpret, nb=nb)
    norm = norms.gated_rmsnorm_reference(y, z, w, group_size=GS, eps=1e-5)
    _same(got, norm_fp8.gated_rmsnorm_fp8_reference(y, z, w, group_size=GS, eps=1e-5, per_block=per_block),
          interpret)
    assert got.dtype == jnp.bfloat16 and got.width == (qf.FP8_BLOCK if per_block else W)
    assert rel_err(got.dequantize(), norm.astype(jnp.float32)) < 0.05          # E4M3 rounding only
    _same(norm_fp8.rmsnorm_fp8_pallas(y, w, eps=1e-5, per_block=per_block, interpret=interpret, nb=nb),
          norm_fp8.rmsnorm_fp8_reference(y, w, eps=1e-5, per_block=per_block), interpret)


@pytest.mark.parametrize("M,W,GS", [(5, 256, 64), (3, 512, 512), (40, 128, 32), (6, 512, 128)])
@pytest.mark.parametrize("per_block", [False, True])
@pytest.mark.parametrize("loop", [True, False], ids=["group-loop", "reshape"])
def test_kernel_matches_reference_bits(rng, interpret, M, W, GS, per_block, loop):
    """The E4M3 codes and scales of the unfused norm followed by quant_formats' quantizer (the reference), in
    both kernel forms (group tiles / one reshaped tile); M not a multiple of the rows per program (2 rows for
    W=512 with rows_elems 1024): the masked tail rows too."""
    _check_case(rng, M, W, GS, per_block, interpret, norm_fp8.NormFp8Blocks(rows_elems=1024, warps=4, loop=loop))


@pytest.mark.parametrize("per_block", [False, True])
def test_eps_dominated_rows_match_reference(rng, interpret, per_block):
    """Rows of mean square ~1e-5 (as eps): a wrong or misplaced eps moves most codes, not a rare one."""
    _check_case(rng, 9, 256, 64, per_block, interpret, norm_fp8.NormFp8Blocks(rows_elems=1024, warps=4), amp=3e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("W,GS", [(8192, 1024), (4096, 4096)])
@pytest.mark.parametrize("per_block", [False, True])
def test_kernel_8b_widths_on_gpu(rng, W, GS, per_block):
    """Compiled at the 8B widths (out_proj's gated norm, in_proj's norm): one row per program, 8 warps."""
    _check_case(rng, 67, W, GS, per_block, interpret=False)


def _check_groups(rng, M, W, GS, interpret, nb=None):
    """per_group: the reference's bits (norm rounded to bf16, then quantize_rows_fp8_blocks per group), every
    scale positive and finite, and within E4M3 rounding of the norm."""
    y = jnp.asarray(rng.standard_normal((M, W)) * 3, jnp.bfloat16)
    z = jnp.asarray(rng.standard_normal((M, W)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.5, 1.5, W), jnp.bfloat16)
    got = norm_fp8.gated_rmsnorm_fp8_pallas(y, z, w, group_size=GS, eps=1e-5, per_group=True, interpret=interpret,
                                            nb=nb)
    ref = norm_fp8.gated_rmsnorm_fp8_reference(y, z, w, group_size=GS, eps=1e-5, per_group=True)
    assert got.scale.shape == ref.scale.shape == (M, W // GS) and got.group == ref.group == GS
    assert got.dtype == jnp.bfloat16 and got.width == GS
    _same(got, ref, interpret)
    s = np.asarray(got.scale)
    assert np.all(np.isfinite(s)) and np.all(s > 0)
    # independent check of the reference: float64 norm, rounded to bf16, quantized per (row, group) in numpy
    h = np.asarray(y, np.float64) * np.asarray(z, np.float64) / (1 + np.exp(-np.asarray(z, np.float64)))
    hg = h.reshape(M, W // GS, GS)
    norm = (hg / np.sqrt(np.mean(hg * hg, axis=2, keepdims=True) + 1e-5)).reshape(M, W) * np.asarray(w, np.float64)
    norm = np.asarray(jnp.asarray(norm, jnp.bfloat16), np.float64).reshape(M, W // GS, GS)
    np.testing.assert_allclose(s, np.abs(norm).max(axis=2) / qf.E4M3_MAX, rtol=1e-2)
    assert rel_err(got.dequantize(), norm.reshape(M, W).astype(np.float32)) < 0.05          # E4M3 rounding only


@pytest.mark.parametrize("M,W,GS,rows_elems,groups_first", [(5, 512, 128, 4096, True), (33, 512, 256, 1024, True),
                                                            (33, 384, 128, 1024, False), (6, 256, 256, 512, True)])
def test_per_group_kernel_matches_reference_bits(rng, interpret, M, W, GS, rows_elems, groups_first):
    """One E4M3 scale per (row, norm group) from the (groups, row blocks) grid (or the reverse order): bit-equal
    to the reference in interpret mode; M not a multiple of the rows per program (4 rows for 256-column groups
    at 1024 elements, 2 at 512; 8 at 128 columns) checks the masked tail; W=384 has 3 groups (not a power of
    two)."""
    nb = norm_fp8.NormFp8Blocks(group_rows_elems=rows_elems, groups_first=groups_first)
    _check_groups(rng, M, W, GS, interpret, nb)


@pytest.mark.gpu
def test_per_group_kernel_8b_width_on_gpu(rng):
    """Compiled at out_proj's gated norm of the 8B model: width 8192, norm group 1024 (4 rows per program)."""
    _check_groups(rng, 67, 8192, 1024, interpret=False)


def test_per_group_errors_and_supports():
    """per_group needs a 128-multiple group (reference and kernel), excludes per_block; supports() says which
    shapes the per-group kernel takes."""
    y = jnp.ones((2, 256), jnp.bfloat16)
    w = jnp.ones(256, jnp.bfloat16)
    for fn in (norm_fp8.gated_rmsnorm_fp8_reference,
               lambda *a, **k: norm_fp8.gated_rmsnorm_fp8_pallas(*a, **k, interpret=True)):
        with pytest.raises(ValueError, match="per_group needs group_size a positive multiple of 128.*group_size 64"):
            fn(y, y, w, group_size=64, eps=1e-5, per_group=True)
        with pytest.raises(ValueError, match="per_group and per_block exclude each other"):
            fn(y, y, w, group_size=128, eps=1e-5, per_group=True, per_block=True)
    with pytest.raises(ValueError, match="per-group Pallas kernel takes a power-of-two group_size.*group_size 384"):
        norm_fp8.gated_rmsnorm_fp8_pallas(jnp.ones((2, 768), jnp.bfloat16), jnp.ones((2, 768), jnp.bfloat16),
                                          jnp.ones(768, jnp.bfloat16), group_size=384, eps=1e-5, per_group=True,
                                          interpret=True)
    assert norm_fp8.supports(8192, 1024, False, per_group=True) and norm_fp8.supports(384, 128, False, True)
    assert not norm_fp8.supports(8192, 1024, True, per_group=True)          # with per_block
    assert not norm_fp8.supports(8192, 64, False, per_group=True)           # under 128
    assert not norm_fp8.supports(768, 384, False, per_group=True)           # not a power of two
    assert not norm_fp8.supports(32768, 32768, False, per_group=True)       # over one block
    assert norm_fp8.supports(8192, 1024, False) == norm_fp8.supports(8192, 1024, False, per_group=False)


def test_kernel_errors_and_registry():
    x = jnp.ones((2, 96), jnp.bfloat16)
    with pytest.raises(ValueError, match="rmsnorm_fp8: the Pallas kernel takes a power-of-two width"):
        norm_fp8.rmsnorm_fp8_pallas(x, jnp.ones(96, jnp.bfloat16), eps=1e-5, per_block=False, interpret=True)
    x = jnp.ones((2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="per_block True"):
        norm_fp8.rmsnorm_fp8_pallas(x, jnp.ones(64, jnp.bfloat16), eps=1e-5, per_block=True, interpret=True)
    with pytest.raises(ValueError, match="z"):
        norm_fp8.gated_rmsnorm_fp8_pallas(x, x[:1], jnp.ones(64, jnp.bfloat16), group_size=32, eps=1e-5,
                                          per_block=False, interpret=True)
    assert registry.resolve("gated_rmsnorm_fp8", "interpret").impl == "interpret"


N, K = 96, 128


def test_projection_takes_producer_quantized_activations(rng):
    """fp8_prefill (rows) and fp8_native prefill (blocks) give the same result from x quantized their own way as
    from x; fp8_gemm_t also takes x quantized per 128 columns (computing with the producer's scales); an arm
    that does not quantize, or a scale of the wrong shape, raises naming the projection or kernel."""
    w = rng.standard_normal((N, K)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((5, K)), jnp.bfloat16)
    p = Projection("m.out_proj", N, K, kernels="reference")
    prefill = C.fp8_prefill_copy(w)
    p.install("fp8_prefill", p.prepare("fp8_prefill", prefill))
    assert p.input_quant("prefill", 5) == "rows"
    np.testing.assert_array_equal(p(qf.Fp8Activations(*qf.quantize_rows_fp8(x)), phase="prefill"), p(x))
    xb = qf.Fp8Activations(*qf.quantize_rows_fp8_blocks(x))
    want = np.asarray(xb.dequantize(), np.float64) @ np.asarray(prefill.dequantize(jnp.float32), np.float64).T
    assert rel_err(p(xb), want) < 5e-3                                       # bf16 output rounding only
    q, s = qf.quantize_fp8_block(w)
    p.install("fp8_native", p.prepare("fp8_native", C.Fp8Weight(jnp.asarray(q), jnp.asarray(s))), prefill=True)
    assert p.input_quant("prefill", 5) == "blocks" and p.input_quant("decode", 1) is None
    np.testing.assert_array_equal(p(qf.Fp8Activations(*qf.quantize_rows_fp8_blocks(x))), p(x))
    with pytest.raises(ShapeError, match=r"w8a16_gemv .* takes unquantized activations"):
        p(qf.Fp8Activations(*qf.quantize_rows_fp8(x[:1])), phase="decode")
    bad = qf.Fp8Activations(qf.quantize_rows_fp8(x)[0], jnp.ones((5, 3), jnp.float32))
    with pytest.raises(ShapeError, match=r"scale float32 \[5, 1\]"):
        p(bad)


# norm groups of 128 columns (d_inner 256 over 2 groups): the per-group E4M3 form takes multiples of 128
CFG = ModelConfig.from_hf(dict(vocab_size=64, hidden_size=128, hybrid_override_pattern="-M", mamba_num_heads=8,
                               mamba_head_dim=32, ssm_state_size=16, n_groups=2, chunk_size=8, intermediate_size=48))


@pytest.mark.parametrize("prefill_arm", ["fp8_prefill", "fp8_native"])
@pytest.mark.parametrize("gated_quant", ["group", "arm", "off"])
def test_layer_feeds_the_fp8_arms_from_the_fused_norms(rng, prefill_arm, gated_quant):
    """With an FP8-matrix-unit arm serving prefill, the layer's norms emit E4M3 (the fused kernels run: their
    names are in the traced program; the gated one as levers.gated_norm_quant says). in_proj's result, and
    out_proj's with the arm's own quantization, are bit-identical to the unfused path but in the E4M3 blocks where
    the fused and the plain norm kernel round the block's largest element to bf16 an ulp apart; per norm group,
    out_proj computes on the per-group reference's E4M3 (bits) and stays within E4M3 rounding of the unfused path."""
    k1, k2 = jax.random.split(jax.random.key(int(rng.integers(2**31))))
    ssm = random_ssm_weights(CFG, k2, jnp.float32)
    nv = {k: C.quantize_nvfp4_weight(getattr(ssm, k)) for k in ("in_proj", "out_proj")}   # no bf16 arm
    layer = NemotronMamba2Layer(random_norm(CFG, k1, jnp.float32), ssm.__class__(**{**ssm.__dict__, **nv}), CFG,
                                layer_idx=1, levers=ModelLevers(kernels="interpret", gated_norm_quant=gated_quant))
    if prefill_arm == "fp8_prefill":
        layer.set_fp8_prefill_weights(C.fp8_prefill_copy(ssm.in_proj), C.fp8_prefill_copy(ssm.out_proj))
    else:
        layer.set_fp8_weights(C.quantize_fp8_block_weight(ssm.in_proj), C.quantize_fp8_block_weight(ssm.out_proj),
                              prefill=True)
    assert set(layer.active_arm("prefill", 6).values()) == {prefill_arm}
    T = 6
    hidden = jnp.asarray(rng.standard_normal((T, CFG.hidden_size)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((T, CFG.mamba_num_heads, CFG.mamba_head_dim)), jnp.bfloat16)
    z = jnp.asarray(rng.standard_normal((T, CFG.d_inner)), jnp.bfloat16)
    def run():      # fresh functions per call: jax caches traces by function, and the dispatch is decided at trace
        fns = (lambda h: layer._project_in(h, "prefill")[1], lambda a, b, h: layer._project_out(a, b, h, "prefill"))
        text = str(jax.make_jaxpr(fns[0])(hidden)) + str(jax.make_jaxpr(fns[1])(y, z, hidden))
        return text, (fns[0](hidden), fns[1](y, z, hidden))

    text, fused = run()
    assert "rmsnorm_fp8" in text and ("gated_rmsnorm_fp8" in text) == (gated_quant != "off")
    assert ("gated_rmsnorm_fp8_groups" in text) == (gated_quant == "group")
    with registry.disabled("rmsnorm_fp8"), registry.disabled("gated_rmsnorm_fp8"):
        text, unfused = run()
        assert "rmsnorm_fp8" not in text
    gpu = jax.default_backend() == "gpu"     # interpret mode under XLA:GPU may keep bf16 intermediates in f32
    for i, (a, b) in enumerate(zip(fused, unfused)):
        if gpu or (i == 1 and gated_quant == "group"):
            assert rel_err(a, b) < 5e-2
        else:   # bit-identical but where the two norm kernels' bf16 results differ by an ulp at a block's amax
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)     # (seed 899829296: one E4M3 block)
            assert (a == b).mean() > 0.75 and rel_err(a, b) < 1e-2, ((a != b).mean(), rel_err(a, b))
    if gated_quant == "group" and not gpu:
        g = norm_fp8.gated_rmsnorm_fp8_reference(y.reshape(T, -1), z, layer.norm_weight[...],
                                                 group_size=CFG.gated_norm_group_size, eps=CFG.layer_norm_epsilon,
                                                 out_dtype=hidden.dtype, per_group=True)
        assert g.width == 128 and g.scale.shape == (T, 2)
        np.testing.assert_array_equal(np.asarray(fused[1], np.float32),
                                      np.asarray(hidden + layer.out_proj(g, phase="prefill"), np.float32))
