"""Per-request SamplingParams through the engine (tiny random model, every block kind, f32): each request's tokens
do not depend on its neighbours' parameters, top-k 1 / min-p 1 are greedy with and without speculation, the
reported log-probs are the raw log-softmax of a no-cache forward (and its top n), and nothing compiles after a
warm-up that names the log-prob width."""

import dataclasses

import numpy as np
import pytest

from metrale_jax.errors import ConfigError
from metrale_jax.runtime import SpeculativeConfig
from metrale_jax.runtime.sampling_params import MAX_LOGPROBS, SamplingParams, per_request, resolve, stream_seed
from tests import numpy_refs_model as ref
from tests.runtime.test_engine import _forward, _prompts
from tests.runtime.test_engine_overlap import _Oracle      # drafts a known continuation, wrong every other step


def _forward_logprobs(model, seqs):
    return ref.log_softmax(_forward(model, seqs))


def test_each_request_draws_the_same_alone_as_in_a_batch_of_other_parameters(make_engine, rng):
    prompts = _prompts(rng, [7, 18, 11, 4, 9])
    params = [SamplingParams(max_new_tokens=10, temperature=1.0, top_k=5, seed=int(rng.integers(1 << 40))),
              SamplingParams(max_new_tokens=8, temperature=0.8, min_p=0.05, top_p=0.9, seed=2),
              SamplingParams(max_new_tokens=10),
              SamplingParams(max_new_tokens=6, temperature=1.3, top_k=3, min_p=0.02, seed=3, logprobs=2),
              SamplingParams(max_new_tokens=9, temperature=1.0, seed=4, logprobs=0)]
    eng = make_engine(prefill_token_budget=16)                      # 5 requests over 4 slots: one queues
    batch = eng.generate(prompts, params)
    for p, sp, g in zip(prompts, params, batch):
        alone = eng.generate([p], [sp])[0]
        assert (alone.tokens, alone.finish_reason) == (g.tokens, g.finish_reason)
        assert (alone.logprobs is None) == (sp.logprobs is None) and (g.logprobs is None) == (sp.logprobs is None)
        if sp.logprobs is not None:
            np.testing.assert_allclose(alone.logprobs, g.logprobs, rtol=1e-6)
    for seed in (params[0].seed + 1, params[0].seed + 2 ** 31):         # 2**31 apart: not the same int32 stream
        other = eng.generate(prompts[:1], [dataclasses.replace(params[0], seed=seed)])[0]
        assert other.tokens != batch[0].tokens or len(set(batch[0].tokens)) == 1


def test_top_k_1_and_min_p_1_are_greedy_with_and_without_speculation_and_a_huge_top_k_is_off(make_engine, rng):
    prompts = _prompts(rng, [6, 15, 10])
    greedy = [g.tokens for g in make_engine().generate(prompts, 12)]
    drafter = _Oracle({tuple(p): t for p, t in zip(prompts, greedy)})
    for kw in (dict(top_k=1), dict(min_p=1.0)):
        plain = make_engine().generate(prompts, 12, temperature=2.0, seed=9, **kw)
        assert [g.tokens for g in plain] == greedy
        spec = make_engine(speculative=SpeculativeConfig(num_draft=3), drafter=drafter)
        assert [g.tokens for g in spec.generate(prompts, 12, temperature=2.0, seed=9, **kw)] == greedy
        c = spec.counters
        assert c["verify_rows"] > 0 and 0 < c["accepted_tokens"] < c["drafted_tokens"]
    free = [g.tokens for g in make_engine().generate(prompts, 12, temperature=1.0, seed=3)]
    assert [g.tokens for g in make_engine().generate(prompts, 12, temperature=1.0, seed=3, top_k=10 ** 12)] == free


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_logprobs_are_the_raw_log_softmax_of_forward_and_its_top_n(model, make_engine, rng, speculative):
    """Sampled at temperature 0.05 with top-k (the last request greedy, so that its greedy drafts are accepted
    whatever the seed: a sampled row's drafts stop matching after its first non-greedy token): the log-probs are
    those of the untempered, unfiltered distribution; one per kept token (an eos that ends a request has none); a
    request that asks for none gets None."""
    prompts = _prompts(rng, [5, 12, 9, 14])
    kw = {}
    if speculative:
        greedy = make_engine().generate(prompts, 12)                      # drafts a cool sampler often accepts
        drafter = _Oracle({tuple(p): g.tokens for p, g in zip(prompts, greedy)})
        kw = dict(speculative=SpeculativeConfig(num_draft=2), drafter=drafter)
    eng = make_engine(prefill_token_budget=8, **kw)
    params = [SamplingParams(max_new_tokens=12, temperature=t, top_k=20, seed=i, logprobs=n)
              for i, (t, n) in enumerate([(0.05, 3), (0.05, 0), (0.05, None), (0.0, 5)])]
    gens = eng.generate(prompts, params)
    lp = _forward_logprobs(model, [p + g.tokens for p, g in zip(prompts, gens)])
    for b, (p, g, sp) in enumerate(zip(prompts, gens, params)):
        if sp.logprobs is None:
            assert g.logprobs is None and g.top_logprobs is None
            continue
        rows = lp[b, len(p) - 1:len(p) - 1 + len(g.tokens)]                 # the distribution each token came from
        assert len(g.logprobs) == len(g.tokens)
        np.testing.assert_allclose(g.logprobs, rows[np.arange(len(g.tokens)), g.tokens], atol=2e-4)
        if sp.logprobs == 0:
            assert g.top_logprobs is None
            continue
        assert [len(t) for t in g.top_logprobs] == [sp.logprobs] * len(g.tokens)
        for row, top in zip(rows, g.top_logprobs):
            ids, vals = zip(*top)
            np.testing.assert_allclose(vals, np.sort(row)[::-1][:sp.logprobs], atol=2e-4)
            np.testing.assert_allclose(row[list(ids)], vals, atol=2e-4)
    if speculative:
        assert eng.counters["accepted_tokens"] > 0


def test_no_compile_after_a_warmup_with_logprobs(make_engine, rng):
    eng = make_engine(prefill_token_budget=16, speculative=SpeculativeConfig(num_draft=2))
    eng.warmup(sampling=True, logprobs=True)
    compiles = eng.compiles
    prompts = _prompts(rng, [9, 5, 13, 7, 11])
    rep = prompts[0][:4] * 4                                         # n-gram drafts for the speculative steps
    params = [SamplingParams(max_new_tokens=8, temperature=t, top_k=k, logprobs=n, seed=i)
              for i, (t, k, n) in enumerate([(0, 0, None), (1.0, 4, 3), (0.5, 0, 0), (0, 0, 4), (1.0, 0, None)])]
    eng.generate(prompts + [rep], params + [SamplingParams(max_new_tokens=8, logprobs=2)])
    assert eng.compiles == compiles, eng.exe.stats()
    assert eng.counters["verify_rows"] > 0


@pytest.mark.parametrize("field, value", [
    ("max_new_tokens", -1), ("max_new_tokens", 2.5), ("temperature", float("nan")), ("temperature", -1.0),
    ("top_p", 0.0), ("top_p", 1.01), ("top_k", -1), ("top_k", 1.5), ("min_p", 1.5), ("min_p", float("inf")),
    ("seed", 2 ** 63), ("stop", [""]), ("stop", [1.5]), ("stop", [-3]), ("stop", b"\n"),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", True),
    ("temperature", 10 ** 400), ("top_p", -10 ** 400), ("min_p", 10 ** 400),
    pytest.param("seed", 10 ** 5000, id="seed-10**5000"), pytest.param("stop", [-10 ** 5000], id="stop--10**5000"),
    pytest.param("max_new_tokens", -10 ** 5000, id="max_new_tokens--10**5000"),
])
def test_bad_sampling_params_name_their_field(field, value):
    """Ints too large for a float (10**400) or for repr (10**5000) too: a ConfigError with a short message, not an
    OverflowError or ValueError from the check or its message."""
    with pytest.raises(ConfigError) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field and len(str(e.value)) < 200


def test_stream_seeds_keep_small_seeds_and_separate_seeds_2_to_the_31_apart(rng):
    small = [int(s) for s in rng.integers(0, 2 ** 31, 50)] + [0, 2 ** 31 - 1]
    assert [stream_seed(s) for s in small] == small                    # the streams users already have stay
    big = [int(s) for s in rng.integers(-2 ** 63, 2 ** 63, 200, dtype=np.int64)]
    for s in small + big:
        t = stream_seed(s)
        assert 0 <= t < 2 ** 31
        if -2 ** 63 <= s + 2 ** 31 < 2 ** 63:
            assert stream_seed(s + 2 ** 31) != t
    assert stream_seed(-1) != stream_seed(2 ** 31 - 1) and stream_seed(-2 ** 63) != stream_seed(0)
    assert len({stream_seed(s) for s in big}) == len(set(big))
    many = per_request(SamplingParams(seed=2 ** 40 + 5), 2) + per_request(SamplingParams(seed=2 ** 40 + 5 + 2 ** 31), 2)
    assert len({p.seed for p in many}) == 4


def test_params_resolve_from_old_arguments_and_overrides():
    assert resolve(7) == SamplingParams(max_new_tokens=7)
    assert resolve(SamplingParams(top_k=3), seed=5) == SamplingParams(top_k=3, seed=5)
    assert SamplingParams(stop="\n").stop == ("\n",) and SamplingParams(stop=[4, "ab"]).stop == (4, "ab")
    many = per_request(SamplingParams(seed=11, temperature=1.0), 3)
    assert len({p.seed for p in many}) == 3 and all(p.temperature == 1.0 for p in many)
    own = [SamplingParams(seed=4), SamplingParams(seed=4)]
    assert [p.seed for p in per_request(own, 2)] == [4, 4]               # a list keeps each request's own seed
    with pytest.raises(ConfigError, match="one SamplingParams per prompt"):
        per_request(own, 3)
    with pytest.raises(TypeError):
        resolve(None, temprature=1.0)                                    # a misspelt field is not ignored
