"""Hostile slot arguments to the pools' host methods and the SlotAllocator: refused with a SlotError naming the
argument, never converted (int(1.5) was slot 1, True slot 1, a released 1.0 went back into the free list as a float),
and an allocator's memory does not grow with num_slots (SlotAllocator(10**12) built a list of 10**12 ints)."""

import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax import KvPool, ModelCache, ModelConfig, SlotAllocator, SlotError, SsmPool
from metrale_jax.state.ssm_pool import SlotState

CFG = ModelConfig.from_hf(dict(vocab_size=64, hidden_size=32, hybrid_override_pattern="M*M", mamba_num_heads=4,
                               mamba_head_dim=8, ssm_state_size=16, n_groups=2, chunk_size=8, intermediate_size=48,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8))


@pytest.fixture(scope="module")
def pools():
    rng = np.random.default_rng(0)
    ssm = SsmPool.for_config(CFG, 2, dtype=jnp.float32)
    ssm = SsmPool(*(jnp.asarray(rng.standard_normal(a.shape), jnp.float32) for a in (ssm.conv_state, ssm.ssm_state)))
    return ssm, ModelCache.for_config(CFG, 2, 4, dtype=jnp.float32)


def _arrays(pool):
    return [np.asarray(a).copy() for a in (pool.conv_state, pool.ssm_state)]


@pytest.mark.parametrize("method, args, message", [
    ("zero_slot", (1.5,), "slot: expected an integer slot index, got 1.5"),
    ("zero_slot", (True,), "slot: expected an integer slot index, got True"),
    ("zero_slot", (np.bool_(True),), "slot: expected an integer slot index"),
    ("zero_slot", ("1",), "slot: expected an integer slot index"),
    ("zero_slot", (np.array([0, 1]),), "slot: expected an integer slot index"),
    ("zero_slot", (-1,), r"slot: slot -1 out of range \[0, 3\)"),
    ("snapshot", (3,), r"slot: slot 3 out of range \[0, 3\)"),
    ("copy_slot", (0, 2.0), "dst: expected an integer slot index"),
    ("copy_slot", (5, 0), "src: slot 5 out of range"),
])
def test_pool_methods_refuse_slots_that_are_not_integers_in_range(pools, method, args, message):
    ssm, cache = pools
    before = _arrays(ssm)
    for pool in (ssm, cache):
        with pytest.raises(SlotError, match=message):
            getattr(pool, method)(*args)
    for a, b in zip(_arrays(ssm), before):
        np.testing.assert_array_equal(a, b)


def test_numpy_and_zero_dim_integer_slots_are_fine(pools):
    ssm, _ = pools
    snap = ssm.snapshot(np.int64(1))
    np.testing.assert_array_equal(np.asarray(snap.ssm), np.asarray(ssm.ssm_state[:, 1]))
    np.testing.assert_array_equal(np.asarray(ssm.snapshot(np.array(2)).conv), np.asarray(ssm.conv_state[:, 2]))


def test_restore_refuses_a_snapshot_of_another_type(pools):
    """A KV snapshot given to the SSM pool, or a tuple, is a SlotError naming the expected type (it was a TypeError
    from dataclasses.fields, or a silent put when the shapes happened to agree)."""
    ssm, cache = pools
    with pytest.raises(SlotError, match="snapshot: expected a SlotState, got tuple"):
        ssm.restore(0, (ssm.conv_state[:, 0], ssm.ssm_state[:, 0]))
    kv = KvPool.for_config(CFG, 2, 4, dtype=jnp.float32)
    with pytest.raises(SlotError, match="snapshot: expected a KvSlotState, got SlotState"):
        kv.restore(0, SlotState(kv.k[:, 0], kv.v[:, 0]))
    with pytest.raises(SlotError, match="snapshot: expected a CacheSlotState"):
        cache.restore(0, ssm.snapshot(0))


@pytest.mark.parametrize("num_slots", [2.0, "3", None, 1, True])
def test_allocator_size_must_be_an_integer_of_at_least_two(num_slots):
    with pytest.raises(SlotError, match="num_slots: expected an integer >= 2"):
        SlotAllocator(num_slots)


def test_a_huge_allocator_costs_nothing_up_front_and_hands_out_in_order():
    alloc = SlotAllocator(10**12)
    assert alloc.free_count == 10**12 - 1 and alloc.capacity == 10**12 - 1
    got = [alloc.alloc()[0] for _ in range(3)]
    assert got == [0, 1, 2] and alloc.free_count == 10**12 - 4
    alloc.release(1)
    assert alloc.alloc()[0] == 1 and alloc.alloc()[0] == 3           # the released slot first, then fresh ones


@pytest.mark.parametrize("slot, error", [(1.0, "expected an integer slot index"), (True, "expected an integer"),
                                         (-1, "out of range"), (99, "out of range")])
def test_release_refuses_slots_that_are_not_integers_in_range(slot, error):
    alloc = SlotAllocator(4)
    for _ in range(3):
        alloc.alloc()
    with pytest.raises(SlotError, match=error):
        alloc.release(slot)
    assert alloc.in_use == {0, 1, 2} and alloc.free_count == 0
    alloc.release(np.int64(1))                                   # a numpy integer is a fine slot
    assert alloc.alloc()[0] == 1 and all(type(s) is int for s in alloc.in_use)


def test_a_pool_that_refuses_the_slot_leaves_it_free(pools):
    """alloc(pool) with a pool smaller than the allocator: the SlotError leaves the slot free, not lost."""
    ssm, _ = pools
    alloc = SlotAllocator(8)
    for _ in range(3):
        alloc.alloc()
    with pytest.raises(SlotError, match="slot 3 out of range"):
        alloc.alloc(ssm)
    assert alloc.free_count == 4 and alloc.in_use == {0, 1, 2}
    assert alloc.alloc()[0] == 3


@pytest.mark.parametrize("make, message", [
    (lambda: SsmPool.for_config(CFG, 0), "max_slots must be an integer >= 1, got 0"),
    (lambda: SsmPool.for_config(CFG, 2.5), "max_slots must be an integer >= 1, got 2.5"),
    (lambda: KvPool.for_config(CFG, True, 4), "max_slots must be an integer >= 1, got True"),
    (lambda: KvPool.for_config(CFG, 2, 4.0), "max_len must be an integer >= 1, got 4.0"),
    (lambda: KvPool.create(1, 3, 0, num_kv_heads=2, head_dim=8), "max_len must be an integer >= 1, got 0"),
    (lambda: ModelCache.for_config(CFG, -1, 4), "max_slots must be an integer >= 1, got -1"),
    (lambda: SsmPool.create(1, 3, conv_dim=8, conv_kernel=0, num_heads=2, head_dim=4, state_size=4),
     "conv_kernel must be an integer >= 1, got 0"),
    (lambda: SsmPool.create(-1, 3, conv_dim=8, conv_kernel=4, num_heads=2, head_dim=4, state_size=4),
     "num_layers must be an integer >= 0, got -1"),
])
def test_pool_sizes_must_be_integers_in_range(make, message):
    """A float or bool size was a TypeError from jnp.zeros (or a pool of True slots), zero slots a pool holding only
    the padding slot, a zero conv_kernel a negative dimension."""
    with pytest.raises(SlotError, match=message):
        make()


def test_a_model_without_layers_of_a_kind_still_gets_a_pool():
    pool = SsmPool.create(0, 2, conv_dim=8, conv_kernel=4, num_heads=2, head_dim=4, state_size=np.int64(4))
    assert pool.conv_state.shape == (0, 2, 8, 3) and pool.ssm_state.shape == (0, 2, 2, 4, 4)


@pytest.mark.parametrize("seq_len, message", [(5, r"snapshot.seq_len: 5 is not in \[0, 4\]"),
                                              (-1, r"snapshot.seq_len: -1 is not in"),
                                              (jnp.zeros(2, jnp.int32), "expected an integer scalar"),
                                              (jnp.float32(2), "expected an integer scalar")])
def test_cache_restore_refuses_a_length_the_cache_cannot_hold(seq_len, message):
    """A restored length past max_len made the slot's next decode write its key past the pool (dropped)."""
    cache = ModelCache.for_config(CFG, 2, 4, dtype=jnp.float32)       # its own: restore donates the cache
    snap = cache.snapshot(0)
    bad = type(snap)(snap.ssm, snap.kv, seq_len)
    with pytest.raises(SlotError, match=message):
        cache.restore(1, bad)
    assert int(cache.restore(1, type(snap)(snap.ssm, snap.kv, jnp.int32(4))).seq_lens[1]) == 4
