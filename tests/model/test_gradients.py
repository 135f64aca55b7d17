"""jax.grad through NemotronH.forward with the Pallas kernels in the path (interpret mode on the CPU) equals the
reference path's gradients, for every block kind: Mamba-2 prefill (rmsnorm, causal_conv1d, ssd_scan,
gated_rmsnorm), attention, MLP and MoE; and on a block-FP8 model, where the quantized arms (w8a16_gemm_pipelined,
w8a16_grouped) pass gradients to the activations while their weights stay constants. (The fused E4M3 norms do
not take this model's widths; tests/kernels/test_kernel_grads.py differentiates them and every other kernel.)"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from metrale_jax.config import ModelLevers
from metrale_jax.model import NemotronH, forward_step, random_tensors
from metrale_jax.weights.checkpoint import linear_module
from metrale_jax.weights.containers import quantize_fp8_block_weight
from tests.numpy_refs import rel_err
from tests.tiny_models import ALL_KINDS

TOL = 1e-5


def _model(tensors, kernels):
    return NemotronH(ALL_KINDS, tensors, dtype=jnp.float32, levers=ModelLevers(kernels=kernels))


def _param_grads(model, ids, weights):
    """The logits, and the gradients of a nonlinear loss of them w.r.t. every nnx.Param, by parameter path."""
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        logits = forward_step(nnx.merge(graph, p, rest), ids)
        return jnp.sum(weights * jnp.tanh(logits)), logits

    grads, logits = jax.jit(jax.grad(loss, has_aux=True))(params)
    paths = jax.tree_util.tree_leaves_with_path(grads)
    return np.asarray(logits), {".".join(_key(k) for k in path): np.asarray(v) for path, v in paths}


def _key(k) -> str:
    return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))


def _compare(tensors, rng, kinds, *, rounds_activations=False):
    """The kernel path's gradients equal the reference path's (TOL), and every block kind got nonzero ones.
    rounds_activations: the model quantizes activations to E4M3, a step function, so a value the two paths' float32
    sums put on either side of a rounding boundary moves the forwards apart by a whole E4M3 step (rare: ~1 draw in
    20, logits then off by ~1e-3 rather than ~1e-7), and the gradients with them; such a draw returns None."""
    ids = jnp.asarray(rng.integers(0, ALL_KINDS.vocab_size, (2, 13)), jnp.int32)
    weights = jnp.asarray(rng.standard_normal((2, 13, ALL_KINDS.vocab_size)), jnp.float32)
    logits_want, want = _param_grads(_model(tensors, "reference"), ids, weights)
    logits, got = _param_grads(_model(tensors, "interpret"), ids, weights)
    if rounds_activations and rel_err(logits, logits_want) > TOL:
        return None
    assert rel_err(logits, logits_want) <= TOL
    assert got.keys() == want.keys()
    per_kind = collections.defaultdict(list)
    for name, w in want.items():
        assert np.all(np.isfinite(got[name])), name
        assert rel_err(got[name], w) <= TOL, (name, rel_err(got[name], w))
        layer = name.split(".")[1] if name.startswith("layers.") else None
        if layer is not None:
            per_kind[ALL_KINDS.hybrid_override_pattern[int(layer)]].append(float(np.abs(w).max()))
    for kind in kinds:                                   # every block kind got gradients, and nonzero ones
        assert per_kind[kind] and max(per_kind[kind]) > 0, kind
    return got


def test_forward_gradients_through_the_kernels_equal_the_reference(rng):
    tensors = random_tensors(ALL_KINDS, jax.random.key(int(rng.integers(1 << 30))), jnp.float32)
    got = _compare(tensors, rng, "M*E-")
    # the Mamba mixer's own parameters see the conv and the scan
    for leaf in ("conv1d_weight", "A_log", "dt_bias", "D", "norm_weight", "in_proj.dense"):
        assert np.any(got[next(n for n in got if n.startswith(f"layers.0.{leaf}.value"))]), leaf


def test_quantized_arms_pass_gradients_to_their_activations(rng):
    """Every linear weight block-FP8 (experts stacked, served by w8a16_grouped): the remaining parameters (norms,
    conv, SSM, router, embeddings) get the reference path's gradients through the quantized kernels."""
    for _ in range(4):                                   # a draw whose forwards split at an E4M3 boundary: redraw
        tensors = random_tensors(ALL_KINDS, jax.random.key(int(rng.integers(1 << 30))), jnp.float32)
        tensors = {n: quantize_fp8_block_weight(v) if linear_module(n) and n != "lm_head.weight" else v
                   for n, v in tensors.items()}
        model = _model(tensors, "interpret")
        arms = model.layers[0].active_arm("prefill", 26)
        assert arms == {"in_proj": "fp8_native", "out_proj": "fp8_native"}
        assert model.layers[0].in_proj.active_kernel("prefill", 26) == "w8a16_gemm_pipelined"
        if _compare(tensors, rng, "M*E-", rounds_activations=True) is not None:
            return
    pytest.fail("4 draws in a row put an activation across an E4M3 rounding boundary between the two paths")
