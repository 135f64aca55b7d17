"""Hostile arguments to NemotronMamba2Layer's entry points: each is refused on the host with a typed error naming the
argument, before any device work, and the pool comes back bit-identical. Without these checks an index past the
pool was dropped by the scatter (or, in the flattened kernels' rows, landed in the next layer's slot), a negative one
wrapped to the padding slot, a float was truncated, two rows of one slot raced, and cu_seqlens decreasing or running
past T read rows that are not there."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax import ModelConfig, NemotronMamba2Layer, ShapeError, SlotError, SsmPool
from metrale_jax.init import random_norm, random_ssm_weights
from tests.layers.hostile import assert_refused_leaving_pool_intact

CFG = ModelConfig.from_hf(dict(vocab_size=64, hidden_size=32, hybrid_override_pattern="M-M", mamba_num_heads=4,
                               mamba_head_dim=8, ssm_state_size=16, n_groups=2, chunk_size=8, intermediate_size=48))
D = CFG.hidden_size


@pytest.fixture(scope="module")
def layer():
    k1, k2 = jax.random.split(jax.random.key(3))
    return NemotronMamba2Layer(random_norm(CFG, k1, jnp.float32), random_ssm_weights(CFG, k2, jnp.float32), CFG,
                               layer_idx=0)


@pytest.fixture(scope="module")
def pool():
    """Three live slots and the padding slot (3), full of random state."""
    rng = np.random.default_rng(0)
    p = SsmPool.for_config(CFG, 3, dtype=jnp.float32)
    return SsmPool(jnp.asarray(rng.standard_normal(p.conv_state.shape), jnp.float32),
                   jnp.asarray(rng.standard_normal(p.ssm_state.shape), jnp.float32))


X2 = np.random.default_rng(1).standard_normal((2, D)).astype(np.float32)
CU = np.array([0, 1, 2], np.int32)

CASES = [  # (id, call, error, message)
    ("decode_multi past the pool", lambda l, p: l.decode_multi_seq(p, jnp.array([0, 4]), X2), SlotError,
     r"slots: slot 4 out of range \[0, 4\)"),
    ("decode_multi negative", lambda l, p: l.decode_multi_seq(p, np.array([0, -1]), X2), SlotError,
     r"slots: slot -1 out of range"),
    ("decode_multi one slot twice", lambda l, p: l.decode_multi_seq(p, [1, 1], X2), SlotError,
     "slots: slot 1 appears more than once"),
    ("decode_multi bools", lambda l, p: l.decode_multi_seq(p, np.array([True, False]), X2), ShapeError,
     "slots: expected an integer dtype, got bool"),
    ("decode float slot", lambda l, p: l.decode(p, 1.5, X2[0]), ShapeError, "slot: expected an integer dtype"),
    ("decode past the pool", lambda l, p: l.decode(p, 4, X2[0]), SlotError, "slot: slot 4 out of range"),
    ("decode two slots", lambda l, p: l.decode(p, [1, 2], X2[:1]), ShapeError, "slot: expected one slot index"),
    ("decode_batched past the pool", lambda l, p: l.decode_batched(p, np.int64(7), X2), SlotError,
     "slot: slot 7 out of range"),
    ("verify k float", lambda l, p: l.decode_verify_multi(p, [0], X2, 2.0), ShapeError, "k: expected an integer"),
    ("verify k bool", lambda l, p: l.decode_verify_multi(p, [0, 1], X2, True), ShapeError,
     "k: expected an integer"),
    ("verify negative slot", lambda l, p: l.decode_verify_multi(p, [-2], X2, 2), SlotError, "slots: slot -2"),
    ("prefill past the pool", lambda l, p: l.prefill(p, 4, X2), SlotError, "slot: slot 4 out of range"),
    ("prefill float slot", lambda l, p: l.prefill(p, 1.7, X2), ShapeError, "slot: expected an integer dtype"),
    ("prefill string slot", lambda l, p: l.prefill(p, "a", X2), ShapeError, "slot: expected an integer dtype"),
    ("prefill negative start", lambda l, p: l.prefill(p, 1, X2, -3), ShapeError,
     "seq_len_start: expected positions >= 0"),
    ("prefill float start", lambda l, p: l.prefill(p, 1, X2, 2.5), ShapeError,
     "seq_len_start: expected an integer dtype"),
    ("prefill no tokens", lambda l, p: l.prefill(p, 1, X2[:0]), ShapeError, "hidden: a prefill takes at least one"),
    ("varlen cu decreasing", lambda l, p: l.prefill_varlen(p, [0, 1], X2, [0, 2, 1]), ShapeError,
     "cu_seqlens: expected offsets from 0, never decreasing, to at most the 2 tokens"),
    ("varlen cu not from 0", lambda l, p: l.prefill_varlen(p, [0, 1], X2, [1, 1, 2]), ShapeError, "cu_seqlens"),
    ("varlen cu past T", lambda l, p: l.prefill_varlen(p, [0, 1], X2, jnp.array([0, 1, 5])), ShapeError,
     "cu_seqlens"),
    ("varlen one slot twice", lambda l, p: l.prefill_varlen(p, [2, 2], X2, CU), SlotError,
     "slots: slot 2 appears more than once"),
    ("varlen past the pool", lambda l, p: l.prefill_varlen(p, [0, 9], X2, CU), SlotError, "slots: slot 9"),
    ("varlen negative start", lambda l, p: l.prefill_varlen(p, [0, 1], X2, CU, [0, -1]), ShapeError,
     "seq_len_starts: expected positions >= 0"),
    ("replay_tail float cut", lambda l, p: l.prefill_replay_tail(p, 1, X2, 1.5), ShapeError,
     "cut: expected an integer"),
    ("replay_tail past the pool", lambda l, p: l.prefill_replay_tail(p, 5, X2, 1), SlotError, "slot: slot 5"),
    ("phase1_conv1d not a pool", lambda l, p: l.prefill_phase1_conv1d("pool", [0], jnp.zeros((2, CFG.in_proj_dim)),
                                                                      [0, 2], 0), ShapeError, "pool: expected"),
    ("phase1_conv1d bad zxbcdt", lambda l, p: l.prefill_phase1_conv1d(p, [0], jnp.zeros((2, 5)), [0, 2], 0),
     ShapeError, r"zxbcdt: expected shape \[\*, 132\]"),
    ("ssd_scan not buffers", lambda l, p: l.prefill_ssd_scan(p, [0], None, [0, 2]), ShapeError,
     "bufs: expected SsmPrefillBuffers"),
    ("ssd_scan_batched zero chunk", lambda l, p: l.prefill_ssd_scan_batched(p, [0], None, 0), ShapeError,
     "chunk_len: expected an integer >= 1"),
    ("phase3 not buffers", lambda l, p: l.prefill_phase3(X2, None), ShapeError, "bufs: expected"),
    ("integer ssm state", lambda l, p: l.decode_multi_seq(SsmPool(p.conv_state, p.ssm_state.astype(jnp.int32)),
                                                          [0, 1], X2), ShapeError,
     "pool.ssm_state: expected a floating dtype"),
]


@pytest.mark.parametrize("call, error, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_arguments_are_refused_and_leave_the_pool_bit_identical(layer, pool, call, error, message):
    assert_refused_leaving_pool_intact(call, layer, pool, error, message)


def test_well_formed_host_arguments_still_run(layer, pool):
    """numpy integers, lists, the padding slot as a padded row, empty requests and padding rows past cu_seqlens[-1]
    are fine (host values a jitted function closes over are checked once, at trace time); they touch only their
    slots."""
    pad = pool.padding_slot
    _, new = jax.jit(lambda l, p: l.decode_multi_seq(p, [np.int64(2), pad], X2))(layer, pool)
    changed = {s for s in range(pool.num_slots) if not np.array_equal(np.asarray(new.ssm_state[:, s]),
                                                                      np.asarray(pool.ssm_state[:, s]))}
    assert changed == {2, pad}
    out, new = jax.jit(lambda l, p: l.prefill_varlen(p, [np.int32(1), 0], X2, [0, 0, 1], np.array([3, 0])))(
        layer, pool)                                  # request 1 empty, row 1 padding past cu_seqlens[-1]
    assert out.shape == X2.shape and np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(new.ssm_state[:, 2]), np.asarray(pool.ssm_state[:, 2]))


def test_traced_slots_are_not_read(layer, pool):
    """Inside jit the slot values are unknown on the host: the checks pass them through, and a compiled decode step
    keeps its one compile (no value-dependent retrace, no host sync)."""
    step = jax.jit(lambda l, p, s: l.decode_multi_seq(p, s, X2))
    for slots in ([0, 1], [2, 0]):
        out, _ = step(layer, pool, jnp.asarray(slots, jnp.int32))
    assert out.shape == X2.shape and step._cache_size() == 1
