"""LoRA adapters on a model split over a mesh (issue 36, adapter_mesh.py): an adapter on every target kind (the
Mamba in_proj with its device-major row order, out_proj, attention, MLP, shared and routed experts, latent
projections, lm_head split by vocabulary) loaded on tp=2 (host CPU devices) gives the tp=1 logits within the
tensor-parallel tolerance, through the model's steps and the Engine with rows of different adapters; the overlays
lie on the mesh as the device view cuts them; save writes the checkpoint's row order back."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax import Engine, sharding
from metrale_jax.adapters import lora_targets
from metrale_jax.config import ModelConfig
from metrale_jax.errors import ConfigError
from metrale_jax.model import _JITTED, NemotronH
from metrale_jax.weights.lora import WEIGHTS_FILE, LoraConfig, write_adapter
from metrale_jax.weights.safetensors_io import SafetensorsFile
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
    cache = two.new_cache(3, 16)
    table = jnp.zeros(cache.num_slots, jnp.int32).at[:3].set(mixed)          # each slot's adapter
    lp, cache = _JITTED["prefill"](two, cache, slots, ids, lengths, all_logits=False, continue_=False,
                                   adapters=table)
    assert rel_err(np.asarray(lp), f1[:, -1]) <= TOL
    tok = jnp.argmax(f1[:, -1], -1).astype(jnp.int32)
    ld, _ = _JITTED["decode"](two, cache, slots, tok, table)
    longer = np.asarray(_JITTED["forward"](one, jnp.concatenate([ids, tok[:, None]], 1), mixed))
    assert rel_err(np.asarray(ld), longer[:, -1]) <= TOL
    two.save_adapter(tmp / "a_from_tp2", "a")                  # the checkpoint's row order back, bit for bit
    saved, written = _tensors(tmp / "a_from_tp2"), _tensors(tmp / "a")
    assert saved.keys() == written.keys()
    for k in written:
        np.testing.assert_array_equal(saved[k], written[k], err_msg=k)
    with pytest.raises(ConfigError, match="merge_adapter on a model split over a mesh"):
        two.merge_adapter("a")


def test_engine_on_tp2_batches_rows_of_different_adapters(pair):
    """Greedy tokens of the Engine on tp=2, rows of three adapters in its steps, are the argmax of the tp=1 logits
    of the same rows with their adapters (teacher-forced: one forward of prompt + tokens)."""
    one, two, rng, _ = pair
    prompts = [list(map(int, rng.integers(0, CFG.vocab_size, n))) for n in (5, 7, 6)]
    engine = Engine(two, max_slots=3, max_len=24)
    rids = [engine.submit(p, 5, adapter=a) for p, a in zip(prompts, (None, "a", "b"))]
    while engine.has_work:
        engine.step()
    got = [engine.pop(r).tokens for r in rids]
    ids = np.zeros((3, 12), np.int64)
    for i, (p, t) in enumerate(zip(prompts, got)):
        ids[i, :len(p) + len(t)] = p + t
    logits = np.asarray(_JITTED["forward"](one, jnp.asarray(ids), jnp.array([0, 1, 2], jnp.int32)))
    for i, (p, t) in enumerate(zip(prompts, got)):
        assert len(t) == 5
        assert [int(np.argmax(logits[i, len(p) - 1 + j])) for j in range(5)] == t, i
    with pytest.raises(ConfigError, match="unsharded model with LoRA adapters"):
        Engine(one, mesh=two.tp.mesh)


def _tensors(path):
    f = SafetensorsFile(path / WEIGHTS_FILE)
    out = {k: np.array(f.get(k)) for k in f.keys()}
    f.close()
    return out
