"""NemotronMLPLayer (relu^2, no gate) against float64 numpy; rows are independent."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.config import ModelConfig
from metrale_jax.errors import ConfigError, ShapeError, WeightFormatError
from metrale_jax.layers.mlp import NemotronMLPLayer, NemotronMlpWeights
from metrale_jax.weights.containers import DenseWeight
from tests import numpy_refs_model as ref
from tests.numpy_refs import rel_err

CFG = ModelConfig.from_hf(dict(vocab_size=64, hidden_size=32, hybrid_override_pattern="*-", intermediate_size=48,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8))
D, I = CFG.hidden_size, CFG.intermediate_size
call = jax.jit(lambda l, x: l(x))


def _weights(rng, bias: bool, dtype=jnp.float32):
    w = lambda *s: jnp.asarray(rng.standard_normal(s) * s[-1] ** -0.5, dtype)
    b = (lambda n: jnp.asarray(0.1 * rng.standard_normal(n), dtype)) if bias else (lambda n: None)
    return NemotronMlpWeights(DenseWeight(w(I, D)), DenseWeight(w(D, I)), up_bias=b(I), down_bias=b(D))


def _layer(rng, bias=False, dtype=jnp.float32):
    cfg = dataclasses.replace(CFG, mlp_bias=bias)
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal(D), dtype)
    return NemotronMLPLayer(norm, _weights(rng, bias, dtype), cfg, layer_idx=1)


@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_numpy(rng, bias):
    layer = _layer(rng, bias)
    w = layer.mlp_weights()
    x = rng.standard_normal((13, D)).astype(np.float32)
    got = np.asarray(call(layer, jnp.asarray(x)))
    h = ref.rmsnorm(x, layer.input_norm[...], CFG.layer_norm_epsilon)
    want = ref.f64(x) + ref.mlp(h, w.up_proj.weight, w.down_proj.weight, w.up_bias, w.down_bias)
    assert rel_err(got, want) < 1e-6
    # relu^2 really is applied: negative pre-activations contribute nothing, so a plain relu would differ
    assert rel_err(got, ref.f64(x) + ref.lin(np.maximum(ref.lin(h, w.up_proj.weight, w.up_bias), 0),
                                             w.down_proj.weight, w.down_bias)) > 1e-2


def test_rows_are_independent_of_the_batch(rng):
    layer = _layer(rng, dtype=jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((9, D)), jnp.bfloat16)
    full = np.asarray(call(layer, x), np.float32)
    for i in (0, 4, 8):
        alone = np.asarray(call(layer, x[i:i + 1]), np.float32)[0]
        np.testing.assert_array_equal(alone, full[i])


def test_bad_inputs_raise_typed_errors(rng):
    layer = _layer(rng)
    with pytest.raises(ShapeError, match="hidden"):
        layer(jnp.ones((3, D + 1)))
    w = layer.mlp_weights()
    norm = layer.input_norm[...]
    with pytest.raises(ConfigError, match="layer_idx"):
        NemotronMLPLayer(norm, w, CFG, layer_idx=0)
    with pytest.raises(WeightFormatError, match="mlp_bias"):
        NemotronMLPLayer(norm, w, dataclasses.replace(CFG, mlp_bias=True), layer_idx=1)
    with pytest.raises(WeightFormatError, match="up_proj"):
        NemotronMLPLayer(norm, dataclasses.replace(w, up_proj=DenseWeight(jnp.ones((I + 1, D)))), CFG, layer_idx=1)
    with pytest.raises(WeightFormatError, match="norm.weight"):
        NemotronMLPLayer(jnp.ones(D - 1), w, CFG, layer_idx=1)
