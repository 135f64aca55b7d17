"""Tensor / expert parallelism on the 4 host CPU devices tests/conftest.py asks for: a NemotronH split over
2 or 4 devices gives the single-device logits (forward, prefill, decode, score) and states for every block
kind, keeps its pools sharded, loads a checkpoint straight to its shards, and compiles steps whose only
collectives are one all-reduce per block."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from metrale_jax import sharding
from metrale_jax.config import ModelConfig
from metrale_jax.errors import CheckpointError, ConfigError
from metrale_jax.model import _JITTED, NemotronH
from metrale_jax.runtime.sampling import sample_tokens
from tests.numpy_refs import rel_err

# every block kind; Mamba groups, kv heads, experts and intermediate sizes divisible by 4; latent MoE;
# biases on attention, MLP, shared experts and latent maps (each added once, after the reduction);
# vocabulary divisible by 4, untied: lm_head split by vocabulary row
CFG = ModelConfig.from_hf(dict(
    vocab_size=96, hidden_size=32, hybrid_override_pattern="M*E-", mamba_num_heads=8, mamba_head_dim=4,
    ssm_state_size=8, n_groups=4, chunk_size=4, num_attention_heads=8, num_key_value_heads=4, head_dim=4,
    intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=16, n_group=4, topk_group=2, moe_latent_size=16, routed_scaling_factor=2.5,
    attention_bias=True, mlp_bias=True))
# tied embeddings and a vocabulary 4 does not divide: lm_head replicated, logits whole on every device
CFG_TIED = dataclasses.replace(CFG, vocab_size=90, tie_word_embeddings=True)
TOL = 2e-5
B, T, TP_PREFILL, SLOTS, MAXLEN = 3, 12, 8, 3, 16


def _mesh(tp):
    if tp > len(jax.devices()):
        pytest.skip(f"needs {tp} devices, {len(jax.devices())} available")
    return sharding.make_mesh(tp)


@pytest.fixture(scope="module")
def models():
    """(config name, tp) -> model, built once (tp 1: the single-device model)."""
    cache = {}

    def get(cfg, tp):
        key = (cfg.vocab_size, tp)
        if key not in cache:
            cache[key] = NemotronH.from_config(cfg, jax.random.key(3), dtype=jnp.float32,
                                               mesh=None if tp == 1 else _mesh(tp))
        return cache[key]
    return get


def _close(got, want, tol=TOL):
    err = rel_err(got, want)
    assert err <= tol, f"rel err {err:.3g} > {tol}"


def _run(model, ids, lens, steps):
    """forward, prefill of right-padded rows (all logits), then `steps` decode steps: host arrays + cache."""
    fwd = np.asarray(model.forward(ids))
    cache = model.new_cache(SLOTS, MAXLEN)
    slots = np.array([2, 0, 1])
    padded = np.where(np.arange(TP_PREFILL)[None] < lens[:, None], ids[:, :TP_PREFILL], 0)
    pre, cache = model.prefill(cache, slots, padded, lens, all_logits=True)
    dec = []
    for s in range(steps):
        logits, cache = model.decode(cache, slots, ids[np.arange(B), lens + s])
        dec.append(np.asarray(logits))
    return fwd, np.asarray(pre), np.stack(dec), cache


def _spec_of(x, spec):
    return x.sharding.is_equivalent_to(NamedSharding(x.sharding.mesh, spec), x.ndim)


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_steps_equal_single_device(models, rng, tp):
    """Forward, mixed-length prefill and 3 decode steps on an M*E- model: the logits of every row match
    the single-device model's, and come out split over the vocabulary like lm_head."""
    ids = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    lens = rng.integers(3, TP_PREFILL + 1, B)
    one, many = models(CFG, 1), models(CFG, tp)
    want, got = _run(one, ids, lens, 3), _run(many, ids, lens, 3)
    _close(got[0], want[0])
    for b in range(B):
        _close(got[1][b, :lens[b]], want[1][b, :lens[b]])
    _close(got[2], want[2])
    np.testing.assert_array_equal(np.asarray(got[3].seq_lens), np.asarray(want[3].seq_lens))
    assert sharding.vocab_sharded(CFG, tp) and _spec_of(many.forward(ids), P(None, None, "tp"))


def test_tied_lm_head_is_replicated(models, rng):
    ids = rng.integers(0, CFG_TIED.vocab_size, (B, T)).astype(np.int32)
    got = models(CFG_TIED, 2).forward(ids)
    assert not sharding.vocab_sharded(CFG_TIED, 2) and _spec_of(got, P())
    _close(np.asarray(got), np.asarray(models(CFG_TIED, 1).forward(ids)))


def test_pool_stays_sharded_and_holds_the_single_device_state(models, rng):
    """After a prefill and 5 decode steps every pool array is still split as designed (SSM by head, conv by
    channel, KV by kv head) and holds the single-device numbers (conv channels in device-major order)."""
    ids = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    lens = rng.integers(3, T - 5 + 1, B)                        # room for 5 decode tokens in ids
    *_, want = _run(models(CFG, 1), ids, lens, 5)
    *_, got = _run(models(CFG, 2), ids, lens, 5)
    assert _spec_of(got.ssm.ssm_state, P(None, None, "tp"))
    assert _spec_of(got.ssm.conv_state, P(None, None, "tp"))
    assert _spec_of(got.kv.k, P(None, None, None, "tp")) and _spec_of(got.kv.v, P(None, None, None, "tp"))
    assert _spec_of(got.seq_lens, P())
    assert len(got.ssm.ssm_state.addressable_shards) == 2
    live = np.array([0, 1, 2])                                  # the padding slot's rows are never compared
    _close(np.asarray(got.ssm.ssm_state)[:, live], np.asarray(want.ssm.ssm_state)[:, live])
    conv = sharding.conv_channels_to_checkpoint_order(got.ssm.conv_state, CFG, 2)
    _close(conv[:, live], np.asarray(want.ssm.conv_state)[:, live])
    _close(np.asarray(got.kv.k)[:, live], np.asarray(want.kv.k)[:, live])
    _close(np.asarray(got.kv.v)[:, live], np.asarray(want.kv.v)[:, live])
    # the device-major conv order differs from the checkpoint's (else the check above would be vacuous)
    assert not np.array_equal(sharding.conv_rows(CFG, 2), np.arange(CFG.conv_dim))
    # slot operations (prefix cache, rollback) keep the split and the numbers
    before = np.asarray(got.ssm.ssm_state)
    snap = got.snapshot(1)
    zeroed = got.zero_slot(1)
    assert not np.asarray(zeroed.ssm.ssm_state)[:, 1].any()
    back = zeroed.restore(1, snap)
    assert _spec_of(back.ssm.ssm_state, P(None, None, "tp")) and _spec_of(back.kv.k, P(None, None, None, "tp"))
    np.testing.assert_array_equal(np.asarray(back.ssm.ssm_state), before)


@pytest.mark.parametrize("tp", [2, 4])
def test_compiled_decode_has_one_all_reduce_per_block(models, rng, tp):
    """The decode step's HLO holds exactly one all-reduce per block (Mamba out_proj, o_proj, MoE routed +
    shared, MLP down_proj) and no other collective: embeddings are replicated and the vocabulary-split
    lm_head needs none."""
    model = models(CFG, tp)
    cache = model.new_cache(SLOTS, MAXLEN)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, SLOTS).astype(np.int32))
    hlo = _JITTED["decode"].lower(model, cache, jnp.arange(SLOTS, dtype=jnp.int32), tokens).compile().as_text()
    counts = sharding.collective_counts(hlo)
    assert counts == {"all-reduce": CFG.num_hidden_layers, "all-gather": 0, "all-to-all": 0,
                      "collective-permute": 0, "reduce-scatter": 0}, counts


def test_compiled_prefill_has_one_all_reduce_per_block(models, rng):
    model = models(CFG, 2)
    cache = model.new_cache(SLOTS, MAXLEN)
    ids = jnp.asarray(rng.integers(0, CFG.vocab_size, (SLOTS, 8)).astype(np.int32))
    lowered = _JITTED["prefill"].lower(model, cache, jnp.arange(SLOTS, dtype=jnp.int32), ids,
                                       jnp.full((SLOTS,), 8, jnp.int32), all_logits=False, continue_=True)
    counts = sharding.collective_counts(lowered.compile().as_text())
    assert counts["all-reduce"] == CFG.num_hidden_layers and sum(counts.values()) == counts["all-reduce"], counts


def test_score_and_sampling_over_a_split_vocabulary(models, rng):
    """score's log-softmax over a vocabulary split across devices (a max, a sum and the target's logit
    reduced) matches the single device, and so do its greedy flags (against the forward's argmax); the sampler
    (with top-k and min-p) takes vocabulary-split logits as they come."""
    one, many = models(CFG, 1), models(CFG, 2)
    ids = rng.integers(0, CFG.vocab_size, (2, 10)).astype(np.int32)
    lens = np.array([10, 7])
    _close(np.asarray(many.score(ids, lens)), np.asarray(one.score(ids, lens)))
    for t in range(1, 9):                                         # row 0 continues greedily from its 2nd token
        ids[0, t + 1] = np.argmax(np.asarray(one.forward(ids))[0, t])
    lp, greedy = many.score(ids, lens, greedy=True)
    logits = np.asarray(one.forward(ids))[:, :-1]
    want = np.take_along_axis(logits, ids[:, 1:, None], -1)[..., 0] >= logits.max(-1)
    want &= np.arange(1, 10) < lens[:, None]
    _close(np.asarray(lp), np.asarray(one.score(ids, lens)))
    np.testing.assert_array_equal(np.asarray(greedy), want)
    assert want[0, 1:].all()                                      # the generated tokens are the greedy ones
    logits = jax.device_put(rng.standard_normal((4, CFG.vocab_size)).astype(np.float32),
                            NamedSharding(many.tp.mesh, P(None, "tp")))
    host = np.asarray(logits)
    seeds, counters = jnp.asarray(rng.integers(0, 1 << 30, 4), jnp.int32), jnp.zeros(4, jnp.int32)
    sample = lambda x, **kw: np.asarray(jax.jit(functools.partial(sample_tokens, **kw))(
        x, jnp.ones(4), jnp.full(4, 0.5), seeds, counters, top_k=jnp.full(4, 3, jnp.int32), min_p=jnp.full(4, 0.01)))
    np.testing.assert_array_equal(sample(logits, sampling=False), host.argmax(-1))
    np.testing.assert_array_equal(sample(logits, sampling=True), sample(jnp.asarray(host), sampling=True))


def test_weights_sit_on_their_shards(models):
    """Each device holds its own rows: in_proj in device-major [z|x|B|C|dt] order, out_proj columns, E/tp
    routed experts, lm_head vocabulary rows; embeddings and router replicated; state_dict gives back the
    checkpoint order."""
    one, many = models(CFG, 1), models(CFG, 2)
    ckpt = one.state_dict()
    in_proj = ckpt["backbone.layers.0.mixer.in_proj.weight"]
    rows = sharding.in_proj_rows(CFG, 2).reshape(2, -1)
    I, GN, H = CFG.d_inner, CFG.n_groups * CFG.ssm_state_size, CFG.mamba_num_heads
    assert rows.shape[1] == CFG.in_proj_dim // 2
    np.testing.assert_array_equal(rows[1][:I // 2], np.arange(I // 2, I))               # device 1's z rows
    np.testing.assert_array_equal(rows[1][-H // 2:], np.arange(2 * I + 2 * GN + H // 2, 2 * I + 2 * GN + H))
    layer0, moe = many.layers[0], many.layers[2]
    for shard in layer0.in_proj.dense_weight().weight.addressable_shards:
        d = shard.index[0].start // rows.shape[1]
        np.testing.assert_array_equal(np.asarray(shard.data), in_proj[rows[d]])
    assert _spec_of(layer0.out_proj.dense_weight().weight, P(None, "tp"))
    assert _spec_of(moe.experts_up[...], P("tp")) and _spec_of(moe.gate[...], P())
    assert moe.experts_up[...].addressable_shards[1].data.shape[0] == CFG.n_routed_experts // 2
    assert _spec_of(many.lm_head.dense_weight().weight, P("tp")) and _spec_of(many.embeddings[...], P())
    back = many.state_dict()
    assert back.keys() == ckpt.keys()
    for name in ckpt:
        np.testing.assert_array_equal(back[name], ckpt[name], err_msg=name)


def test_from_pretrained_with_a_mesh_loads_straight_to_the_shards(models, rng, tmp_path):
    one = models(CFG, 1)
    one.save_pretrained(tmp_path)
    loaded = NemotronH.from_pretrained(tmp_path, dtype=jnp.float32, mesh=_mesh(2))
    assert _spec_of(loaded.layers[0].in_proj.dense_weight().weight, P("tp"))
    assert _spec_of(loaded.layers[1].k_proj.dense_weight().weight, P("tp"))
    ids = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
    _close(np.asarray(loaded.forward(ids)), np.asarray(one.forward(ids)))


def test_parallel_sizes_that_do_not_divide_raise_config_errors():
    mamba = dataclasses.replace(CFG, n_groups=1, hybrid_override_pattern="M")
    with pytest.raises(ConfigError, match="mamba_num_heads: 8 is not divisible by the tensor-parallel size 3"):
        NemotronH.from_config(mamba, jax.random.key(0), dtype=jnp.float32, mesh=_mesh(3))
    attn = dataclasses.replace(CFG, num_key_value_heads=2, hybrid_override_pattern="*")
    with pytest.raises(ConfigError, match="num_attention_heads"):
        sharding.local_config(attn, 3)
    assert sharding.local_config(attn, 4).num_key_value_heads == 1       # kv heads repeated (tests/sharding/
    assert sharding.local_config(mamba, 2).n_groups == 1                 # test_tp_repeated_groups.py)
    with pytest.raises(ConfigError, match="intermediate_size"):
        sharding.local_config(dataclasses.replace(CFG, intermediate_size=30), 4)
    moe = dataclasses.replace(CFG, n_routed_experts=6, n_group=1, topk_group=1, hybrid_override_pattern="E")
    with pytest.raises(ConfigError, match="n_routed_experts"):
        sharding.local_config(moe, 4)
    local = sharding.local_config(dataclasses.replace(CFG, hybrid_override_pattern="M"), 2)
    assert (local.n_groups, local.mamba_num_heads, local.vocab_size) == (2, 4, CFG.vocab_size // 2)


def test_meshes_the_model_cannot_use_raise():
    with pytest.raises(ConfigError, match="tp"):
        sharding.make_mesh(5)
    two_d = Mesh(np.array(_mesh(2).devices).reshape(2, 1), ("data", "tp"))
    with pytest.raises(ConfigError, match="data parallelism"):
        sharding.tensor_parallel(two_d)
    with pytest.raises(ConfigError, match="'model' is not one of them"):
        sharding.tensor_parallel(two_d, "model")
    tp = sharding.tensor_parallel(_mesh(2))
    with pytest.raises(CheckpointError, match="no sharding rule"):
        sharding.tensor_layout("backbone.layers.0.mixer.bogus.weight", CFG, tp)
    experts = {f"backbone.layers.2.mixer.experts.{e}.up_proj.weight": np.ones((16, 16), np.float32) for e in range(7)}
    with pytest.raises(CheckpointError, match="experts.up_proj: 7 of 8 routed experts given"):
        sharding.shard_tensors(CFG, experts, tp, jnp.float32)
