"""SsmPool and SlotAllocator: zeroed allocation, release, exhaustion, snapshots, slot isolation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax import ModelConfig, PoolExhaustedError, SlotAllocator, SlotError, SsmPool
from metrale_jax.state.ssm_pool import SlotState

CFG = ModelConfig.from_hf(dict(vocab_size=64, hidden_size=32, hybrid_override_pattern="M-M", mamba_num_heads=4,
                               mamba_head_dim=8, ssm_state_size=16, n_groups=2, chunk_size=8, intermediate_size=48))


def _random_pool(rng, max_slots=3):
    pool = SsmPool.for_config(CFG, max_slots, dtype=jnp.float32)
    return SsmPool(jnp.asarray(rng.standard_normal(pool.conv_state.shape), jnp.float32),
                   jnp.asarray(rng.standard_normal(pool.ssm_state.shape), jnp.float32))


def test_shapes_and_pytree():
    pool = SsmPool.for_config(CFG, 3)
    assert pool.conv_state.shape == (2, 4, CFG.conv_dim, 3) and pool.conv_state.dtype == jnp.bfloat16
    assert pool.ssm_state.shape == (2, 4, 4, 8, 16) and pool.ssm_state.dtype == jnp.float32
    assert pool.padding_slot == 3
    leaves, tree = jax.tree_util.tree_flatten(pool)
    assert len(leaves) == 2 and jax.tree_util.tree_unflatten(tree, leaves) == pool


def test_alloc_zeroes_and_release_recycles(rng):
    pool = _random_pool(rng)
    alloc = SlotAllocator(pool.num_slots)
    before = np.asarray(pool.ssm_state).copy()
    slot, pool = alloc.alloc(pool)
    assert slot == 0 and alloc.in_use == {0}
    assert np.all(np.asarray(pool.ssm_state[:, 0]) == 0) and np.all(np.asarray(pool.conv_state[:, 0]) == 0)
    np.testing.assert_array_equal(np.asarray(pool.ssm_state[:, 1:]), before[:, 1:])   # others untouched
    # dirty the slot, release it, allocate again: it comes back zeroed
    pool = SsmPool(pool.conv_state.at[:, slot].set(7.0), pool.ssm_state.at[:, slot].set(7.0))
    alloc.release(slot)
    again, pool = alloc.alloc(pool)
    assert again == slot
    assert np.all(np.asarray(pool.ssm_state[:, slot]) == 0) and np.all(np.asarray(pool.conv_state[:, slot]) == 0)


def test_exhausted_pool_raises_and_padding_never_handed_out(rng):
    pool = _random_pool(rng, max_slots=2)
    alloc = SlotAllocator(pool.num_slots)
    got = []
    for _ in range(2):
        s, pool = alloc.alloc(pool)
        got.append(s)
    assert pool.padding_slot not in got
    with pytest.raises(PoolExhaustedError, match="all 2 slots"):
        alloc.alloc(pool)
    with pytest.raises(SlotError, match="padding"):
        alloc.release(pool.padding_slot)
    alloc.release(got[0])
    with pytest.raises(SlotError, match="not allocated"):
        alloc.release(got[0])


def test_snapshot_restore_copy(rng):
    pool = _random_pool(rng)
    snap = pool.snapshot(1)
    assert snap.conv.shape == (2, CFG.conv_dim, 3) and snap.ssm.shape == (2, 4, 8, 16)
    ref = np.asarray(pool.ssm_state).copy()
    pool = pool.copy_slot(1, 2)
    np.testing.assert_array_equal(np.asarray(pool.ssm_state[:, 2]), ref[:, 1])
    pool = pool.zero_slot(1)
    pool = pool.restore(1, snap)
    np.testing.assert_array_equal(np.asarray(pool.ssm_state[:, 1]), ref[:, 1])
    np.testing.assert_array_equal(np.asarray(pool.ssm_state[:, 0]), ref[:, 0])
    with pytest.raises(SlotError, match="out of range"):
        pool.snapshot(9)
    with pytest.raises(SlotError, match="do not fit"):
        pool.restore(0, SlotState(snap.conv[:1], snap.ssm[:1]))
