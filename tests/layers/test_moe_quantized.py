"""Routed experts kept quantized (StackedExperts on the grouped kernels) against their dequantized twin, and
the install-time errors of quantized experts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.config import ModelLevers
from metrale_jax.errors import KernelUnavailableError, WeightFormatError
from metrale_jax.layers.moe import NemotronMoELayer
from metrale_jax.weights import containers as C
from pallas_kernels import registry
from tests.layers.test_moe import CFG, CFG_PLAIN, D, _moe_tensors
from tests.numpy_refs import rel_err

QUANTIZE = {"fp8": C.quantize_fp8_block_weight, "nvfp4": C.quantize_nvfp4_weight}


def _stack(fmt, dense):
    return C.stack_experts("experts", [QUANTIZE[fmt](dense[e]) for e in range(dense.shape[0])])


@pytest.mark.parametrize("kernels", ["reference", "interpret"])
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_quantized_experts_match_the_dequantized_twin(rng, fmt, kernels):
    _, _, layer = _moe_tensors(rng, CFG)
    w = layer.moe_weights()
    up, down = _stack(fmt, w.experts_up), _stack(fmt, w.experts_down)
    norm = layer.input_norm[...]
    quant = NemotronMoELayer(norm, dataclasses.replace(w, experts_up=up, experts_down=down), CFG, layer_idx=1,
                             levers=ModelLevers(kernels=kernels))
    twin = NemotronMoELayer(norm, dataclasses.replace(w, experts_up=up.dequantize(), experts_down=down.dequantize()),
                            CFG, layer_idx=1)
    got = quant.moe_weights()
    assert isinstance(got.experts_up, C.StackedExperts) and got.experts_up.shape == up.shape
    x = jnp.asarray(rng.standard_normal((11, D)), jnp.float32)
    run = jax.jit(lambda l, v: l(v))
    with jax.default_matmul_precision("highest"):   # f32 matmuls, not TF32 on a GPU, in every call below
        y, y_twin = run(quant, x), run(twin, x)
        alone = run(quant, x[3:4])                   # jitted too: the eager call compiled ~100 single ops
    assert np.all(np.isfinite(np.asarray(y)))
    assert rel_err(y, y_twin) < 1e-6
    # a token alone gets what it gets in the batch, up to f32 summation order (XLA:CPU sums a lone row differently)
    np.testing.assert_allclose(np.asarray(alone)[0], np.asarray(y)[3], rtol=2e-5, atol=2e-5)


def test_stacked_experts_index_and_dequantize(rng):
    dense = jnp.asarray(rng.standard_normal((3, 40, 64)), jnp.float32)
    for fmt in QUANTIZE:
        s = _stack(fmt, dense)
        assert s.shape == (3, 40, 64) and len(s) == 3
        one = s[1]
        assert isinstance(one, C.Fp8Weight if fmt == "fp8" else C.Nvfp4Weight) and one.shape == (40, 64)
        np.testing.assert_array_equal(np.asarray(s.dequantize()[1]), np.asarray(one.dequantize()))
        assert rel_err(s.dequantize(), dense) < (0.05 if fmt == "fp8" else 0.2)


def test_quantized_expert_errors(rng):
    _, _, layer = _moe_tensors(rng, CFG_PLAIN)
    w, norm = layer.moe_weights(), layer.input_norm[...]
    up, down = _stack("fp8", w.experts_up), _stack("fp8", w.experts_down)
    with registry.disabled("w8a16_grouped"):                            # at install, not at the first token
        with pytest.raises(KernelUnavailableError, match="w8a16_grouped"):
            NemotronMoELayer(norm, dataclasses.replace(w, experts_up=up, experts_down=down), CFG_PLAIN, layer_idx=1)
    with pytest.raises(WeightFormatError, match="experts.*down_proj.*must be"):
        NemotronMoELayer(norm, dataclasses.replace(w, experts_up=up, experts_down=up), CFG_PLAIN, layer_idx=1)
    members = [C.quantize_fp8_block_weight(w.experts_up[0]), C.quantize_nvfp4_weight(w.experts_up[1])]
    with pytest.raises(WeightFormatError, match="mix formats"):
        C.stack_experts("experts.up_proj", members)
    per_tensor = C.Fp8Weight(members[0].weight, jnp.float32(0.5), None, C.WeightQuantFormat.FP8_PER_TENSOR)
    with pytest.raises(WeightFormatError, match=r"experts.up_proj\[0\].*FP8_PER_TENSOR"):
        C.stack_experts("experts.up_proj", [per_tensor, per_tensor])
