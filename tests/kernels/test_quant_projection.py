"""Projection arms: each arm serves the calls its place in DECODE_ORDER / PREFILL_ORDER gives it, with its
own weights and kernel; install-time errors; the Mamba-2 layer's seed methods for installing copies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax import ModelConfig, ModelLevers, NemotronMamba2Layer
from metrale_jax.errors import KernelUnavailableError, ShapeError, WeightFormatError
from metrale_jax.init import random_norm, random_ssm_weights
from metrale_jax.layers.projection import DECODE_ORDER, PREFILL_ORDER, Projection, arm_reference
from metrale_jax.weights import containers as C
from metrale_jax.weights import quant_formats as qf
from pallas_kernels import registry
from pallas_kernels.epilogues import relu2
from tests.numpy_refs import rel_err

N, K = 72, 64
NAME = "backbone.layers.1.mixer.in_proj"


def _containers(rng):
    """Every arm's copy, each made from its own random weight so that the arms' results all differ."""
    w = lambda: rng.standard_normal((N, K)).astype(np.float32)
    q, s = qf.quantize_fp8_block(w())
    return {"dense": C.DenseWeight(jnp.asarray(w(), jnp.bfloat16)),
            "fp8_native": C.Fp8Weight(jnp.asarray(q), jnp.asarray(s)),
            "w4a4": C.W4a4Weight(C.quantize_nvfp4_weight(w())),
            "fp8_prefill": C.fp8_prefill_copy(w()),
            "nvfp4_t": C.quantize_nvfp4_weight(w()).transposed(),
            "nvfp4": C.quantize_nvfp4_weight(w())}


def _projection(cont, arms, kernels="reference", fp8_prefill=True):
    p = Projection(NAME, N, K, kernels=kernels)
    for arm in arms:
        p.install(arm, p.prepare(arm, cont[arm], prefill=fp8_prefill), prefill=fp8_prefill)
    return p


def _own_result(arm, w, x, phase, tokens):
    """The arm's kernel reference applied to the arm's own container."""
    ref = lambda name: registry.resolve(name, "reference").fn
    f32 = jnp.float32
    if arm == "dense":
        return ref("dense_matmul")(x, w.weight, out_dtype=f32)
    if arm == "fp8_native":
        return ref("w8a16_gemv" if phase == "decode" else "w8a16_gemm_pipelined")(x, w.weight, w.scale, out_dtype=f32)
    if arm == "w4a4":
        n = w.weight
        return ref("w4a4_gemm")(x, n.packed, n.scale, n.global_scale, n.input_scale, out_dtype=f32)
    if arm == "fp8_prefill":
        return ref("fp8_gemm_t")(x, w.weight, w.scale, out_dtype=f32)
    if arm == "nvfp4_t":
        return ref("w4a16_gemm_t")(x, w.packed_t, w.scale_t, w.global_scale, out_dtype=f32)
    return ref("w4a16_gemv")(x, w.packed, w.scale, w.global_scale, out_dtype=f32)


CASES = [("decode", arm) for arm in DECODE_ORDER] + [("prefill", arm) for arm in PREFILL_ORDER]


@pytest.mark.parametrize("phase,arm", CASES, ids=[f"{p}-{a}" for p, a in CASES])
def test_arm_serves_the_call(rng, phase, arm):
    """Install this arm and every arm after it in the phase's order: this one serves, with its own numbers."""
    order = DECODE_ORDER if phase == "decode" else PREFILL_ORDER
    cont = _containers(rng)
    installed = order[order.index(arm):]
    p = _projection(cont, installed)
    tokens = 3 if phase == "decode" else 5
    x = jnp.asarray(rng.standard_normal((tokens, K)), jnp.bfloat16)
    assert p.active_arm(phase, tokens) == arm
    y = p(x, phase=phase, out_dtype=jnp.float32)
    own = _own_result(arm, p.arm_weight(arm), x, phase, tokens)
    assert rel_err(y, own) < 1e-6
    assert rel_err(y, arm_reference(p.arm_weight(arm), x, out_dtype=jnp.float32)) < 0.15   # + activation quant
    for other in installed[1:]:
        assert rel_err(y, _own_result(other, p.arm_weight(other), x, phase, tokens)) > 0.3


def test_kernel_choice_within_arms(rng):
    cont = _containers(rng)
    p = _projection(cont, ("fp8_native", "nvfp4_t", "nvfp4"), fp8_prefill=False)
    assert p.active_arm("decode", 1) == "fp8_native" and p.active_kernel("decode", 1) == "w8a16_gemv"
    assert p.active_arm("prefill", 7) == "nvfp4_t"                                   # decode-only FP8
    assert p.active_kernel("prefill", 128) == "w4a16_gemm_t"
    assert p.active_kernel("prefill", 129) == "w4a16_gemm_t_m128"
    with registry.disabled("w4a16_gemm_t_m128"):
        assert p.active_kernel("prefill", 129) == "w4a16_gemm_t"
    x = jnp.asarray(rng.standard_normal((130, K)), jnp.bfloat16)
    y = p(x, phase="prefill", out_dtype=jnp.float32)
    assert rel_err(y, _own_result("nvfp4_t", p.arm_weight("nvfp4_t"), x, "prefill", 130)) < 1e-6
    p.set_fp8(cont["fp8_native"], prefill=True)
    assert p.active_kernel("prefill", 7) == "w8a16_gemm_pipelined"
    with registry.disabled("w8a16_gemm_pipelined"):
        assert p.active_kernel("prefill", 7) == "w8a16_gemm"


def test_install_errors(rng):
    cont = _containers(rng)
    p = Projection(NAME, N, K, kernels="reference")
    fp8 = cont["fp8_native"]
    with pytest.raises(WeightFormatError, match=rf"{NAME}: block scale .* must have shape \[1, 1\], got \[72\]"):
        p.set_fp8(C.Fp8Weight(fp8.weight, jnp.ones(N, jnp.float32)), prefill=True)
    with pytest.raises(WeightFormatError, match=f"{NAME}: FP8 weight tagged FP8_PER_TENSOR"):
        p.set_fp8(C.Fp8Weight(fp8.weight, jnp.float32(1), None, C.WeightQuantFormat.FP8_PER_TENSOR), prefill=True)
    with pytest.raises(WeightFormatError, match=rf"{NAME}: weight must have shape \[72, 32\]"):
        Projection(NAME, N, 32).set_fp8(fp8, prefill=True)
    with pytest.raises(WeightFormatError, match=f"{NAME}: expected an Nvfp4Weight, got Fp8Weight"):
        p.set_nvfp4(fp8)
    with pytest.raises(WeightFormatError, match=f"{NAME}: cannot install a str"):
        p.set_weight("weights")
    with registry.disabled("w8a16_gemv"):
        with pytest.raises(KernelUnavailableError, match=f"{NAME}: arm 'fp8_native' needs kernel 'w8a16_gemv'"):
            p.set_fp8(fp8, prefill=False)
    with registry.disabled("w8a16_gemm_pipelined", "w8a16_gemm"):
        with pytest.raises(KernelUnavailableError, match="'w8a16_gemm_pipelined' or 'w8a16_gemm'"):
            p.set_fp8(fp8, prefill=True)
        p.set_fp8(fp8, prefill=False)                        # decode-only mode needs only the GEMV
    assert p.installed_arms() == ("fp8_native",)
    with registry.disabled("w4a16_gemm_t"):
        with pytest.raises(KernelUnavailableError, match="arm 'nvfp4_t'"):
            p.set_nvfp4_t(cont["nvfp4"])
    # set_weight expands a per-tensor FP8 scale to the block grid (same numbers)
    q, s = qf.quantize_fp8_tensor(rng.standard_normal((N, K)).astype(np.float32))
    pt = C.Fp8Weight(jnp.asarray(q), jnp.asarray(s), None, C.WeightQuantFormat.FP8_PER_TENSOR)
    assert p.set_weight(pt) == "fp8_native"
    np.testing.assert_array_equal(np.asarray(p.arm_weight("fp8_native").dequantize()), np.asarray(pt.dequantize()))


def test_arms_through_interpreted_kernels(rng):
    """The same dispatch with the Pallas kernels (interpret mode) instead of the references."""
    cont = _containers(rng)
    x = jnp.asarray(rng.standard_normal((4, K)), jnp.bfloat16)
    for phase, arm in (("decode", "fp8_native"), ("decode", "nvfp4"), ("prefill", "w4a4"),
                       ("prefill", "fp8_prefill"), ("prefill", "nvfp4_t")):
        p = _projection(cont, (arm,), kernels="interpret")
        y = p(x, phase=phase, out_dtype=jnp.float32)
        assert rel_err(y, _own_result(arm, p.arm_weight(arm), x, phase, 4)) < 1e-5


@pytest.mark.parametrize("kernels", ["reference", "interpret"])
def test_epilogue_is_relu2_of_the_float32_result_on_every_arm(rng, kernels):
    """epilogue='relu2' gives, bit for bit, relu^2 of the float32 result and then the cast, on every arm and phase:
    inside the decode GEMVs (EPILOGUE_KERNELS) and after a float32 call elsewhere (a LoRA overlay's rows too:
    tests/model/test_lora.py). An unknown epilogue is a ShapeError naming the projection."""
    cont = _containers(rng)
    x = jnp.asarray(rng.standard_normal((4, K)), jnp.bfloat16)
    for phase, order in (("decode", DECODE_ORDER), ("prefill", PREFILL_ORDER)):
        for arm in order:
            p = _projection(cont, (arm,), kernels=kernels)
            y = p(x, phase=phase, out_dtype=jnp.float32)
            assert (np.asarray(y) < 0).any() and (np.asarray(y) > 0).any()
            got = p(x, phase=phase, out_dtype=jnp.bfloat16, epilogue="relu2")
            np.testing.assert_array_equal(np.asarray(got), np.asarray(relu2(y).astype(jnp.bfloat16)), err_msg=arm)
    with pytest.raises(ShapeError, match=f"{NAME}: epilogue expected None or one of"):
        p(x, phase="decode", epilogue="gelu")


# ---- the Mamba-2 layer's seed methods -------------------------------------------------------------------
CFG = ModelConfig.from_hf(dict(vocab_size=64, hidden_size=32, hybrid_override_pattern="-M", mamba_num_heads=4,
                               mamba_head_dim=8, ssm_state_size=16, n_groups=2, chunk_size=8, intermediate_size=48))


def _ssm(rng, **over):
    k1, k2 = jax.random.split(jax.random.key(int(rng.integers(2**31))))
    w = random_ssm_weights(CFG, k2, jnp.float32)
    return random_norm(CFG, k1, jnp.float32), w.__class__(**{**w.__dict__, **over}), w


def test_layer_default_nvfp4_and_seed_installers(rng):
    norm, _, dense = _ssm(rng)
    nv_in, nv_out = C.quantize_nvfp4_weight(dense.in_proj), C.quantize_nvfp4_weight(dense.out_proj)
    norm, ssm, _ = _ssm(rng, in_proj=nv_in, out_proj=nv_out)
    layer = NemotronMamba2Layer(norm, ssm, CFG, layer_idx=1, levers=ModelLevers(kernels="reference"))
    assert layer.active_arm("decode", 1) == {"in_proj": "nvfp4", "out_proj": "nvfp4"}
    assert layer.active_arm("prefill", 9) == {"in_proj": "nvfp4", "out_proj": "nvfp4"}
    assert not layer.bf16_native_ready()
    w = layer.ssm_weights()
    assert isinstance(w.in_proj, C.Nvfp4Weight) and w.in_proj is not None
    layer.set_prefill_weights(w.in_proj.transposed(), w.out_proj)                 # out_proj transposed here
    assert layer.active_arm("prefill", 9) == {"in_proj": "nvfp4_t", "out_proj": "nvfp4_t"}
    layer.set_fp8_prefill_weights(C.fp8_prefill_copy(nv_in), C.fp8_prefill_copy(nv_out))
    assert layer.active_arm("prefill", 9) == {"in_proj": "fp8_prefill", "out_proj": "fp8_prefill"}
    fin, fout = C.quantize_fp8_block_weight(nv_in), C.quantize_fp8_block_weight(nv_out)
    layer.set_fp8_weights(fin, fout, prefill=False)
    assert layer.active_arm("decode", 1) == {"in_proj": "fp8_native", "out_proj": "fp8_native"}
    assert layer.active_arm("prefill", 9) == {"in_proj": "fp8_prefill", "out_proj": "fp8_prefill"}
    layer.set_fp8_weights(fin, fout, prefill=True)
    assert layer.active_arm("prefill", 9)["in_proj"] == "fp8_native"
    assert isinstance(layer.ssm_weights().in_proj, C.Nvfp4Weight)                  # still the layer's own weights
    layer.set_bf16_weights(dense.in_proj, dense.out_proj)
    assert layer.bf16_native_ready() and layer.active_arm("decode", 1)["out_proj"] == "dense"


def test_layer_install_errors_are_atomic_and_named(rng):
    norm, _, dense = _ssm(rng)
    norm, ssm, _ = _ssm(rng, in_proj=C.quantize_nvfp4_weight(dense.in_proj),
                        out_proj=C.quantize_nvfp4_weight(dense.out_proj))
    layer = NemotronMamba2Layer(norm, ssm, CFG, layer_idx=1, levers=ModelLevers(kernels="reference"))
    good = C.quantize_fp8_block_weight(dense.in_proj)
    out = C.quantize_fp8_block_weight(dense.out_proj)
    bad = C.Fp8Weight(out.weight, jnp.ones(out.weight.shape[0], jnp.float32))       # per-row scale
    with pytest.raises(WeightFormatError, match=r"backbone.layers.1.mixer.out_proj: block scale"):
        layer.set_fp8_weights(good, bad, prefill=True)
    assert layer.active_arm("decode", 1)["in_proj"] == "nvfp4"                      # nothing was installed
    with registry.disabled("w8a16_gemv"):
        with pytest.raises(KernelUnavailableError, match="backbone.layers.1.mixer.in_proj: arm 'fp8_native'"):
            layer.set_fp8_weights(good, out, prefill=False)
    assert layer.in_proj.installed_arms() == ("nvfp4",)


def test_layer_runs_on_quantized_weights_close_to_dense(rng):
    """A prefill through the NVFP4 arm (reference kernels) equals the dense layer built from the
    dequantized weights up to float32 accumulation order."""
    from metrale_jax import SsmPool
    norm, _, dense = _ssm(rng)
    nv = {k: C.quantize_nvfp4_weight(getattr(dense, k)) for k in ("in_proj", "out_proj")}
    lev = ModelLevers(kernels="reference")
    q = NemotronMamba2Layer(norm, dense.__class__(**{**dense.__dict__, **nv}), CFG, 1, levers=lev)
    twin = NemotronMamba2Layer(norm, dense.__class__(**{**dense.__dict__, **{
        k: C.DenseWeight(v.dequantize(jnp.float32)) for k, v in nv.items()}}), CFG, 1, levers=lev)
    x = jnp.asarray(rng.standard_normal((6, CFG.hidden_size)), jnp.float32)
    pool = SsmPool.for_config(CFG, 2)
    run = jax.jit(lambda layer, pool, x: layer.prefill(pool, 0, x, 0))   # jitted: eager ran ~250 small compiles
    with jax.default_matmul_precision("highest"):         # XLA:GPU runs float32 dots in TF32 otherwise
        yq, _ = run(q, pool, x)
        yt, _ = run(twin, pool, x)
    assert rel_err(yq, yt) < 1e-4                      # same dequantized numbers; f32 accumulation only
