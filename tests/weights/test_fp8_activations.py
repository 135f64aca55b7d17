"""ModelLevers.fp8_activations: with "bf16" every FP8 projection serves prefill weight-only (fp8_native through
w8a16_gemm, no E4M3 rounding of the activations, no E4M3 prefill copy), so the built-in model quantized to
fp8-block and to fp8 matches its dequantized float32 twin through forward, score and the lm-eval loglikelihood
(measured: 0.0, bit for bit, on the CPU references); the default "e4m3" does not (test_quantized_model bounds it)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from metrale_jax.builtin import builtin_model_dir
from metrale_jax.config import ModelLevers
from metrale_jax.errors import ConfigError, KernelUnavailableError
from metrale_jax.eval.lm_eval_adapter import MetraleLM
from metrale_jax.layers.projection import Projection
from metrale_jax.model import NemotronH
from metrale_jax.tokenizer import load_tokenizer
from metrale_jax.weights.quantize import quantize_checkpoint
from pallas_kernels import registry
from tests.numpy_refs import rel_err
from tests.test_lm_eval import _requests
from tests.weights.test_quantized_model import twin

F32 = jnp.float32
TOL = 1e-5


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return {fmt: quantize_checkpoint(builtin_model_dir(), root / fmt, fmt)["out_dir"] for fmt in ("fp8-block", "fp8")}


def _projections(model):
    return [m for _, m in nnx.iter_modules(model) if isinstance(m, Projection)]


@pytest.mark.parametrize("fmt", ["fp8-block", "fp8"])
@pytest.mark.parametrize("mode", ["full", "decode"])
def test_bf16_activations_match_the_dequantized_twin(ckpts, rng, fmt, mode):
    model = NemotronH.from_pretrained(ckpts[fmt], dtype=F32,
                                      levers=ModelLevers(native_fp8_ssm=mode, fp8_activations="bf16"))
    fp8 = [p for p in _projections(model) if p.fp8_native is not None]
    assert len(fp8) >= 8                                              # Mamba, attention, MLP, shared experts
    for p in fp8:
        assert p.installed_arms() == ("fp8_native",)                  # no E4M3 prefill copy, even in decode mode
        assert (p.active_kernel("prefill", 64), p.input_quant("prefill", 64)) == ("w8a16_gemm", None)
        assert p.active_kernel("decode", 1) == "w8a16_gemv"
    dense = twin(ckpts[fmt])
    ids = rng.integers(3, model.config.vocab_size, (3, 70)).astype(np.int32)
    lens = np.array([70, 41, 9])
    assert rel_err(model.forward(ids), dense.forward(ids)) <= TOL
    got, want = np.asarray(model.score(ids, lens)), np.asarray(dense.score(ids, lens))
    assert np.abs(got - want).max() <= TOL


def test_lm_eval_loglikelihood_of_bf16_fp8_equals_the_dense_twin(ckpts):
    d = ckpts["fp8-block"]
    model = NemotronH.from_pretrained(d, dtype=F32, levers=ModelLevers(fp8_activations="bf16"))
    dense = twin(d)
    dense = NemotronH(dense.config, dense.state_dict(), dtype=F32, tokenizer=load_tokenizer(d))
    pairs = [("And God said", " unto Moses"), ("In the beginning", " God created"), ("", "Jesus wept.")]
    got = MetraleLM(model=model, progress=False).loglikelihood(_requests("loglikelihood", pairs))
    want = MetraleLM(model=dense, progress=False).loglikelihood(_requests("loglikelihood", pairs))
    for (g, gg), (w, wg) in zip(got, want):
        assert abs(g - w) <= TOL * max(1.0, abs(w)) and gg == wg
    default = NemotronH.from_pretrained(d, dtype=F32)                   # e4m3: the activations are rounded
    off = MetraleLM(model=default, progress=False).loglikelihood(_requests("loglikelihood", pairs))
    assert max(abs(o - w) for (o, _), (w, _) in zip(off, want)) > 1e-3


def _decode_after_prefill(model, ids, start: int) -> np.ndarray:
    """Logits [B, T - start, V] of tokens start.. decoded one step at a time after a prefill of ids[:, :start]."""
    B, T = ids.shape
    cache = model.new_cache(B, T)
    slots = np.arange(B)
    _, cache = model.prefill(cache, slots, ids[:, :start])
    steps = []
    for t in range(start, T):
        logits, cache = model.decode(cache, slots, ids[:, t])
        steps.append(np.asarray(logits))
    return np.stack(steps, axis=1)


def test_e4m3_decode_rounds_activations_as_prefill_does(ckpts, rng):
    """fp8_decode_activations "e4m3": every whole FP8 projection decodes through w8a8_gemv, its activations rounded
    to E4M3 per row per 128 columns (the Mamba norms hand them over quantized, as in prefill), so decoded logits
    equal the E4M3 prefill's (forward) to float32 summation order, except in a row where that order moved a value
    across an E4M3 rounding boundary (then ~1e-3 from there on: about one row in twenty); the default
    "bf16" decode differs in every row."""
    d = ckpts["fp8-block"]
    model = NemotronH.from_pretrained(d, dtype=F32, levers=ModelLevers(fp8_decode_activations="e4m3"))
    fp8 = [p for p in _projections(model) if p.fp8_native is not None]
    assert len(fp8) >= 8
    for p in fp8:
        assert (p.active_kernel("decode", 1), p.input_quant("decode", 1)) == ("w8a8_gemv", "blocks")
        assert p.active_kernel("prefill", 64) != "w8a8_gemv"
    ids = rng.integers(3, model.config.vocab_size, (6, 12)).astype(np.int32)
    want = np.asarray(model.forward(ids))[:, 8:]
    row_errs = lambda got: [rel_err(got[b], want[b]) for b in range(len(ids))]
    assert sum(e <= TOL for e in row_errs(_decode_after_prefill(model, ids, 8))) >= 3
    default = NemotronH.from_pretrained(d, dtype=F32)
    assert all(p.active_kernel("decode", 1) == "w8a16_gemv" for p in _projections(default) if p.fp8_native is not None)
    assert min(row_errs(_decode_after_prefill(default, ids, 8))) > 1e-3


@pytest.mark.parametrize("field,var,default,other,kernel", [
    ("fp8_activations", "METRALE_FP8_ACTIVATIONS", "e4m3", "bf16", "w8a16_gemm"),          # the weight-only prefill arm
    ("fp8_decode_activations", "METRALE_FP8_DECODE_ACTIVATIONS", "bf16", "e4m3", "w8a8_gemv")])  # the E4M3 decode arm
def test_the_levers_from_the_environment_and_their_errors(ckpts, field, var, default, other, kernel):
    assert getattr(ModelLevers.from_env({var: other.upper()}), field) == other
    assert getattr(ModelLevers.from_env({}), field) == default
    with pytest.raises(ConfigError) as e:
        ModelLevers.from_env({var: "fp4"})
    assert e.value.field == var
    with pytest.raises(ConfigError, match=field):
        ModelLevers(**{field: "int8"})
    with registry.disabled(kernel):                                      # the other value's arm must resolve at load
        NemotronH.from_pretrained(ckpts["fp8"], dtype=F32)               # the default does not need it
        with pytest.raises(KernelUnavailableError, match=kernel):
            NemotronH.from_pretrained(ckpts["fp8"], dtype=F32, levers=ModelLevers(**{field: other}))


def test_e4m3_decode_norms_hand_over_the_same_bits(rng):
    """With fp8_decode_activations "e4m3" a block's input norm emits E4M3 in decode where every projection reading
    it quantizes per 128 columns (norm_fp8, one quantization fewer per step) and the fused norm takes the width
    (a power of two: not the built-in model's 192): the projection's output equals, bit for bit, the bf16 norm's
    with the projection quantizing; prefill, a LoRA overlay or a bf16-decode projection keep the bf16 norm."""
    from metrale_jax.layers.blocks import input_rmsnorm
    from metrale_jax.weights.containers import Fp8Weight
    from pallas_kernels.formats import Fp8Activations
    from tests.kernels.test_mgpu_gemv_w8a8 import _fp8
    N, K, eps = 384, 256, 1e-5
    projs = []
    for name in ("up_proj", "gate"):
        p = Projection(name, N, K)
        p.set_fp8(Fp8Weight(*_fp8(rng, N, K)), prefill=True)
        projs.append(p)
    projs[0].set_fp8_decode_activations("e4m3")
    h = jnp.asarray(rng.standard_normal((3, K)) * 4, jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.5, 1.5, K), F32)
    norm = lambda phase, ps: input_rmsnorm(h, w, eps=eps, projections=ps, phase=phase, kernels=None)[1]
    x = norm("decode", projs[:1])
    assert isinstance(x, Fp8Activations)
    assert not isinstance(norm("prefill", projs[:1]), Fp8Activations)
    assert not isinstance(norm("decode", projs), Fp8Activations)          # the second decodes with w8a16_gemv
    projs[0].lora = nnx.data("an overlay")                                 # its term reads the bf16 rows
    assert not isinstance(norm("decode", projs[:1]), Fp8Activations)
    projs[0].lora = nnx.data(None)
    fused = np.asarray(projs[0](x, phase="decode", epilogue="relu2"))
    with registry.disabled("rmsnorm_fp8"):
        plain = norm("decode", projs[:1])
    assert not isinstance(plain, Fp8Activations)
    np.testing.assert_array_equal(np.asarray(projs[0](plain, phase="decode", epilogue="relu2")), fused)
