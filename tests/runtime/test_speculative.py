"""Drafters, the acceptance rule (greedy and exact speculative sampling) and the per-row sampler."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.config import ModelConfig
from metrale_jax.errors import ConfigError
from metrale_jax.runtime.sampling import sample_tokens
from metrale_jax.runtime.speculative import (MtpDrafter, NgramIndex, SpeculativeConfig, accept_drafts,
                                             make_drafter)
from tests.runtime.conftest import CFG


def test_ngram_proposes_what_followed_the_latest_longest_match():
    idx = NgramIndex([1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3], min_n=1, max_n=3)
    assert idx.propose(3) == [5, 6, 7]                 # suffix (2, 3): its latest earlier end is 7
    idx.append(5)
    assert idx.propose(2) == [6, 7]                    # (2, 3, 5) occurred before
    idx.append(8)                                      # (5, 8) never occurred, (8) neither
    assert idx.propose(3) == []
    assert idx.propose(0) == []
    built = NgramIndex(idx.tokens, 1, 3)
    assert built._index == idx._index and built.tokens == idx.tokens


def test_ngram_continuation_may_run_into_the_suffix_and_stops_at_the_end():
    idx = NgramIndex([7, 7, 7], min_n=2, max_n=2)
    assert idx.propose(5) == [7]                       # (7, 7) ended at 2: one token follows
    assert NgramIndex([4, 5], 1, 2).propose(3) == []


def test_drafter_factory_and_the_mtp_checks():
    assert isinstance(make_drafter(None, SpeculativeConfig()).new_sequence([1, 2]), NgramIndex)
    with pytest.raises(ConfigError, match="num_nextn_predict_layers = 0"):
        make_drafter(types.SimpleNamespace(config=CFG), SpeculativeConfig(method="mtp"))
    mtp = ModelConfig.from_hf({**{"vocab_size": 96, "hidden_size": 32, "hybrid_override_pattern": "M-"},
                               "num_nextn_predict_layers": 1})
    with pytest.raises(ConfigError, match="no mtp.* tensors"):           # MTP layers in the config, no weights
        make_drafter(types.SimpleNamespace(config=mtp, mtp=None), SpeculativeConfig(method="mtp"))
    drafter = make_drafter(types.SimpleNamespace(config=mtp, mtp=object()), SpeculativeConfig(method="mtp"))
    assert isinstance(drafter, MtpDrafter) and drafter.new_sequence([1, 2]) is None   # drafts come from the device
    for bad in (dict(method="eagle"), dict(num_draft=0), dict(min_ngram=3, max_ngram=2)):
        with pytest.raises(ConfigError, match="speculative"):
            SpeculativeConfig(**bad)


def _accept(logits, tokens, num_draft, temperature, top_p, seeds, counters, sampling):
    f = jax.jit(functools.partial(accept_drafts, sampling=sampling))
    out = f(jnp.asarray(logits, jnp.float32), jnp.asarray(tokens, jnp.int32), jnp.asarray(num_draft, jnp.int32),
            jnp.asarray(temperature, jnp.float32), jnp.asarray(top_p, jnp.float32), jnp.asarray(seeds, jnp.int32),
            jnp.asarray(counters, jnp.int32))
    return tuple(np.asarray(o) for o in out)


def test_greedy_acceptance_keeps_the_longest_run_of_argmax_drafts(rng):
    n, k, V = 4, 4, 10
    logits = rng.standard_normal((n, k, V))
    pred = logits.argmax(-1)
    tokens = np.zeros((n, k), np.int64)
    tokens[:, 0] = rng.integers(0, V, n)
    tokens[:, 1:] = pred[:, :-1]                       # every draft right ...
    tokens[1, 2] = (pred[1, 1] + 1) % V                # ... but row 1's second
    tokens[2, 1] = (pred[2, 0] + 1) % V                # ... and row 2's first
    num_draft = [3, 3, 3, 2]                           # row 3 has two real drafts
    for sampling in (False, True):                     # temperature 0 rows are greedy either way
        out, acc = _accept(logits, tokens, num_draft, np.zeros(n), np.ones(n), np.arange(n), np.zeros(n), sampling)
        np.testing.assert_array_equal(acc, [3, 1, 0, 2])
        for i in range(n):
            np.testing.assert_array_equal(out[i, :acc[i] + 1], pred[i, :acc[i] + 1])


def test_speculative_sampling_emits_the_target_distribution(rng):
    """One draft d of a 5-token vocabulary at temperature 1 and top-p 0.95: the first emitted token of
    20000 seeded rows follows p (top-p filtered) whatever d is, and d is accepted with probability p(d)."""
    N, V = 20000, 5
    z = np.array([1.2, 0.6, 0.0, -0.4, -3.0])
    p = np.exp(z) / np.exp(z).sum()
    kept = np.argsort(-p)[:np.searchsorted(np.cumsum(np.sort(p)[::-1]), 0.95) + 1]
    q = np.where(np.isin(np.arange(V), kept), p, 0)
    q /= q.sum()
    logits = np.broadcast_to(z, (N, 2, V))
    for d in (0, 2):
        tokens = np.stack([np.zeros(N), np.full(N, d)], 1)
        out, acc = _accept(logits, tokens, np.ones(N), np.ones(N), np.full(N, 0.95), np.arange(N) + 7 * d,
                           np.full(N, 3), True)
        freq = np.bincount(out[:, 0], minlength=V) / N
        assert np.abs(freq - q).max() < 0.015, (d, freq, q)
        assert abs(acc.mean() - q[d]) < 0.015
        assert (out[acc == 1, 0] == d).all() and (out[acc == 0, 0] != d).all()


def test_sampler_top_p_greedy_rows_and_seeded_rows():
    logits = jnp.tile(jnp.log(jnp.array([0.4, 0.3, 0.2, 0.1])), (4000, 1))
    n = logits.shape[0]
    f = jax.jit(functools.partial(sample_tokens, sampling=True))
    temp = jnp.ones(n).at[0].set(0.0)
    draws = np.asarray(f(logits, temp, jnp.full(n, 0.5), jnp.arange(n), jnp.zeros(n, jnp.int32)))
    assert set(draws.tolist()) == {0, 1} and draws[0] == 0
    assert abs((draws == 0).mean() - 4 / 7) < 0.03
    again = np.asarray(f(logits[:10], temp[:10], jnp.full(10, 0.5), jnp.arange(10), jnp.zeros(10, jnp.int32)))
    np.testing.assert_array_equal(again, draws[:10])                # a row's draw does not depend on the batch
    greedy = np.asarray(jax.jit(functools.partial(sample_tokens, sampling=False))(
        logits, temp, jnp.ones(n), jnp.arange(n), jnp.zeros(n, jnp.int32)))
    assert (greedy == 0).all()
