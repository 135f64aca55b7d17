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


def test_the_lever_from_the_environment_and_its_errors(ckpts):
    assert ModelLevers.from_env({"METRALE_FP8_ACTIVATIONS": "BF16"}).fp8_activations == "bf16"
    assert ModelLevers.from_env({}).fp8_activations == "e4m3"
    with pytest.raises(ConfigError) as e:
        ModelLevers.from_env({"METRALE_FP8_ACTIVATIONS": "fp4"})
    assert e.value.field == "METRALE_FP8_ACTIVATIONS"
    with registry.disabled("w8a16_gemm"):                               # the weight-only arm must resolve at load
        NemotronH.from_pretrained(ckpts["fp8"], dtype=F32)             # e4m3 does not need it
        with pytest.raises(KernelUnavailableError, match="w8a16_gemm"):
            NemotronH.from_pretrained(ckpts["fp8"], dtype=F32, levers=ModelLevers(fp8_activations="bf16"))
