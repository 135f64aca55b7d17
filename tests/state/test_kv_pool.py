"""KvPool and ModelCache: shapes, zeroed allocation alongside SsmPool, snapshots, slot isolation, padding slot."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.config import ModelConfig
from metrale_jax.errors import SlotError
from metrale_jax.layers.attention import NemotronAttentionLayer, NemotronAttentionWeights
from metrale_jax.state.cache import ModelCache
from metrale_jax.state.kv_pool import KvPool, KvSlotState
from metrale_jax.state.slots import SlotAllocator
from metrale_jax.state.ssm_pool import SsmPool
from metrale_jax.weights.containers import DenseWeight

CFG = ModelConfig.from_hf(dict(vocab_size=64, hidden_size=32, hybrid_override_pattern="M*-*", mamba_num_heads=4,
                               mamba_head_dim=8, ssm_state_size=8, n_groups=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, intermediate_size=48))


def _random_pool(rng, max_slots=3, max_len=6):
    p = KvPool.for_config(CFG, max_slots, max_len, dtype=jnp.float32)
    return KvPool(jnp.asarray(rng.standard_normal(p.k.shape), jnp.float32),
                  jnp.asarray(rng.standard_normal(p.v.shape), jnp.float32))


def test_shapes_and_pytree():
    pool = KvPool.for_config(CFG, 3, 10)
    assert pool.k.shape == pool.v.shape == (2, 4, 10, 2, 8) and pool.k.dtype == jnp.bfloat16
    assert (pool.num_layers, pool.num_slots, pool.max_len, pool.padding_slot) == (2, 4, 10, 3)
    leaves, tree = jax.tree_util.tree_flatten(pool)
    assert len(leaves) == 2 and jax.tree_util.tree_unflatten(tree, leaves) == pool
    with pytest.raises(SlotError, match="max_len"):
        KvPool.for_config(CFG, 3, 0)


def test_alloc_zeroes_the_slot_in_both_pools_and_nothing_else(rng):
    kv = _random_pool(rng)
    s = SsmPool.for_config(CFG, 3, dtype=jnp.float32)
    ssm = SsmPool(jnp.asarray(rng.standard_normal(s.conv_state.shape), jnp.float32),
                  jnp.asarray(rng.standard_normal(s.ssm_state.shape), jnp.float32))
    k_before, ssm_before = np.asarray(kv.k).copy(), np.asarray(ssm.ssm_state).copy()
    alloc = SlotAllocator(kv.num_slots)
    slot, ssm, kv = alloc.alloc(ssm, kv)
    assert slot == 0
    assert (np.asarray(kv.k[:, 0]) == 0).all() and (np.asarray(kv.v[:, 0]) == 0).all()
    assert (np.asarray(ssm.ssm_state[:, 0]) == 0).all()
    np.testing.assert_array_equal(np.asarray(kv.k[:, 1:]), k_before[:, 1:])
    np.testing.assert_array_equal(np.asarray(ssm.ssm_state[:, 1:]), ssm_before[:, 1:])


def test_snapshot_restore_copy(rng):
    pool = _random_pool(rng)
    before = np.asarray(pool.k).copy()
    snap = pool.snapshot(1)
    assert isinstance(snap, KvSlotState) and snap.k.shape == (2, 6, 2, 8)
    np.testing.assert_array_equal(np.asarray(snap.v), np.asarray(pool.v[:, 1]))
    pool = pool.zero_slot(1)
    assert (np.asarray(pool.k[:, 1]) == 0).all()
    pool = pool.restore(1, snap)
    np.testing.assert_array_equal(np.asarray(pool.k), before)
    pool = pool.copy_slot(1, 2)
    np.testing.assert_array_equal(np.asarray(pool.k[:, 2]), before[:, 1])
    np.testing.assert_array_equal(np.asarray(pool.k[:, [0, 1, 3]]), before[:, [0, 1, 3]])
    with pytest.raises(SlotError, match="out of range"):
        pool.zero_slot(4)
    with pytest.raises(SlotError, match="do not fit"):
        pool.restore(0, KvSlotState(snap.k[:, :3], snap.v[:, :3]))


def test_decode_rows_touch_only_their_slots_and_the_padding_slot(rng):
    """A decode batch of a live slot and two padding rows: every other slot stays bitwise the same."""
    D, H, KVH, hd = 32, 4, 2, 8
    w = lambda *s: DenseWeight(jnp.asarray(rng.standard_normal(s) * 0.2, jnp.float32))
    layer = NemotronAttentionLayer(jnp.ones(D), NemotronAttentionWeights(w(H * hd, D), w(KVH * hd, D),
                                                                         w(KVH * hd, D), w(D, H * hd)), CFG, 3)
    pool = _random_pool(rng, max_slots=4, max_len=8)
    before_k, before_v = np.asarray(pool.k).copy(), np.asarray(pool.v).copy()
    pad = pool.padding_slot
    out, new = jax.jit(lambda l, p, s, x, pos: l.decode_multi_seq(p, s, x, pos))(
        layer, pool, jnp.array([2, pad, pad]), jnp.asarray(rng.standard_normal((3, D)), jnp.float32),
        jnp.array([5, 0, 3]))
    assert np.isfinite(np.asarray(out)).all()
    k, v = np.asarray(new.k), np.asarray(new.v)
    changed = {(l, s, t) for l, s, t in zip(*np.nonzero((k != before_k).any((-1, -2))))}
    assert changed == {(1, 2, 5), (1, pad, 0), (1, pad, 3)}          # layer row 1 = this layer's
    np.testing.assert_array_equal(v[:, [0, 1, 3]], before_v[:, [0, 1, 3]])
    np.testing.assert_array_equal(k[0], before_k[0])


def test_model_cache_slots(rng):
    cache = ModelCache.for_config(CFG, 2, 8, dtype=jnp.float32)
    assert (cache.num_slots, cache.max_slots, cache.padding_slot, cache.max_len) == (3, 2, 2, 8)
    cache = ModelCache(cache.ssm, _random_pool(rng, 2, 8), jnp.array([5, 7, 0], jnp.int32))
    alloc = cache.allocator()
    slot, cache = alloc.alloc(cache)
    assert slot == 0 and int(cache.seq_lens[0]) == 0 and int(cache.seq_lens[1]) == 7
    assert (np.asarray(cache.kv.k[:, 0]) == 0).all() and (np.asarray(cache.kv.k[:, 1]) != 0).any()
    snap = cache.snapshot(1)
    cache = cache.copy_slot(1, 0)
    assert int(cache.seq_lens[0]) == 7
    np.testing.assert_array_equal(np.asarray(cache.kv.v[:, 0]), np.asarray(snap.kv.v))
    cache = cache.zero_slot(1).restore(1, snap)
    np.testing.assert_array_equal(np.asarray(cache.kv.k[:, 1]), np.asarray(snap.kv.k))
    assert int(cache.seq_lens[1]) == 7
    with pytest.raises(SlotError, match="max_slots"):
        ModelCache.for_config(CFG, 0, 8)
