"""Hostile and careless use of the Engine: settings of the wrong type refused by name before the pool is allocated,
a batch with one bad request queueing none of it, a stream callback that raises or is no callable, a drafter whose
proposals are no token ids, and score batches numpy cannot take as they are."""

import numpy as np
import pytest

from metrale_jax.errors import ConfigError, RequestError, ShapeError
from metrale_jax.runtime import SpeculativeConfig
from metrale_jax.state.cache import ModelCache
from tests.runtime.conftest import EOS, V


@pytest.fixture
def no_allocation(monkeypatch):
    """Fails the test if a cache is allocated."""
    def refuse(*args, **kwargs):
        raise AssertionError("a cache was allocated")
    monkeypatch.setattr(ModelCache, "for_config", classmethod(refuse))


@pytest.mark.parametrize("field, kwargs", [
    ("prefill_token_budget", dict(prefill_token_budget=2.5)), ("prefill_token_budget", dict(prefill_token_budget="8")),
    ("prefill_token_budget", dict(prefill_token_budget=True)), ("max_slots", dict(max_slots="3")),
    ("max_len", dict(max_len=0)), ("eos_ids", dict(eos_ids=[1.5])), ("eos_ids", dict(eos_ids="ab")),
    ("eos_ids", dict(eos_ids=7)), ("eos_ids", dict(eos_ids=[V])), ("eos_ids", dict(eos_ids=[-1])),
    ("capture_rows", dict(capture_rows=2.5)), ("batch_buckets", dict(batch_buckets=(2.5, 4))),
    ("batch_buckets", dict(batch_buckets="4")), ("token_buckets", dict(token_buckets=[0, 8])),
    ("min_token_bucket", dict(min_token_bucket=0.5)), ("speculative", dict(speculative=True)),
    ("speculative.num_draft", dict(speculative=SpeculativeConfig(num_draft=64))),       # max_len is 64
    ("prefix_cache_bytes", dict(prefix_cache_bytes="1GB")), ("prefix_cache_bytes", dict(prefix_cache_bytes=-1)),
    ("prefix_block", dict(prefix_cache_bytes=1 << 20, prefix_block=8.0)),
])
def test_bad_settings_are_refused_by_name_before_the_pool_is_allocated(make_engine, no_allocation, field, kwargs):
    """Not truncated (2.5 -> 2), not converted (True -> 1, "8" -> 8), not a raw TypeError, and before allocating."""
    with pytest.raises(ConfigError) as e:
        make_engine(**kwargs)
    assert e.value.field == field, str(e.value)


@pytest.mark.parametrize("field, kwargs", [
    ("speculative.num_draft", dict(num_draft=2.5)), ("speculative.num_draft", dict(num_draft="2")),
    ("speculative.num_draft", dict(num_draft=True)), ("speculative.max_ngram", dict(max_ngram=10 ** 9)),
])
def test_bad_speculative_configs_name_their_field(field, kwargs):
    """max_ngram 10**9 would make the n-gram index build 10**9 tables for each request."""
    with pytest.raises(ConfigError) as e:
        SpeculativeConfig(**kwargs)
    assert e.value.field == field, str(e.value)


def test_a_batch_with_one_refused_request_queues_none_of_it(make_engine):
    """generate / score check every request before queueing any: otherwise the good ones stay queued, never popped,
    and take slots from the engine's next batch."""
    eng = make_engine()
    with pytest.raises(ShapeError, match=r"prompt: 60 tokens \+ max_new_tokens 10 exceed the engine's max_len 64"):
        eng.generate([[1, 2, 3], list(range(60))], 10)
    with pytest.raises(ShapeError, match=r"ids\[1\]: token ids must lie in \[0, 96\)"):
        eng.score(np.array([[1, 2, 3], [1, 2, V]]))
    with pytest.raises(ConfigError, match="on_token: expected a callable"):
        eng.submit([1, 2], 2, on_token=5)                       # would raise TypeError mid-step, in a read-back
    with pytest.raises(ConfigError, match="stream: expected a callable"):
        eng.generate([[1, 2]], 2, stream="print")
    assert not eng.has_work and not eng.requests


@pytest.mark.parametrize("ids, lengths, message", [
    (np.ones((0, 5), np.int32), None, r"ids: expected \[B, T\] token ids with B >= 1 and T >= 2, got \[0, 5\]"),
    (np.ones((2, 5), np.int32), [2.5, 3], r"lengths: expected \[2\] integers in \[1, 5\], got float64\[2\]"),
    (np.ones((2, 5), np.int32), [True, True], r"lengths: expected \[2\] integers in \[1, 5\], got bool\[2\]"),
    ([[1, 2, 3], [1, 2]], None, "ids: expected a rectangular array of integers"),
])
def test_score_batches_numpy_cannot_take_are_shape_errors(make_engine, ids, lengths, message):
    eng = make_engine()
    with pytest.raises(ShapeError, match=message):
        eng.score(ids, lengths)
    assert not eng.has_work and not eng.requests


def test_pop_names_an_unknown_or_unfinished_request(make_engine):
    """A typed error naming the id (and still a KeyError, as a lookup), and the request stays to be popped later."""
    eng = make_engine()
    rid = eng.submit([1, 2, 3], 2)
    with pytest.raises(RequestError, match=rf"rid: request {rid} is not finished yet") as e:
        eng.pop(rid)
    assert isinstance(e.value, KeyError) and str(e.value).startswith("rid:")
    eng.run()
    assert len(eng.pop(rid).tokens) >= 1
    with pytest.raises(RequestError, match=rf"rid: request {rid} is unknown"):
        eng.pop(rid)


class _Boom(Exception):
    pass


def test_a_raising_on_token_ends_its_own_request_and_no_other(make_engine, rng):
    """Request 1's callback raises at its third token: it ends with finish_reason 'error' and the exception, its
    slot goes to the queued fifth request, and every other request emits exactly what it emits without it.
    generate re-raises a stream's exception, once the engine is empty again."""
    prompts = [rng.integers(0, EOS, n).tolist() for n in (5, 9, 7, 6, 11)]
    want = [g.tokens for g in make_engine(eos_ids=[]).generate(prompts, 8)]
    eng = make_engine(eos_ids=[])

    def boom(rid, token):
        if len(eng.requests[rid].tokens) == 3:
            raise _Boom("stream broke")
    rids = [eng.submit(p, 8, on_token=boom if i == 1 else None) for i, p in enumerate(prompts)]
    eng.run()
    got = [eng.pop(rid) for rid in rids]
    assert got[1].finish_reason == "error" and isinstance(got[1].error, _Boom) and got[1].tokens == want[1][:3]
    assert got[4].slot == got[1].slot                                     # admitted into the slot freed
    assert [got[i].tokens for i in (0, 2, 3, 4)] == [want[i] for i in (0, 2, 3, 4)]
    assert all(len(w) == 8 for w in want)

    def stream(i, token):
        if i == 0:
            raise _Boom("stream broke")
    with pytest.raises(_Boom):
        eng.generate(prompts[:2], 4, stream=stream)
    assert not eng.has_work and not eng.requests


class _Proposes:
    """A drafter that proposes the same drafts whatever it is asked."""

    def __init__(self, drafts):
        self.drafts = drafts

    def new_sequence(self, context):
        return self

    def append(self, token):
        pass

    def propose(self, limit):
        return self.drafts


@pytest.mark.parametrize("drafts", [[-1], [V], [1, 2, 3], [1.0], [True], None])
def test_a_drafters_proposals_must_be_token_ids_within_its_limit(make_engine, drafts):
    """A draft of -1 would be read as token V-1 by the acceptance and emitted as -1; drafts past the limit would
    write the cache past the request's length; [1, 2, 3] is one more than num_draft 2 allows."""
    eng = make_engine(eos_ids=[], speculative=SpeculativeConfig(num_draft=2), drafter=_Proposes(drafts))
    eng.submit([1, 2, 3], 4)
    with pytest.raises(ConfigError, match=r"drafter: propose\(2\) must return a list of at most 2 token ids in "
                                          r"\[0, 96\)"):
        eng.run()
