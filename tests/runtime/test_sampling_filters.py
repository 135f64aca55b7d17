"""The sampler's filters (top-k, min-p, top-p in HF / vLLM order) against a numpy reference, the distributions the
sampler and the speculative acceptance rule draw from, and the raw log-probs reported with the tokens."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.runtime.sampling import filtered_logits, sample_tokens, token_logprobs
from metrale_jax.runtime.speculative import accept_drafts
from tests import numpy_refs_model as ref


def kept_reference(logits, temperature, top_p, top_k, min_p):
    """The tokens HF transformers' warpers keep, one after the other on the temperature-scaled distribution:
    top-k, then min-p (relative to the most likely), then top-p over what is left, renormalized; top_p 1 is no
    filter (the running float64 mass can reach 1 before the last tokens of negligible probability)."""
    z = np.asarray(logits, np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(len(p), bool)
    keep[order[:top_k if top_k > 0 else len(p)]] = True
    keep &= p >= min_p * p.max()
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    mass = 0.0
    final = np.zeros(len(p), bool)
    for i in order:
        if not keep[i] or (top_p < 1 and mass >= top_p):
            break
        final[i] = True
        mass += q[i]
    return final


def test_filters_keep_what_the_sequential_reference_keeps(rng):
    """256 rows of random logits with random (temperature, top_p, top_k, min_p) each, some filters off."""
    B, V = 256, 40
    logits = rng.standard_normal((B, V)) * rng.uniform(0.5, 4, (B, 1))
    temperature = rng.uniform(0.3, 2.0, B)
    top_p = np.where(rng.random(B) < 0.3, 1.0, rng.uniform(0.05, 1.0, B))
    top_k = np.where(rng.random(B) < 0.3, 0, rng.integers(1, V + 5, B))
    min_p = np.where(rng.random(B) < 0.3, 0.0, rng.uniform(0.0, 0.6, B))
    z = np.asarray(jax.jit(filtered_logits)(jnp.asarray(logits, jnp.float32), jnp.asarray(temperature, jnp.float32),
                                            jnp.asarray(top_p, jnp.float32), jnp.asarray(top_k, jnp.int32),
                                            jnp.asarray(min_p, jnp.float32)))
    disagree = 0
    for b in range(B):
        want = kept_reference(np.float32(logits[b]), temperature[b], top_p[b], top_k[b], min_p[b])
        got = np.isfinite(z[b])
        assert got[np.argmax(logits[b])]                                   # the top token always survives
        if not np.array_equal(got, want):
            disagree += 1                                                  # a float32 / float64 boundary case
            assert np.sum(got != want) == 1, (b, got, want)
        np.testing.assert_allclose(z[b][got], (np.float32(logits[b]) / np.float32(temperature[b]))[got], rtol=1e-5)
    assert disagree <= 2
    k = int(rng.integers(1, V))                                            # top_k alone keeps exactly k (no ties)
    only_k = jax.jit(filtered_logits)(jnp.asarray(logits, jnp.float32), jnp.ones(B), jnp.ones(B),
                                      jnp.full(B, k, jnp.int32), jnp.zeros(B))
    assert (np.isfinite(np.asarray(only_k)).sum(-1) == k).all()


def test_top_k_and_min_p_draws_follow_the_filtered_distribution():
    """probs (0.4, 0.3, 0.2, 0.1): top_k 2 draws tokens 0 and 1 as 4 : 3; min_p 0.4 keeps those >= 0.16: 0, 1, 2 as
    4 : 3 : 2; together with top_p 0.5 only 0 and 1 again."""
    n = 6000
    logits = jnp.tile(jnp.log(jnp.array([0.4, 0.3, 0.2, 0.1])), (n, 1))
    f = jax.jit(functools.partial(sample_tokens, sampling=True))
    ones = jnp.ones(n)
    for top_k, min_p, top_p, want in ((2, 0.0, 1.0, [4 / 7, 3 / 7, 0, 0]), (0, 0.4, 1.0, [4 / 9, 3 / 9, 2 / 9, 0]),
                                      (3, 0.4, 0.5, [4 / 7, 3 / 7, 0, 0])):
        draws = np.asarray(f(logits, ones, jnp.full(n, top_p), jnp.arange(n), jnp.zeros(n, jnp.int32),
                             top_k=jnp.full(n, top_k, jnp.int32), min_p=jnp.full(n, min_p)))
        freq = np.bincount(draws, minlength=4) / n
        assert np.abs(freq - want).max() < 0.025, (top_k, min_p, top_p, freq)


def test_speculative_acceptance_emits_the_top_k_min_p_distribution(rng):
    """One draft d at temperature 1 with top_k 3 and min_p 0.1: the first emitted token of 20000 seeded rows
    follows the filtered p whatever d is, and d is accepted with its filtered probability (0 if filtered out)."""
    N, V = 20000, 6
    z = np.array([1.5, 1.0, 0.4, 0.3, -1.0, -3.0])
    keep = kept_reference(z, 1.0, 1.0, 3, 0.1)
    q = np.where(keep, np.exp(z), 0)
    q /= q.sum()
    logits = jnp.asarray(np.broadcast_to(z, (N, 2, V)), jnp.float32)
    f = jax.jit(functools.partial(accept_drafts, sampling=True))
    for d in (1, 4):
        tokens = jnp.asarray(np.stack([np.zeros(N), np.full(N, d)], 1), jnp.int32)
        out, acc = f(logits, tokens, jnp.ones(N, jnp.int32), jnp.ones(N), jnp.ones(N), jnp.arange(N) + 11 * d,
                     jnp.full(N, 2, jnp.int32), top_k=jnp.full(N, 3, jnp.int32), min_p=jnp.full(N, 0.1))
        out, acc = np.asarray(out), np.asarray(acc)
        freq = np.bincount(out[:, 0], minlength=V) / N
        assert np.abs(freq - q).max() < 0.015, (d, freq, q)
        assert abs(acc.mean() - q[d]) < 0.015


def test_token_logprobs_are_the_raw_log_softmax_and_its_top_n(rng):
    logits = rng.standard_normal((3, 5, 50)).astype(np.float32) * 3
    tokens = rng.integers(0, 50, (3, 5))
    lp = jax.jit(token_logprobs, static_argnums=2)(jnp.asarray(logits), jnp.asarray(tokens), 4)
    want = ref.log_softmax(logits)
    np.testing.assert_allclose(np.asarray(lp.chosen), np.take_along_axis(want, tokens[..., None], -1)[..., 0],
                               atol=1e-5)
    order = np.argsort(-want, -1)[..., :4]
    np.testing.assert_array_equal(np.asarray(lp.top_ids), order)
    np.testing.assert_allclose(np.asarray(lp.top_logprobs), np.take_along_axis(want, order, -1), atol=1e-5)
