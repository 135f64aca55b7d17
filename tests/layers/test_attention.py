"""NemotronAttentionLayer against a float64 numpy rendering; prefill / chunked prefill / decode / verify agree."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.config import ModelConfig
from metrale_jax.errors import ConfigError, ShapeError, WeightFormatError
from metrale_jax.layers.attention import NemotronAttentionLayer, NemotronAttentionWeights
from metrale_jax.state.kv_pool import KvPool
from metrale_jax.weights.containers import DenseWeight
from tests import numpy_refs_model as ref
from tests.numpy_refs import rel_err

CFG = ModelConfig.from_hf(dict(vocab_size=64, hidden_size=32, hybrid_override_pattern="M*", mamba_num_heads=4,
                               mamba_head_dim=8, ssm_state_size=8, n_groups=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8))
CFG_BIAS = dataclasses.replace(CFG, num_key_value_heads=1, attention_bias=True)
D = CFG.hidden_size

prefill_batched = jax.jit(lambda l, p, s, x, n, st: l.prefill_batched(p, s, x, n, st))
prefill_new = jax.jit(lambda l, p, s, x, n: l.prefill_batched(p, s, x, n))
prefill_one = jax.jit(lambda l, p, s, x, st: l.prefill(p, s, x, st))
decode_multi = jax.jit(lambda l, p, s, x, pos: l.decode_multi_seq(p, s, x, pos))
verify = jax.jit(lambda l, p, s, x, pos, k: l.decode_verify_multi(p, s, x, pos, k), static_argnums=5)


def _layer(rng, cfg=CFG, dtype=jnp.float32):
    H, KVH, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    w = lambda *s: jnp.asarray(rng.standard_normal(s) * s[-1] ** -0.5, dtype)
    b = (lambda n: jnp.asarray(0.1 * rng.standard_normal(n), dtype)) if cfg.attention_bias else (lambda n: None)
    weights = NemotronAttentionWeights(
        DenseWeight(w(H * hd, D)), DenseWeight(w(KVH * hd, D)), DenseWeight(w(KVH * hd, D)),
        DenseWeight(w(D, H * hd)), q_bias=b(H * hd), k_bias=b(KVH * hd), v_bias=b(KVH * hd), o_bias=b(D))
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal(D), dtype)
    return NemotronAttentionLayer(norm, weights, cfg, layer_idx=1)


def _pool(cfg, max_slots, max_len, fill=np.nan):
    p = KvPool.for_config(cfg, max_slots, max_len, dtype=jnp.float32)
    return KvPool(jnp.full(p.k.shape, fill, jnp.float32), jnp.full(p.v.shape, fill, jnp.float32))


def _zero(pool, *slots):
    for s in slots:
        pool = pool.zero_slot(s)
    return pool


def _np_block(layer, x, prefix=None):
    """residual + attention(norm(x)) for one sequence x [T, D]; prefix: earlier rows of the sequence."""
    w = layer.attention_weights()
    c = layer.config
    full = x if prefix is None else np.concatenate([prefix, x])
    h = ref.rmsnorm(full, layer.input_norm[...], c.layer_norm_epsilon)
    out = ref.attention(h, w.q_proj.weight, w.k_proj.weight, w.v_proj.weight, w.o_proj.weight,
                        heads=c.num_attention_heads, kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                        bq=w.q_bias, bk=w.k_bias, bv=w.v_bias, bo=w.o_bias)
    return ref.f64(full)[-len(x):] + out[-len(x):]


def _np_keys(layer, x):
    w = layer.attention_weights()
    h = ref.rmsnorm(x, layer.input_norm[...], layer.config.layer_norm_epsilon)
    return ref.lin(h, w.k_proj.weight, w.k_bias).reshape(len(x), layer.config.num_key_value_heads, -1)


@pytest.mark.parametrize("cfg", [CFG, CFG_BIAS], ids=["gqa", "mqa_bias"])
def test_batched_prefill_matches_numpy_and_writes_only_real_rows(rng, cfg):
    """Right-padded rows of mixed lengths: each row's outputs equal the float64 reference of its own
    sequence; keys land at positions < length of its slot; the rest of the (NaN-poisoned) pool is untouched."""
    layer = _layer(rng, cfg)
    T, lens, slots = 9, np.array([9, 4, 6]), np.array([3, 0, 1])
    x = rng.standard_normal((3, T, D)).astype(np.float32)
    pool = _pool(cfg, 5, 16)
    out, new = prefill_new(layer, pool, jnp.asarray(slots), jnp.asarray(x), jnp.asarray(lens))
    out, k = np.asarray(out), np.asarray(new.k[0])
    for b in range(3):
        n = lens[b]
        assert rel_err(out[b, :n], _np_block(layer, x[b, :n])) < 1e-5
        assert rel_err(k[slots[b], :n], _np_keys(layer, x[b, :n])) < 1e-5
        assert np.isnan(k[slots[b], n:]).all()                   # padded rows wrote nothing
    for s in set(range(new.num_slots)) - set(slots.tolist()):
        assert np.isnan(k[s]).all() and np.isnan(np.asarray(new.v[0, s])).all()


def test_chunked_prefill_then_decode_matches_one_pass(rng):
    """Prefill 4 rows, continue with 5 more (attending to the cached 4), decode 2 tokens one at a time:
    every row equals the one-pass float64 reference. Other slots (NaN) are never read or written."""
    layer = _layer(rng)
    T = 11
    x = rng.standard_normal((T, D)).astype(np.float32)
    want = _np_block(layer, x)
    pool = _zero(_pool(CFG, 4, 16), 2)
    a, pool = prefill_one(layer, pool, 2, jnp.asarray(x[:4]), 0)
    b, pool = prefill_one(layer, pool, 2, jnp.asarray(x[4:9]), 4)
    rows = [np.asarray(a), np.asarray(b)]
    for t in (9, 10):
        y, pool = decode_multi(layer, pool, jnp.array([2]), jnp.asarray(x[t:t + 1]), jnp.array([t]))
        rows.append(np.asarray(y))
    got = np.concatenate(rows)
    assert rel_err(got, want) < 1e-5
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
    k = np.asarray(pool.k[0])
    assert np.isnan(np.delete(k, 2, axis=0)).all()
    assert (k[2, T:] == 0).all()                                     # beyond the sequence: still zero


def test_decode_multi_seq_each_at_its_own_position(rng):
    """Two sequences of different lengths decoded in one call give what each gets from the reference,
    and the same as decoding each alone."""
    layer = _layer(rng)
    lens = np.array([7, 3])
    x = rng.standard_normal((2, 8, D)).astype(np.float32)
    pool = _zero(_pool(CFG, 3, 12), 0, 2)
    _, pool = prefill_batched(layer, pool, jnp.array([0, 2]), jnp.asarray(x[:, :7]), jnp.asarray(lens),
                              jnp.zeros(2, jnp.int32))
    nxt = np.stack([x[0, 7], x[1, 3]])
    both, _ = decode_multi(layer, pool, jnp.array([0, 2]), jnp.asarray(nxt), jnp.asarray(lens))
    both = np.asarray(both)
    for b, slot in enumerate((0, 2)):
        want = _np_block(layer, nxt[b:b + 1], prefix=x[b, :lens[b]])
        assert rel_err(both[b:b + 1], want) < 1e-5
        alone, _ = decode_multi(layer, pool, jnp.array([slot]), jnp.asarray(nxt[b:b + 1]), jnp.asarray(lens[b:b + 1]))
        np.testing.assert_allclose(np.asarray(alone)[0], both[b], rtol=1e-6, atol=1e-6)


def test_verify_multi_equals_sequential_decode(rng):
    """k rows per sequence in one call == k decode_multi_seq calls; the pools agree too."""
    layer = _layer(rng)
    n, k = 2, 3
    x = rng.standard_normal((n, 5 + k, D)).astype(np.float32)
    pool = _zero(_pool(CFG, 2, 10), 0, 1)
    _, pool = prefill_batched(layer, pool, jnp.array([1, 0]), jnp.asarray(x[:, :5]), jnp.array([5, 2]),
                              jnp.zeros(2, jnp.int32))
    pos = np.array([5, 2])
    rows = np.stack([x[0, 5:5 + k], x[1, 2:2 + k]])                  # [n, k, D]
    out, pool_v = verify(layer, pool, jnp.array([1, 0]), jnp.asarray(rows.reshape(n * k, D)), jnp.asarray(pos), k)
    seq, p = [], pool
    for j in range(k):
        y, p = decode_multi(layer, p, jnp.array([1, 0]), jnp.asarray(rows[:, j]), jnp.asarray(pos + j))
        seq.append(np.asarray(y))
    np.testing.assert_allclose(np.asarray(out).reshape(n, k, D), np.stack(seq, 1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(pool_v.k), np.asarray(p.k), rtol=1e-6, atol=1e-6)


def test_replay_tail_rows_equal_a_prefill_from_the_cut(rng):
    layer = _layer(rng)
    x = jnp.asarray(rng.standard_normal((10, D)), jnp.float32)
    pool = _zero(_pool(CFG, 2, 16), 1)
    out, _, captured = layer.prefill_replay_tail(pool, 1, x, 6)
    assert captured is None
    assert rel_err(out, _np_block(layer, np.asarray(x))) < 1e-5


def test_bad_inputs_raise_typed_errors(rng):
    layer = _layer(rng)
    pool = _zero(_pool(CFG, 2, 8), 0)
    x = jnp.ones((1, 4, D), jnp.float32)
    with pytest.raises(ShapeError, match="hidden"):
        layer.prefill_batched(pool, jnp.array([0]), jnp.ones((1, 4, D + 1)), jnp.array([4]))
    with pytest.raises(ShapeError, match="pool"):
        layer.prefill_batched(pool.k, jnp.array([0]), x, jnp.array([4]))
    with pytest.raises(ShapeError, match="lengths"):
        layer.prefill_batched(pool, jnp.array([0]), x, jnp.array([4.0]))
    with pytest.raises(ShapeError, match="slots"):
        layer.prefill_batched(pool, jnp.array([0, 1]), x, jnp.array([4]))
    with pytest.raises(ShapeError, match="multiple of k"):
        layer.decode_verify_multi(pool, jnp.array([0]), jnp.ones((5, D)), jnp.array([0]), 2)
    with pytest.raises(ShapeError, match="pool.k"):
        other = dataclasses.replace(CFG, head_dim=4)
        layer.prefill_batched(KvPool.for_config(other, 1, 8, jnp.float32), jnp.array([0]), x, jnp.array([4]))
    w = layer.attention_weights()
    with pytest.raises(ConfigError, match="layer_idx"):
        NemotronAttentionLayer(layer.input_norm[...], w, CFG, layer_idx=0)
    with pytest.raises(WeightFormatError, match="attention_bias"):
        NemotronAttentionLayer(layer.input_norm[...], w, CFG_BIAS, layer_idx=1)
    with pytest.raises(WeightFormatError, match="q_proj"):
        NemotronAttentionLayer(layer.input_norm[...], dataclasses.replace(w, q_proj=DenseWeight(jnp.ones((3, D)))),
                               CFG, layer_idx=1)


def test_long_prefills_attend_a_query_block_at_a_time(rng):
    """Past QUERY_BLOCK queries the scores are built one block of queries at a time: the same output as all at
    once, and a whole-length score of the built-in model compiles to temp memory far below its T x T scores."""
    from metrale_jax import model as M
    from metrale_jax.builtin import load_builtin
    from pallas_kernels import attention as A

    B, T, KVH, G, hd = 2, A.QUERY_BLOCK * 2 + 37, 2, 2, 8
    q = jnp.asarray(rng.standard_normal((B, T, KVH, G, hd)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, T, KVH, hd)), jnp.float32) for _ in range(2))
    pos, limit = jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.array([T, T // 3])
    blocked = A.attend(q, k, v, pos, jnp.arange(T), limit, hd ** -0.5)
    whole = A._attend_block(q, k, v, pos, jnp.arange(T), limit, hd ** -0.5)
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(whole), atol=2e-6, rtol=1e-5)

    m = load_builtin()
    T, c = m.config.max_position_embeddings, m.config
    scores = c.num_attention_heads * T * T * 4                                # one layer's f32 scores, all at once
    exe = jax.jit(M.score_step).lower(m, jax.ShapeDtypeStruct((1, T), jnp.int32),
                                      jax.ShapeDtypeStruct((1,), jnp.int32)).compile()
    assert exe.memory_analysis().temp_size_in_bytes < scores / 2
