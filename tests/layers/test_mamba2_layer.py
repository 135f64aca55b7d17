"""NemotronMamba2Layer on the reference path: the seed's equalities between its entry points."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax import (ConfigError, ModelConfig, NemotronMamba2Layer, NemotronSsmWeights, ShapeError, SlotAllocator, SsmPool,
                         WeightFormatError, combine_capabilities)
from metrale_jax.init import random_norm, random_ssm_weights
from metrale_jax.weights import DenseWeight
from tests.numpy_refs import causal_conv, rel_err, ssm_recurrence

CFG = ModelConfig.from_hf(dict(vocab_size=64, hidden_size=32, hybrid_override_pattern="-M", mamba_num_heads=4,
                               mamba_head_dim=8, ssm_state_size=16, n_groups=2, chunk_size=8, intermediate_size=48))
D = CFG.hidden_size


def _layer(rng, dtype=jnp.float32):
    k1, k2 = jax.random.split(jax.random.key(int(rng.integers(2**31))))
    return NemotronMamba2Layer(random_norm(CFG, k1, dtype), random_ssm_weights(CFG, k2, dtype), CFG, layer_idx=1)


def _pool(rng, max_slots=6, dtype=jnp.float32):
    """A pool full of random state, so that untouched rows and ignored states are visible."""
    p = SsmPool.for_config(CFG, max_slots, dtype=dtype)
    return SsmPool(jnp.asarray(rng.standard_normal(p.conv_state.shape), dtype),
                   jnp.asarray(rng.standard_normal(p.ssm_state.shape), jnp.float32))


def _x(rng, T, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal((T, D)), dtype)


prefill = jax.jit(lambda l, p, s, x, start: l.prefill(p, s, x, start))
prefill_varlen = jax.jit(lambda l, p, s, x, cu, st: l.prefill_varlen(p, s, x, cu, st))
decode = jax.jit(lambda l, p, s, x: l.decode(p, s, x))
decode_multi = jax.jit(lambda l, p, s, x: l.decode_multi_seq(p, s, x))
decode_batched = jax.jit(lambda l, p, s, x: l.decode_batched(p, s, x))
verify_multi = jax.jit(lambda l, p, s, x, k: l.decode_verify_multi(p, s, x, k), static_argnums=4)


def _slot_state(pool, slot):
    return np.asarray(pool.conv_state[0, slot]), np.asarray(pool.ssm_state[0, slot])


def test_mixer_matches_float64_numpy(rng):
    """The whole mixer against a numpy float64 rendering of the equations (independent of the kernels)."""
    layer = _layer(rng)
    w = layer.ssm_weights()
    T = 21
    x = _x(rng, T)
    out, pool = prefill(layer, _pool(rng), 0, x, 0)
    f = lambda a: np.asarray(a, np.float64)
    xs = f(x)
    h = xs / np.sqrt((xs ** 2).mean(-1, keepdims=True) + CFG.layer_norm_epsilon) * f(layer.input_norm[...])
    zxbcdt = h @ f(w.in_proj.weight).T
    I, C = CFG.d_inner, CFG.conv_dim
    z, xbc, dt = zxbcdt[:, :I], zxbcdt[:, I:I + C], zxbcdt[:, I + C:]
    xbc, conv_final = causal_conv(xbc, f(w.conv1d_weight), f(w.conv1d_bias))
    GN = CFG.n_groups * CFG.ssm_state_size
    xh = xbc[:, :I].reshape(T, CFG.mamba_num_heads, CFG.mamba_head_dim)
    B = xbc[:, I:I + GN].reshape(T, CFG.n_groups, -1)
    Cm = xbc[:, I + GN:].reshape(T, CFG.n_groups, -1)
    y, h_final = ssm_recurrence(xh, dt, -np.exp(f(w.A_log)), B, Cm, f(w.D), f(w.dt_bias))
    g = y.reshape(T, I) * (z / (1 + np.exp(-z)))
    gg = g.reshape(T, CFG.n_groups, -1)
    g = (gg / np.sqrt((gg ** 2).mean(-1, keepdims=True) + CFG.layer_norm_epsilon)).reshape(T, I) * f(w.norm_weight)
    ref = xs + g @ f(w.out_proj.weight).T
    assert rel_err(np.asarray(out) - xs, ref - xs) <= 1e-5
    assert rel_err(pool.ssm_state[0, 0], h_final) <= 1e-5
    assert rel_err(pool.conv_state[0, 0], conv_final) <= 1e-6


def test_prefill_equals_token_by_token_decode(rng):
    layer = _layer(rng)
    pool0 = _pool(rng)
    T = 27
    x = _x(rng, T)
    y_pre, pool_pre = prefill(layer, pool0, 2, x, 0)
    pool = SsmPool(pool0.conv_state.at[:, 2].set(0), pool0.ssm_state.at[:, 2].set(0))  # decode from zero
    ys = []
    for t in range(T):
        y, pool = decode(layer, pool, 2, x[t])
        ys.append(y)
    y_dec = jnp.stack(ys)
    assert rel_err(y_dec - x, y_pre - x) <= 1e-5
    for a, b in zip(_slot_state(pool, 2), _slot_state(pool_pre, 2)):
        assert rel_err(a, b) <= 1e-5


@pytest.mark.parametrize("cuts", [(1,), (2, 3), (8,), (5, 13, 14), (3, 11, 19, 20)])
def test_split_prefill_equals_one_prefill(rng, cuts):
    """Splits anywhere, shorter than conv_kernel - 1 included, continue from the slot's state."""
    layer = _layer(rng)
    pool0 = _pool(rng)
    T = 24
    x = _x(rng, T)
    y_one, pool_one = prefill(layer, pool0, 1, x, 0)
    pool, parts, edges = pool0, [], (0, *cuts, T)
    for a, b in zip(edges[:-1], edges[1:]):
        y, pool = prefill(layer, pool, 1, x[a:b], a)
        parts.append(y)
    assert rel_err(jnp.concatenate(parts) - x, y_one - x) <= 1e-5
    for a, b in zip(_slot_state(pool, 1), _slot_state(pool_one, 1)):
        assert rel_err(a, b) <= 1e-5


def test_varlen_packed_prefill_equals_per_sequence(rng):
    layer = _layer(rng)
    pool0 = _pool(rng)
    lens, slots, starts = [5, 17, 1, 9], [3, 0, 4, 1], [0, 4, 0, 2]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    x = _x(rng, int(cu[-1]))
    y_pack, pool_pack = prefill_varlen(layer, pool0, jnp.array(slots), x, jnp.asarray(cu), jnp.array(starts))
    for i, s in enumerate(slots):
        y_one, pool_one = prefill(layer, pool0, s, x[cu[i]:cu[i + 1]], starts[i])
        assert rel_err(y_pack[cu[i]:cu[i + 1]] - x[cu[i]:cu[i + 1]], y_one - x[cu[i]:cu[i + 1]]) <= 1e-5
        for a, b in zip(_slot_state(pool_pack, s), _slot_state(pool_one, s)):
            assert rel_err(a, b) <= 1e-5
    untouched = [s for s in range(pool0.num_slots) if s not in slots]
    np.testing.assert_array_equal(np.asarray(pool_pack.ssm_state[:, untouched]),
                                  np.asarray(pool0.ssm_state[:, untouched]))


def test_split_phases_and_equal_length_batch_equal_prefill(rng):
    layer = _layer(rng)
    pool0 = _pool(rng)
    L, slots = 11, jnp.array([0, 2, 5])
    x = _x(rng, 3 * L)
    cu = jnp.arange(4, dtype=jnp.int32) * L
    y_ref, pool_ref = prefill_varlen(layer, pool0, slots, x, cu, 0)

    @jax.jit
    def phases(layer, pool, x):
        zxbcdt = layer.prefill_phase1_proj_batched(x)
        bufs, pool = layer.prefill_phase1_conv1d(pool, slots, zxbcdt, cu, jnp.zeros(3, jnp.int32))
        bufs, pool, _ = layer.prefill_ssd_scan_batched(pool, slots, bufs, L)
        return layer.prefill_phase3(x, bufs), pool

    y, pool = phases(layer, pool0, x)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))
    np.testing.assert_array_equal(np.asarray(pool.ssm_state), np.asarray(pool_ref.ssm_state))
    np.testing.assert_array_equal(np.asarray(pool.conv_state), np.asarray(pool_ref.conv_state))


def test_decode_multi_seq_rows_equal_single_decode_bitwise(rng):
    layer = _layer(rng)
    pool0 = _pool(rng)
    slots = jnp.array([4, 0, 2, 5, 1])
    x = _x(rng, 5)
    y_all, pool_all = decode_multi(layer, pool0, slots, x)
    for i, s in enumerate(np.asarray(slots)):
        y_one, pool_one = decode(layer, pool0, s, x[i])
        np.testing.assert_array_equal(np.asarray(y_all[i]), np.asarray(y_one))
        for a, b in zip(_slot_state(pool_all, s), _slot_state(pool_one, s)):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(pool_all.ssm_state[:, 3]), np.asarray(pool0.ssm_state[:, 3]))


def test_decode_verify_multi_equals_decode_batched_bitwise(rng):
    layer = _layer(rng)
    pool0 = _pool(rng)
    k, slots = 3, jnp.array([5, 1, 3])
    x = _x(rng, 3 * k)
    y_all, pool_all, steps_all = verify_multi(layer, pool0, slots, x, k)
    assert steps_all.ssm.shape == (3, k, 4, 8, 16) and steps_all.conv.shape == (3, k, CFG.conv_dim, 3)
    for i, s in enumerate(np.asarray(slots)):
        y_one, pool_one, steps = decode_batched(layer, pool0, s, x[i * k:(i + 1) * k])
        np.testing.assert_array_equal(np.asarray(y_all[i * k:(i + 1) * k]), np.asarray(y_one))
        np.testing.assert_array_equal(np.asarray(steps_all.ssm[i]), np.asarray(steps.ssm[0]))
        for a, b in zip(_slot_state(pool_all, s), _slot_state(pool_one, s)):
            np.testing.assert_array_equal(a, b)


def test_decode_batched_equals_single_decodes_and_keeps_every_step(rng):
    layer = _layer(rng)
    pool0 = _pool(rng)
    x = _x(rng, 4)
    y_b, pool_b, steps = decode_batched(layer, pool0, 2, x)
    pool = pool0
    for t in range(4):
        y, pool = decode(layer, pool, 2, x[t])
        assert rel_err(y_b[t] - x[t], y - x[t]) <= 1e-6
        assert rel_err(steps.ssm[0, t], pool.ssm_state[0, 2]) <= 1e-6
        assert rel_err(steps.conv[0, t], pool.conv_state[0, 2]) <= 1e-6


# cut 0: no head; 1: a head shorter than the conv window (2 takes that path again: --run-slow); 8: one whole chunk;
# 13: a chunk and a part; 20: all head, no tail
@pytest.mark.parametrize("cut", [0, 1, pytest.param(2, marks=pytest.mark.slow), 8, 13, 20])
def test_replay_tail_bits_and_captured_state(rng, cut):
    layer = _layer(rng)
    pool0 = _pool(rng)
    T = 20
    x = _x(rng, T)
    run = jax.jit(lambda l, p, x: l.prefill_replay_tail(p, 3, x, cut))
    y, pool, captured = run(layer, pool0, x)
    # the state at the cut is what a prefill of the head leaves
    _, pool_head = prefill(layer, pool0, 3, x[:cut], 0) if cut else (None, None)
    want = _slot_state(pool_head, 3) if cut else (np.zeros(captured.conv.shape), np.zeros(captured.ssm.shape))
    np.testing.assert_array_equal(np.asarray(captured.conv), want[0])
    np.testing.assert_array_equal(np.asarray(captured.ssm), want[1])
    # rows from the cut on carry the bits of a fresh prefill that starts at the cut from that state
    if cut < T:
        p = SsmPool(pool0.conv_state.at[0, 3].set(captured.conv), pool0.ssm_state.at[0, 3].set(captured.ssm))
        y_tail, pool_tail = prefill(layer, p, 3, x[cut:], cut)
        np.testing.assert_array_equal(np.asarray(y[cut:]), np.asarray(y_tail))
        np.testing.assert_array_equal(np.asarray(pool.ssm_state), np.asarray(pool_tail.ssm_state))
    y_one, _ = prefill(layer, pool0, 3, x, 0)
    assert rel_err(y - x, y_one - x) <= 1e-5


def test_slots_not_in_the_step_stay_bitwise_unchanged(rng):
    layer = _layer(rng)
    pool0 = _pool(rng)
    pad = pool0.padding_slot
    slots = jnp.array([1, pad, 4, pad])          # two padded rows land in the padding slot
    _, pool = decode_multi(layer, pool0, slots, _x(rng, 4))
    touched = {1, 4, pad}
    for s in range(pool0.num_slots):
        same = np.array_equal(np.asarray(pool.ssm_state[:, s]), np.asarray(pool0.ssm_state[:, s]))
        same &= np.array_equal(np.asarray(pool.conv_state[:, s]), np.asarray(pool0.conv_state[:, s]))
        assert same == (s not in touched), s
    # prefill writes only its own slot too, and other layers' rows never move
    _, pool = prefill(layer, pool0, 0, _x(rng, 9), 0)
    for s in range(1, pool0.num_slots):
        np.testing.assert_array_equal(np.asarray(pool.ssm_state[:, s]), np.asarray(pool0.ssm_state[:, s]))


def test_reallocated_slot_starts_from_zero(rng):
    layer = _layer(rng)
    pool = _pool(rng)
    alloc = SlotAllocator(pool.num_slots)
    slot, pool = layer.alloc_state(alloc, pool)
    x = _x(rng, 6)
    y_fresh, _ = prefill(layer, pool, slot, x, 3)     # continuing from a zeroed slot == starting fresh
    _, pool = prefill(layer, pool, slot, _x(rng, 6), 0)
    layer.release_state(alloc, slot)
    again, pool = layer.alloc_state(alloc, pool)
    assert again == slot
    y_again, _ = prefill(layer, pool, again, x, 3)
    np.testing.assert_array_equal(np.asarray(y_again), np.asarray(y_fresh))


def test_jitted_decode_compiles_once_over_ten_steps(rng):
    layer = _layer(rng)
    pool = _pool(rng)
    traces = []

    @jax.jit
    def step(layer, pool, x):
        traces.append(1)
        return layer.decode_multi_seq(pool, jnp.array([0, 2]), x)

    for _ in range(10):
        y, pool = step(layer, pool, _x(rng, 2))
    assert len(traces) == 1
    assert step._cache_size() == 1


def test_bf16_layer_runs_close_to_f32(rng):
    layer32 = _layer(rng)
    w = layer32.ssm_weights()
    cast = lambda a: None if a is None else a.astype(jnp.bfloat16)
    w16 = NemotronSsmWeights(DenseWeight(cast(w.in_proj.weight)), DenseWeight(cast(w.out_proj.weight)),
                             cast(w.conv1d_weight), cast(w.conv1d_bias), w.dt_bias, w.A_log, w.D, cast(w.norm_weight))
    layer16 = NemotronMamba2Layer(layer32.input_norm[...].astype(jnp.bfloat16), w16, CFG, layer_idx=1)
    pool = SsmPool.for_config(CFG, 2, dtype=jnp.bfloat16)
    x = _x(rng, 30)
    y32, _ = prefill(layer32, SsmPool.for_config(CFG, 2, dtype=jnp.float32), 0, x, 0)
    y16, pool16 = prefill(layer16, pool, 0, x.astype(jnp.bfloat16), 0)
    assert y16.dtype == jnp.bfloat16 and pool16.conv_state.dtype == jnp.bfloat16
    assert pool16.ssm_state.dtype == jnp.float32
    assert rel_err(np.asarray(y16, np.float32) - np.asarray(x), np.asarray(y32 - x)) <= 3e-2


def test_capability_flags():
    flags = NemotronMamba2Layer
    assert flags.is_ssm_layer and flags.uses_ssm_pool and flags.supports_replay_tail_split
    assert not (flags.decode_graph_unsupported or flags.decode_multi_seq_unsupported
                or flags.decode_verify_multi_unsupported or flags.graph_stale_on_new_sequence
                or flags.uses_local_mla_prefill or flags.has_aux_state)
    assert flags.fp8_calibration_frozen is None
    caps = combine_capabilities([flags])
    assert caps.replay_tail_capture and not caps.decode_graph_veto
    # the seed's entry-point names stay: its GDN phase 2 is the SSD scan here
    assert flags.prefill_gdn_full is flags.prefill_ssd_scan
    assert flags.prefill_gdn_full_batched is flags.prefill_ssd_scan_batched


@pytest.mark.parametrize("cls,idx,match", [
    ("mamba", 0, r"layer 0 is 'attention', not 'mamba'"), ("attention", 1, r"layer 1 is 'mamba', not 'attention'"),
    ("mamba", 9, "9 out of range"), ("mlp", -1, "-1 out of range")])
def test_a_block_built_for_another_layer_kind_is_refused(cls, idx, match):
    from metrale_jax.layers.checks import check_layer_index

    config = ModelConfig.from_hf(dict(vocab_size=32, hidden_size=16, hybrid_override_pattern="*M-E"))
    kind = {"mamba": "M", "attention": "*", "mlp": "-"}[cls]
    with pytest.raises(ConfigError, match=match):
        check_layer_index(config, idx, kind)
    check_layer_index(config, config.hybrid_override_pattern.index(kind), kind)       # its own layer passes


def test_bad_inputs_raise_typed_errors_naming_the_argument(rng):
    layer = _layer(rng)
    pool = _pool(rng)
    with pytest.raises(ShapeError, match="hidden: expected shape"):
        layer.decode_multi_seq(pool, jnp.array([0]), jnp.zeros((1, D + 1)))
    with pytest.raises(ShapeError, match="slots"):
        layer.decode_multi_seq(pool, jnp.array([0, 1]), _x(rng, 1))
    with pytest.raises(ShapeError, match="slots: expected an integer"):
        layer.decode_multi_seq(pool, jnp.array([0.0]), _x(rng, 1))
    with pytest.raises(ShapeError, match="decode takes one token"):
        layer.decode(pool, 0, _x(rng, 2))
    with pytest.raises(ShapeError, match="pool.ssm_state"):
        layer.decode(pool.__class__(pool.conv_state, pool.ssm_state[..., :4]), 0, _x(rng, 1))
    with pytest.raises(ShapeError, match="multiple of k"):
        layer.decode_verify_multi(pool, jnp.array([0]), _x(rng, 5), 2)
    with pytest.raises(ShapeError, match="cut"):
        layer.prefill_replay_tail(pool, 0, _x(rng, 4), 9)
    w = layer.ssm_weights()
    bad = NemotronSsmWeights(w.in_proj, w.out_proj, w.conv1d_weight[:, :3], w.conv1d_bias, w.dt_bias, w.A_log, w.D,
                             w.norm_weight)
    with pytest.raises(WeightFormatError, match=r"layers\.1\.mixer\.conv1d\.weight: expected shape"):
        NemotronMamba2Layer(layer.input_norm[...], bad, CFG, layer_idx=1)
    bad = NemotronSsmWeights(DenseWeight(w.in_proj.weight[:-1]), w.out_proj, w.conv1d_weight, w.conv1d_bias,
                             w.dt_bias, w.A_log, w.D, w.norm_weight)
    with pytest.raises(WeightFormatError, match="in_proj"):
        NemotronMamba2Layer(layer.input_norm[...], bad, CFG, layer_idx=1)
