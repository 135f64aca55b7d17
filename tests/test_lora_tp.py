"""LoRA adapters on a model split over a mesh (issue 36, adapter_mesh.py): an adapter on every target kind (the
Mamba in_proj with its device-major row order, out_proj, attention, MLP, shared and routed experts, latent
projections, lm_head split by vocabulary) loaded on tp=2 (host CPU devices) gives the tp=1 logits within the
tensor-parallel tolerance, through the model's steps and the Engine with rows of different adapters; the overlays
lie on the mesh as the device view cuts them; save writes the checkpoint's row order back."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax import Engine, sharding
from metrale_jax.adapters import lora_targets
from metrale_jax.config import ModelConfig
from metrale_jax.errors import ConfigError
from metrale_jax.model import _JITTED, NemotronH
from metrale_jax.weights.lora import LoraConfig, write_adapter
from tests.numpy_refs import rel_err

# tests/sharding/test_tensor_parallel.py's model at tp=2: Mamba groups, kv heads, experts, intermediate sizes
# and the (untied) vocabulary divisible by 2; latent MoE; biases
CFG = ModelConfig.from_hf(dict(
    vocab_size=96, hidden_size=32, hybrid_override_pattern="M*E-", mamba_num_heads=8, mamba_head_dim=4,
    ssm_state_size=8, n_groups=4, chunk_size=4, num_attention_heads=8, num_key_value_heads=4, head_dim=4,
    intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
    moe_shared_expert_intermediate_size=16, n_group=4, topk_group=2, moe_latent_size=16, routed_scaling_factor=2.5,
    attention_bias=True, mlp_bias=True))
TOL = 2e-5
TARGETS = ("in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj",
           "fc1_latent_proj", "fc2_latent_proj", "lm_head")


def _adapter(path, model, rng, r=3):
    """A random adapter on every target of `model` (routed experts in PEFT's fused form), written to `path`."""
    factors = {}
    for n, t in lora_targets(model).items():
        *lead, N, K = t.shape
        factors[n] = ((rng.standard_normal((*lead, r, K)) * K ** -0.5).astype(np.float32),
                      (rng.standard_normal((*lead, N, r)) * 0.3).astype(np.float32))
    config = LoraConfig(r, 2.0 * r, target_modules=TARGETS, target_parameters=("experts.up_proj", "experts.down_proj"))
    write_adapter(path, config, factors)
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    rng = np.random.default_rng(3602)
    one = NemotronH.from_config(CFG, jax.random.key(5), dtype=jnp.float32)
    two = NemotronH.from_config(CFG, jax.random.key(5), dtype=jnp.float32, mesh=sharding.make_mesh(2))
    tmp = tmp_path_factory.mktemp("tp_adapters")
    for name in ("a", "b"):
        d = _adapter(tmp / name, one, rng)
        one.load_adapter(d, name)
        two.load_adapter(d, name)
    return one, two, rng, tmp


def test_adapters_on_tp2_equal_tp1(pair):
    one, two, rng, tmp = pair
    sharding.check_placement(two)                              # overlays placed as the device view cuts them
    lo = lora_targets(two)["backbone.layers.0.mixer.in_proj"].lora
    assert lo.b[...].sharding.spec == sharding.P(None, "tp", None)
    ids = jnp.asarray(rng.integers(0, CFG.vocab_size, (3, 10)))
    mixed = jnp.array([0, 1, 2], jnp.int32)                    # row b on adapter index b (0: none)
    f1 = np.asarray(_JITTED["forward"](one, ids, mixed))
    assert rel_err(np.asarray(_JITTED["forward"](two, ids, mixed)), f1) <= TOL
    plain = np.asarray(_JITTED["forward"](one, ids, jnp.zeros(3, jnp.int32)))
    np.testing.assert_array_equal(f1[0], plain[0])
    assert min(rel_err(f1[1], plain[1]), rel_err(f1[2], plain[2])) > 1e-2          # the adapters do something
    slots, lengths = jnp.arange(3, dtype=jnp.int32), jnp.full((3,), 10, jnp.int32)
    out = {}
    for label, m in (("tp1", one), ("tp2", two)):
        cache = m.new_cache(3, 16)
        table = jnp.zeros(cache.num_slots, jnp.int32).at[:3].set(mixed)
        lp, cache = _JITTED["prefill"](m, cache, slots, ids, lengths, all_logits=False, continue_=False,
                                       adapters=table)
        ld, _ = _JITTED["decode"](m, cache, slots, jnp.argmax(f1[:, -1], -1).astype(jnp.int32), table)
        out[label] = (np.asarray(lp), np.asarray(ld))
    np.testing.assert_allclose(out["tp1"][0], f1[:, -1], rtol=1e-5, atol=1e-5)
    for got, want in zip(out["tp2"], out["tp1"]):
        assert rel_err(got, want) <= TOL
    one.set_adapter("a")
    want_a = np.asarray(one.forward(ids))
    two.save_adapter(tmp / "a_from_tp2", "a")                  # the checkpoint's row order back
    one.load_adapter(tmp / "a_from_tp2", "a2")
    np.testing.assert_allclose(np.asarray(one.forward(ids)), want_a, rtol=1e-6, atol=1e-6)
    one.unload_adapter("a2")
    with pytest.raises(ConfigError, match="merge_adapter on a model split over a mesh"):
        two.merge_adapter("a")


def test_engine_on_tp2_batches_rows_of_different_adapters(pair):
    one, two, rng, _ = pair
    prompts = [list(rng.integers(0, CFG.vocab_size, n)) for n in (5, 7, 6)]
    adapters = (None, "a", "b")
    got = {}
    for label, model in (("tp1", one), ("tp2", two)):
        engine = Engine(model, max_slots=3, max_len=24)
        rids = [engine.submit(p, 5, adapter=a) for p, a in zip(prompts, adapters)]
        while engine.has_work:
            engine.step()
        got[label] = [engine.pop(r).tokens for r in rids]
    assert got["tp2"] == got["tp1"]
    assert got["tp1"][1] != got["tp1"][0] or got["tp1"][2] != got["tp1"][0]   # the adapters change the tokens
    with pytest.raises(ConfigError, match="unsharded model with LoRA adapters"):
        Engine(one, mesh=two.tp.mesh)
