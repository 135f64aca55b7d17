"""Runtime step functions: the replay-tail capture, write-on-accept verify, and padding-row isolation.

Every call goes through an engine's executables (Engine.call) with the engine tests' shapes ([4, 64]
prefill, [4] decode, [4, 4] verify), so these tests reuse those compiles."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.runtime import steps
from metrale_jax.state.cache import ModelCache
from tests.numpy_refs import rel_err
from tests.runtime.conftest import EOS

PAD = 4          # padding slot of a 4-slot cache
K = 4            # verify rows per sequence (num_draft 3, as the engine tests use)


def _d(x, dtype=np.int32):
    return jax.device_put(np.asarray(x, dtype))


def _copy(cache):
    return jax.tree.map(jnp.copy, cache)


@pytest.fixture
def eng(make_engine):
    return make_engine()


def _prefill(eng, cache, slots, ids, lengths, cuts=None, capture_rows=None):
    entry = "prefill" if cuts is None else "prefill_capture"
    extra = (None, None) if cuts is None else (_d(cuts), _d(capture_rows))
    return eng.call(entry, steps.prefill_step, cache, _d(slots), _d(ids), _d(lengths), *extra, None,
                    donate_argnums=(1,))


def _decode(eng, cache, slots, tokens):
    return eng.call("decode", steps.decode_step, cache, _d(slots), _d(tokens), decode=True, donate_argnums=(1,))


def _verify(eng, cache, slots, tokens, num_draft):
    n = len(slots)
    return eng.call("verify", functools.partial(steps.verify_step, sampling=False), cache, _d(slots),
                    _d(tokens), _d(num_draft), _d(np.zeros(n), np.float32), _d(np.ones(n), np.float32),
                    _d(np.zeros(n)), _d(np.zeros(n)), decode=True, donate_argnums=(1,), static=False)


def _rows(rng, lengths, T=64):
    ids = np.zeros((4, T), np.int32)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(0, EOS, n)
    return ids


def test_replay_tail_capture_gives_the_head_state_and_the_tail_bits_of_a_prefill_from_the_cut(model, eng, rng):
    """Row 0 fresh, cut after 8 of 13; row 1 continues slot 1 (5 cached tokens), cut after 11 of 21 (at
    position 16); row 2 fresh, cut 0; row 3 padding."""
    cache = model.new_cache(4, 64)
    first = _rows(rng, [5, 0, 0, 0])
    cache = _prefill(eng, cache, [1, PAD, PAD, PAD], first, [5, 0, 0, 0]).cache
    lengths, cuts = np.array([13, 21, 8, 0]), np.array([8, 11, 0, 0])
    slots = [0, 1, 2, PAD]
    ids = _rows(rng, lengths)

    split = _prefill(eng, _copy(cache), slots, ids, lengths, cuts, capture_rows=[0])
    whole = _prefill(eng, _copy(cache), slots, ids, lengths)
    # the split changes nothing but rounding: logits and the final states agree with one pass
    assert rel_err(np.asarray(split.logits)[:3], np.asarray(whole.logits)[:3]) < 1e-5
    for a, b in zip(jax.tree.leaves(split.cache.ssm), jax.tree.leaves(whole.cache.ssm)):
        assert rel_err(np.asarray(a)[:, :3], np.asarray(b)[:, :3]) < 1e-5
    np.testing.assert_array_equal(np.asarray(split.cache.seq_lens), [13, 26, 8, 0, 0])

    # heads alone, then the tails as a prefill continuing from them
    heads = _prefill(eng, _copy(cache), slots, ids, cuts)
    head_state = jax.tree.map(np.asarray, steps.slot_ssm_state(heads.cache, 0))
    tail_ids = np.zeros_like(ids)
    for b in range(3):
        tail_ids[b, :lengths[b] - cuts[b]] = ids[b, cuts[b]:lengths[b]]
    tails = _prefill(eng, heads.cache, slots, tail_ids, lengths - cuts)
    # seed contract: the rows from the cut get exactly the bits of a prefill starting there (same shapes)
    np.testing.assert_array_equal(np.asarray(split.logits)[:3], np.asarray(tails.logits)[:3])

    # the captured state of row 0 is the state after its head (capture_rows names batch rows)
    (cap,) = split.captured
    np.testing.assert_array_equal(np.asarray(cap.ssm), head_state.ssm)
    np.testing.assert_array_equal(np.asarray(cap.conv), head_state.conv)
    assert np.abs(np.asarray(cap.ssm)).max() > 0


def test_replay_tail_captures_row_1_at_its_absolute_cut(model, eng, rng):
    """Row 1 continues from 5 cached tokens and is cut at absolute position 16 (a block boundary)."""
    cache = model.new_cache(4, 64)
    cache = _prefill(eng, cache, [1, PAD, PAD, PAD], _rows(rng, [5, 0, 0, 0]), [5, 0, 0, 0]).cache
    lengths, cuts = np.array([0, 21, 0, 0]), np.array([0, 11, 0, 0])
    slots = [PAD, 1, PAD, PAD]
    ids = _rows(rng, lengths)
    split = _prefill(eng, _copy(cache), slots, ids, lengths, cuts, capture_rows=[1])
    heads = _prefill(eng, cache, slots, ids, cuts)
    assert int(np.asarray(heads.cache.seq_lens)[1]) == 16
    want = steps.slot_ssm_state(heads.cache, 1)
    np.testing.assert_allclose(np.asarray(split.captured[0].ssm), np.asarray(want.ssm), rtol=1e-6, atol=1e-7)


def test_verify_commits_the_state_after_the_last_accepted_token(model, eng, rng):
    """Three sequences verify [t0, d1, d2, d3]: all drafts right, one right, none right. The emitted tokens
    and the committed state equal K plain decode steps cut at the accepted length, and decoding on from the
    committed state continues exactly as decoding never speculated."""
    lengths = np.array([6, 9, 4, 0])
    slots = [0, 1, 2, PAD]
    cache = _prefill(eng, model.new_cache(4, 64), slots, _rows(rng, lengths), lengths).cache
    t0 = rng.integers(0, EOS, 4)
    # reference: K + 1 greedy decode steps, keeping logits and states
    ref, logits, states, tok = _copy(cache), [], [], t0
    for _ in range(K + 1):
        lg, ref = _decode(eng, ref, slots, tok)
        logits.append(np.asarray(lg))
        states.append(jax.tree.map(np.asarray, ref.ssm))
        tok = np.argmax(logits[-1], -1)
    greedy = np.stack([np.argmax(l, -1) for l in logits], 1)            # [4, K+1]: g1 .. g_{K+1}
    drafts = greedy[:, :K - 1].copy()
    drafts[1, 1] = (drafts[1, 1] + 1) % EOS                              # row 1: second draft wrong
    drafts[2, 0] = (drafts[2, 0] + 1) % EOS                              # row 2: first draft wrong
    tokens = np.concatenate([t0[:, None], drafts], 1)
    out, accepted, cache = _verify(eng, cache, slots, tokens, [3, 3, 3, 0])
    out, accepted = np.asarray(out), np.asarray(accepted)
    np.testing.assert_array_equal(accepted[:3], [3, 1, 0])
    for i in range(3):
        np.testing.assert_array_equal(out[i, :accepted[i] + 1], greedy[i, :accepted[i] + 1])
        for pool, want in zip(jax.tree.leaves(cache.ssm), jax.tree.leaves(states[accepted[i]])):
            assert rel_err(np.asarray(pool)[:, i], want[:, i]) < 1e-5
    np.testing.assert_array_equal(np.asarray(cache.seq_lens), list(lengths[:3] + accepted[:3] + 1) + [0, 0])
    # rollback needs no re-run: row 1 decodes its next token from the committed state
    nxt = greedy[np.arange(4), np.minimum(accepted, K - 1)]
    lg, _ = _decode(eng, cache, slots, nxt)
    for i in range(3):
        assert rel_err(np.asarray(lg)[i], logits[accepted[i] + 1][i]) < 1e-4


def test_padded_rows_never_write_a_live_slot(model, eng, rng):
    """The padding slot holds NaN; rows of slot 0 decode, slot 1 verifies, slot 2 prefills with a capture;
    slot 3 (in no batch) keeps every bit, and no live row picks up a NaN."""
    lengths = np.array([7, 5, 9, 11])
    cache = _prefill(eng, model.new_cache(4, 64), [0, 1, 2, 3], _rows(rng, lengths), lengths).cache
    nan = lambda a: a.at[:, PAD].set(jnp.nan) if jnp.issubdtype(a.dtype, jnp.floating) else a
    cache = ModelCache(jax.tree.map(nan, cache.ssm), jax.tree.map(nan, cache.kv), cache.seq_lens)
    before = jax.tree.map(lambda a: np.asarray(a).copy(), cache)
    lg, cache = _decode(eng, cache, [0, PAD, PAD, PAD], rng.integers(0, EOS, 4))
    assert np.isfinite(np.asarray(lg)[0]).all()
    out, acc, cache = _verify(eng, cache, [1, PAD, PAD, PAD], rng.integers(0, EOS, (4, K)), [3, 0, 0, 0])
    out2 = _prefill(eng, cache, [2, PAD, PAD, PAD], _rows(rng, [6, 3, 3, 3]), [6, 0, 0, 0], [6, 0, 0, 0],
                    [0])
    cache = out2.cache
    assert np.isfinite(np.asarray(out2.logits)[0]).all() and np.isfinite(np.asarray(out2.captured[0].ssm)).all()
    after = jax.tree.map(np.asarray, cache)
    for a, b in zip(jax.tree.leaves(before.ssm) + jax.tree.leaves(before.kv),
                    jax.tree.leaves(after.ssm) + jax.tree.leaves(after.kv)):
        np.testing.assert_array_equal(a[:, 3], b[:, 3])
        assert np.isfinite(b[:, :4]).all()
    np.testing.assert_array_equal(after.seq_lens, [8, 5 + int(acc[0]) + 1, 15, 11, 0])


def test_slot_helpers_touch_only_their_slot(model, eng, rng):
    lengths = np.array([16, 9, 12, 0])
    cache = _prefill(eng, model.new_cache(4, 64), [0, 1, 2, PAD], _rows(rng, lengths), lengths).cache
    state = steps.slot_ssm_state(cache, 0)
    exe = eng.exe
    block = exe.run("kv_block_get", functools.partial(steps.kv_block_get, block=8), cache, _d(0), _d(8), static=8)
    np.testing.assert_array_equal(np.asarray(block.k), np.asarray(cache.kv.k)[:, 0, 8:16])
    before = jax.tree.map(lambda a: np.asarray(a).copy(), cache)
    cache = exe.run("zero_slot", steps.zero_slot, cache, _d(1), donate_argnums=(0,))
    cache = exe.run("restore_ssm", steps.restore_ssm, cache, _d(1), state, _d(16), donate_argnums=(0,))
    cache = exe.run("kv_block_put", steps.kv_block_put, cache, _d(1), _d(8), block, donate_argnums=(0,))
    after = jax.tree.map(np.asarray, cache)
    for a, b in zip(jax.tree.leaves(before.ssm), jax.tree.leaves(after.ssm)):
        np.testing.assert_array_equal(b[:, 1], a[:, 0])                     # restored from slot 0
        np.testing.assert_array_equal(np.delete(b, 1, axis=1), np.delete(a, 1, axis=1))
    np.testing.assert_array_equal(after.kv.k[:, 1, 8:16], before.kv.k[:, 0, 8:16])
    assert not after.kv.k[:, 1, :8].any() and not after.kv.k[:, 1, 16:].any()   # zeroed, then one block
    np.testing.assert_array_equal(np.delete(after.kv.v, 1, axis=1), np.delete(before.kv.v, 1, axis=1))
    np.testing.assert_array_equal(after.seq_lens, [16, 16, 12, 0, 0])
