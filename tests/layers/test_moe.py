"""NemotronMoELayer: the router's rules case by case, and the whole block against float64 numpy."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.config import ModelConfig
from metrale_jax.errors import ConfigError, ShapeError, WeightFormatError
from metrale_jax.layers.mlp import NemotronMlpWeights
from metrale_jax.layers.moe import NemotronMoELayer, NemotronMoeWeights, route, routed_experts
from metrale_jax.weights.containers import DenseWeight
from tests import numpy_refs_model as ref
from tests.numpy_refs import rel_err

CFG = ModelConfig.from_hf(dict(vocab_size=64, hidden_size=32, hybrid_override_pattern="*E", num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=16, moe_shared_expert_intermediate_size=24, n_group=4,
                               topk_group=2, moe_latent_size=16, routed_scaling_factor=2.5, norm_topk_prob=True))
CFG_PLAIN = dataclasses.replace(CFG, moe_latent_size=None, n_shared_experts=0, n_group=1, topk_group=1,
                                num_experts_per_tok=3, norm_topk_prob=False, routed_scaling_factor=1.0)
CFG_BIAS = dataclasses.replace(CFG, mlp_bias=True)
D = CFG.hidden_size
call = jax.jit(lambda l, x: l(x))


def _route(logits, bias, cfg=CFG, **over):
    kw = dict(n_group=cfg.n_group, topk_group=cfg.topk_group, top_k=cfg.num_experts_per_tok,
              norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor)
    kw.update(over)
    e, w = route(jnp.asarray(logits, jnp.float32), jnp.asarray(bias, jnp.float32), **kw)
    e, w = np.asarray(e), np.asarray(w)
    order = np.argsort(e, axis=1)
    return np.take_along_axis(e, order, 1), np.take_along_axis(w, order, 1)


def _sig(x):
    return 1 / (1 + np.exp(-np.asarray(x, np.float64)))


def test_group_limit_excludes_the_best_single_expert():
    """Group score = sum of its top two: group 0 holds the best expert but a weak partner, so groups 1
    and 2 win and expert 0 is never chosen."""
    logits = np.array([[5.0, -5.0, 2.0, 1.9, 1.5, 1.5, -1.0, -1.0]])
    e, w = _route(logits, np.zeros(8), norm_topk_prob=False, routed_scaling_factor=1.0)
    assert e.tolist() == [[2, 3]]
    np.testing.assert_allclose(w[0], _sig([2.0, 1.9]), rtol=1e-6)
    e_all, _ = _route(logits, np.zeros(8), n_group=1, topk_group=1)   # no group limit: expert 0 wins
    assert e_all.tolist() == [[0, 2]]


def test_correction_bias_only_chooses():
    """A bias lifts expert 6 into the choice, but its weight is its plain sigmoid score."""
    logits = np.array([[0.5, 0.4, 0.3, 0.2, 0.1, 0.0, -0.1, -0.2]])
    bias = np.zeros(8)
    bias[6] = 1.0
    e, w = _route(logits, bias, n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)
    assert e.tolist() == [[0, 6]]
    np.testing.assert_allclose(w[0], _sig([0.5, -0.1]), rtol=1e-6)


def test_normalisation_and_scaling():
    logits = np.array([[1.0, -0.5, 0.3, 2.0, -2.0, 0.0, 0.7, -1.0]])
    s = _sig([1.0, 2.0])
    _, w = _route(logits, np.zeros(8), n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5)
    np.testing.assert_allclose(w[0], 2.5 * s / s.sum(), rtol=1e-6)
    _, w = _route(logits, np.zeros(8), n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=2.5)
    np.testing.assert_allclose(w[0], 2.5 * s, rtol=1e-6)


@pytest.mark.parametrize("groups", [(1, 1, 2), (4, 2, 2), (4, 1, 2), (2, 1, 3), (8, 3, 3)])
def test_random_routing_matches_numpy(rng, groups):
    n_group, topk_group, k = groups
    logits = rng.standard_normal((40, 8)) * 2
    bias = rng.standard_normal(8) * 0.5
    for norm in (False, True):
        e, w = _route(logits, bias, n_group=n_group, topk_group=topk_group, top_k=k, norm_topk_prob=norm,
                      routed_scaling_factor=1.7)
        ee, ww = ref.route(logits.astype(np.float32), bias.astype(np.float32), n_group=n_group,
                           topk_group=topk_group, top_k=k, norm_topk_prob=norm, scale=1.7)
        assert e.tolist() == ee
        np.testing.assert_allclose(w, np.array(ww), rtol=1e-5)


def test_routed_experts_against_loops(rng):
    """The sorted grouped-GEMM formulation against a per-token loop, including experts nobody chose."""
    T, E, Din, I, k = 11, 5, 6, 7, 2
    x = rng.standard_normal((T, Din)).astype(np.float32)
    experts = np.stack([rng.choice(E - 1, k, replace=False) for _ in range(T)])      # expert 4 unused
    weights = rng.random((T, k)).astype(np.float32)
    up = rng.standard_normal((E, I, Din)).astype(np.float32)
    down = rng.standard_normal((E, Din, I)).astype(np.float32)
    got = np.asarray(routed_experts(jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), jnp.asarray(up),
                                    jnp.asarray(down)))
    want = np.zeros((T, Din))
    for t in range(T):
        for j in range(k):
            e = experts[t, j]
            want[t] += weights[t, j] * ref.mlp(x[t:t + 1], up[e], down[e])[0]
    assert rel_err(got, want) < 1e-6


def _moe_tensors(rng, cfg, dtype=jnp.float32):
    """HF-named tensors of block 1 (its mixer prefix) and the layer built from them."""
    E, I, Is = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.moe_shared_expert_intermediate_size
    Din = cfg.moe_latent_size or D
    p = "backbone.layers.1.mixer."
    w = lambda *s: (rng.standard_normal(s) * s[-1] ** -0.5).astype(np.float32)
    t = {p + "gate.weight": w(E, D), p + "gate.e_score_correction_bias": 0.1 * w(E, 1)[:, 0]}
    for e in range(E):
        t[p + f"experts.{e}.up_proj.weight"] = w(I, Din)
        t[p + f"experts.{e}.down_proj.weight"] = w(Din, I)
    if cfg.n_shared_experts:
        t[p + "shared_experts.up_proj.weight"] = w(Is, D)
        t[p + "shared_experts.down_proj.weight"] = w(D, Is)
        if cfg.mlp_bias:
            t[p + "shared_experts.up_proj.bias"] = 0.1 * w(Is, 1)[:, 0]
            t[p + "shared_experts.down_proj.bias"] = 0.1 * w(D, 1)[:, 0]
    if cfg.moe_latent_size:
        t[p + "fc1_latent_proj.weight"] = w(Din, D)
        t[p + "fc2_latent_proj.weight"] = w(D, Din)
        if cfg.mlp_bias:
            t[p + "fc1_latent_proj.bias"] = 0.1 * w(Din, 1)[:, 0]
            t[p + "fc2_latent_proj.bias"] = 0.1 * w(D, 1)[:, 0]
    j = {k: jnp.asarray(v, dtype) for k, v in t.items()}
    opt = lambda s: j.get(p + s)
    shared = (NemotronMlpWeights(DenseWeight(j[p + "shared_experts.up_proj.weight"]),
                                 DenseWeight(j[p + "shared_experts.down_proj.weight"]),
                                 opt("shared_experts.up_proj.bias"), opt("shared_experts.down_proj.bias"))
              if cfg.n_shared_experts else None)
    weights = NemotronMoeWeights(
        gate=j[p + "gate.weight"], e_score_correction_bias=j[p + "gate.e_score_correction_bias"],
        experts_up=jnp.stack([j[p + f"experts.{e}.up_proj.weight"] for e in range(E)]),
        experts_down=jnp.stack([j[p + f"experts.{e}.down_proj.weight"] for e in range(E)]), shared=shared,
        fc1_latent_proj=None if opt("fc1_latent_proj.weight") is None else DenseWeight(opt("fc1_latent_proj.weight")),
        fc2_latent_proj=None if opt("fc2_latent_proj.weight") is None else DenseWeight(opt("fc2_latent_proj.weight")),
        fc1_latent_bias=opt("fc1_latent_proj.bias"), fc2_latent_bias=opt("fc2_latent_proj.bias"))
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal(D), dtype)
    return t, p, NemotronMoELayer(norm, weights, cfg, layer_idx=1)


@pytest.mark.parametrize("cfg", [CFG, CFG_PLAIN, CFG_BIAS], ids=["latent_shared_grouped", "plain", "biases"])
def test_block_matches_float64_numpy(rng, cfg):
    t, p, layer = _moe_tensors(rng, cfg)
    x = rng.standard_normal((17, D)).astype(np.float32)
    got = np.asarray(call(layer, jnp.asarray(x)))
    h = ref.rmsnorm(x, layer.input_norm[...], cfg.layer_norm_epsilon)
    want = ref.f64(x) + ref.moe(h, t, p, cfg)
    assert rel_err(got, want) < 1e-5


def test_a_token_gets_the_same_alone_or_in_a_batch(rng):
    _, _, layer = _moe_tensors(rng, CFG)
    x = jnp.asarray(rng.standard_normal((12, D)), jnp.float32)
    full = np.asarray(call(layer, x))
    for i in (0, 5, 11):
        np.testing.assert_allclose(np.asarray(call(layer, x[i:i + 1]))[0], full[i], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(call(layer, x[::-1]))[::-1], full, rtol=1e-6, atol=1e-6)


def test_bad_inputs_raise_typed_errors(rng):
    _, _, layer = _moe_tensors(rng, CFG)
    w = layer.moe_weights()
    norm = layer.input_norm[...]
    with pytest.raises(ShapeError, match="hidden"):
        layer(jnp.ones((2, D - 1)))
    with pytest.raises(ConfigError, match="layer_idx"):
        NemotronMoELayer(norm, w, CFG, layer_idx=0)
    with pytest.raises(WeightFormatError, match="shared_experts"):
        NemotronMoELayer(norm, dataclasses.replace(w, shared=None), CFG, layer_idx=1)
    with pytest.raises(WeightFormatError, match="latent"):
        NemotronMoELayer(norm, dataclasses.replace(w, fc1_latent_proj=None), CFG, layer_idx=1)
    with pytest.raises(WeightFormatError, match="experts.*up_proj"):
        NemotronMoELayer(norm, dataclasses.replace(w, experts_up=w.experts_up[:, :-1]), CFG, layer_idx=1)
    with pytest.raises(WeightFormatError, match="gate.weight"):
        NemotronMoELayer(norm, dataclasses.replace(w, gate=w.gate[:-1]), CFG, layer_idx=1)
