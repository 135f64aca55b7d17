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
    """Interpret mode: the same bits. Compiled: the norm's f32 sums may add in another order, which can move a
    bf16 rounding (and so a code, or a row's amax) in rare elements."""
    (q, s), (rq, rs) = _bits(got), _bits(ref)
    if exact:
        np.testing.assert_array_equal(q, rq)
        np.testing.assert_array_equal(s, rs)
    else:
        assert np.mean(q != rq) < 1e-3
        assert np.max(np.abs(s - rs) / rs) < 1e-2


def _check_case(rng, M, W, GS, per_block, interpret, nb=None):
    y = jnp.asarray(rng.standard_normal((M, W)) * 3, jnp.bfloat16)
    z = jnp.asarray(rng.standard_normal((M, W)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.5, 1.5, W), jnp.bfloat16)
    got = norm_fp8.gated_rmsnorm_fp8_pallas(y, z, w, group_size=GS, eps=1e-5, per_block=per_block,
                                            interpret=interpret, nb=nb)
    norm = norms.gated_rmsnorm_reference(y, z, w, group_size=GS, eps=1e-5)
    _same(got, norm_fp8.gated_rmsnorm_fp8_reference(y, z, w, group_size=GS, eps=1e-5, per_block=per_block),
          interpret)
    assert got.dtype == jnp.bfloat16 and got.per_block == per_block
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


@pytest.mark.gpu
@pytest.mark.parametrize("W,GS", [(8192, 1024), (4096, 4096)])
@pytest.mark.parametrize("per_block", [False, True])
def test_kernel_8b_widths_on_gpu(rng, W, GS, per_block):
    """Compiled at the 8B widths (out_proj's gated norm, in_proj's norm): one row per program, 8 warps."""
    _check_case(rng, 67, W, GS, per_block, interpret=False)


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


def test_projection_takes_its_own_quantization_only(rng):
    """fp8_prefill (rows) and fp8_native prefill (blocks) give the same result from pre-quantized x as from x;
    a mismatched quantization or an arm that does not quantize raises, naming the projection."""
    w = rng.standard_normal((N, K)).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((5, K)), jnp.bfloat16)
    p = Projection("m.out_proj", N, K, kernels="reference")
    p.install("fp8_prefill", p.prepare("fp8_prefill", C.fp8_prefill_copy(w)))
    assert p.input_quant("prefill", 5) == "rows"
    np.testing.assert_array_equal(p(qf.Fp8Activations(*qf.quantize_rows_fp8(x)), phase="prefill"), p(x))
    with pytest.raises(ShapeError, match=r"m.out_proj: input is E4M3 quantized per blocks but fp8_gemm_t"):
        p(qf.Fp8Activations(*qf.quantize_rows_fp8_blocks(x)))
    q, s = qf.quantize_fp8_block(w)
    p.install("fp8_native", p.prepare("fp8_native", C.Fp8Weight(jnp.asarray(q), jnp.asarray(s))), prefill=True)
    assert p.input_quant("prefill", 5) == "blocks" and p.input_quant("decode", 1) is None
    np.testing.assert_array_equal(p(qf.Fp8Activations(*qf.quantize_rows_fp8_blocks(x))), p(x))
    with pytest.raises(ShapeError, match=r"w8a16_gemv .* takes unquantized activations"):
        p(qf.Fp8Activations(*qf.quantize_rows_fp8(x[:1])), phase="decode")
    bad = qf.Fp8Activations(qf.quantize_rows_fp8(x)[0], jnp.ones((5, 3), jnp.float32))
    with pytest.raises(ShapeError, match=r"scale float32 \[5, 1\]"):
        p(bad)


CFG = ModelConfig.from_hf(dict(vocab_size=64, hidden_size=128, hybrid_override_pattern="-M", mamba_num_heads=4,
                               mamba_head_dim=32, ssm_state_size=16, n_groups=2, chunk_size=8, intermediate_size=48))


@pytest.mark.parametrize("prefill_arm", ["fp8_prefill", "fp8_native"])
@pytest.mark.parametrize("fuse_gated", [True, False])
def test_layer_feeds_the_fp8_arms_from_the_fused_norms(rng, monkeypatch, prefill_arm, fuse_gated):
    """With an FP8-matrix-unit arm serving prefill, the layer's norms emit E4M3 (the fused kernels run: their
    names are in the traced program; the gated one only with FUSE_GATED) and the projections' results are
    bit-identical to the unfused path."""
    monkeypatch.setattr(norm_fp8, "FUSE_GATED", fuse_gated)
    k1, k2 = jax.random.split(jax.random.key(int(rng.integers(2**31))))
    ssm = random_ssm_weights(CFG, k2, jnp.float32)
    nv = {k: C.quantize_nvfp4_weight(getattr(ssm, k)) for k in ("in_proj", "out_proj")}   # no bf16 arm
    layer = NemotronMamba2Layer(random_norm(CFG, k1, jnp.float32), ssm.__class__(**{**ssm.__dict__, **nv}), CFG,
                                layer_idx=1, levers=ModelLevers(kernels="interpret"))
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
        fns = (lambda h: layer._project_in(h, "prefill"), lambda a, b, h: layer._project_out(a, b, h, "prefill"))
        text = str(jax.make_jaxpr(fns[0])(hidden)) + str(jax.make_jaxpr(fns[1])(y, z, hidden))
        return text, (fns[0](hidden), fns[1](y, z, hidden))

    text, fused = run()
    assert "rmsnorm_fp8" in text and ("gated_rmsnorm_fp8" in text) == fuse_gated
    with registry.disabled("rmsnorm_fp8"), registry.disabled("gated_rmsnorm_fp8"):
        text, unfused = run()
        assert "rmsnorm_fp8" not in text
    for a, b in zip(fused, unfused):
        if jax.default_backend() == "gpu":    # interpret mode under XLA:GPU may keep bf16 intermediates in f32
            assert rel_err(a, b) < 5e-2
        else:
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
