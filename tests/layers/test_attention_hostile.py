"""Hostile arguments to NemotronAttentionLayer's entry points: refused on the host with a typed error naming the
argument, the KV pool left bit-identical. Without these checks a slot past the pool or a key past max_len was
dropped by the scatter (mode="drop") and missing from every later attention, a negative slot wrapped to the padding
slot, and a float position was truncated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax import KvPool, ModelConfig, NemotronAttentionLayer, NemotronAttentionWeights, ShapeError, SlotError
from metrale_jax.weights import DenseWeight
from tests.layers.hostile import assert_refused_leaving_pool_intact

CFG = ModelConfig.from_hf(dict(vocab_size=64, hidden_size=32, hybrid_override_pattern="M*", mamba_num_heads=4,
                               mamba_head_dim=8, ssm_state_size=16, n_groups=2, chunk_size=8, intermediate_size=48,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8))
D, H, KVH, HD, MAX_LEN = 32, 4, 2, 8, 6
X = np.random.default_rng(1).standard_normal((4, D)).astype(np.float32)


@pytest.fixture(scope="module")
def layer():
    rng = np.random.default_rng(0)
    w = lambda *s: DenseWeight(jnp.asarray(rng.standard_normal(s) * 0.2, jnp.float32))
    return NemotronAttentionLayer(jnp.ones(D), NemotronAttentionWeights(w(H * HD, D), w(KVH * HD, D), w(KVH * HD, D),
                                                                        w(D, H * HD)), CFG, 1)


@pytest.fixture(scope="module")
def pool():
    """Three live slots and the padding slot, MAX_LEN positions each, full of random keys and values."""
    rng = np.random.default_rng(2)
    p = KvPool.for_config(CFG, 3, MAX_LEN, dtype=jnp.float32)
    return KvPool(*(jnp.asarray(rng.standard_normal(p.k.shape), jnp.float32) for _ in range(2)))


CASES = [  # (id, call, error, message)
    ("prefill past max_len", lambda l, p: l.prefill(p, 0, X, 3), ShapeError,
     "seq_len_start: rows up to position 6 do not fit the pool's max_len 6"),
    ("prefill past the pool", lambda l, p: l.prefill(p, 4, X), SlotError, r"slot: slot 4 out of range \[0, 4\)"),
    ("prefill float start", lambda l, p: l.prefill(p, 1, X, 1.5), ShapeError, "seq_len_start: expected an integer"),
    ("decode at max_len", lambda l, p: l.decode(p, 1, X[0], MAX_LEN), ShapeError, "position: rows up to position 6"),
    ("decode negative position", lambda l, p: l.decode(p, 1, X[0], -1), ShapeError,
     "position: expected positions >= 0"),
    ("decode negative slot", lambda l, p: l.decode(p, -1, X[0], 0), SlotError, "slot: slot -1 out of range"),
    ("decode_multi one slot twice", lambda l, p: l.decode_multi_seq(p, [1, 1], X[:2], [0, 1]), SlotError,
     "slots: slot 1 appears more than once"),
    ("decode_multi past the pool", lambda l, p: l.decode_multi_seq(p, jnp.array([1, 7]), X[:2], [0, 1]), SlotError,
     "slots: slot 7"),
    ("verify k zero", lambda l, p: l.decode_verify_multi(p, [1], X[:2], [0], 0), ShapeError, "k: expected an integer"),
    ("verify past max_len", lambda l, p: l.decode_verify_multi(p, [1, 2], X, [0, 5], 2), ShapeError,
     "positions: rows up to position 6"),
    ("batched lengths past T", lambda l, p: l.prefill_batched(p, [0, 1], X.reshape(2, 2, D), [3, 1]), ShapeError,
     r"lengths: expected each in \[0, 2\]"),
    ("batched past max_len", lambda l, p: l.prefill_batched(p, [0, 1], X.reshape(2, 2, D), [2, 1], [5, 0]),
     ShapeError, "seq_len_starts: rows up to position 6"),
    ("replay_tail float cut", lambda l, p: l.prefill_replay_tail(p, 0, X, 1.0), ShapeError,
     "cut: expected an integer"),
]


@pytest.mark.parametrize("call, error, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_arguments_are_refused_and_leave_the_pool_bit_identical(layer, pool, call, error, message):
    assert_refused_leaving_pool_intact(call, layer, pool, error, message)


def test_rows_right_up_to_max_len_run(layer, pool):
    """The last position of the pool is usable, and padded rows of a batch (t >= length) may lie past it."""
    out, new = jax.jit(lambda l, p: l.prefill_batched(p, [0, 1], X.reshape(2, 2, D), [2, 1], [4, 5]))(layer, pool)
    assert np.isfinite(np.asarray(out)).all()
    assert not np.array_equal(np.asarray(new.k[1, 1, 5]), np.asarray(pool.k[1, 1, 5]))
