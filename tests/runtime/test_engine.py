"""Engine acceptance on a tiny random model with every block kind (f32).

Greedy outputs equal the argmax of a no-cache forward, and stay identical with the prefix cache on or
off, with speculative decoding on or off, under prefill budgets 1, 7, 64 and 4096, and alone or in a
batch; prompt lengths are not multiples of the chunk size (8). A full pool queues; a released slot and
the padding slot leak nothing; after warm-up a 200-step mixed workload compiles nothing."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.errors import ConfigError, ShapeError
from metrale_jax.runtime import Engine, SpeculativeConfig
from metrale_jax.state.cache import ModelCache
from tests import numpy_refs_model as ref
from tests.numpy_refs import rel_err
from tests.runtime.conftest import EOS, V, shared_prefix_prompt

FWD_SHAPE = (8, 40)     # every forward reference is padded to this shape: one compile


def _prompts(rng, lengths):
    return [rng.integers(0, EOS, n).tolist() for n in lengths]


def _forward(model, seqs):
    ids = np.zeros(FWD_SHAPE, np.int32)
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = s
    return np.asarray(model.forward(ids))


def _tokens(gens):
    return [g.tokens for g in gens]


def _shared_prefix_prompts(rng):
    """Three prompts sharing 19 tokens, a repetitive one (n-gram drafts), an unrelated one."""
    base = rng.integers(0, EOS, 19).tolist()
    rep = rng.integers(0, EOS, 5).tolist() * 6
    return [base + rng.integers(0, EOS, n).tolist() for n in (4, 11, 2)] + [rep[:27], _prompts(rng, [13])[0]]


def test_greedy_equals_argmax_of_forward_and_a_full_pool_queues(model, make_engine, rng):
    prompts = _prompts(rng, [5, 13, 21, 9, 3, 17])                  # 6 requests, 4 slots
    eng = make_engine(prefill_token_budget=16)
    streamed = {}
    rids = [eng.submit(p, 10, on_token=lambda rid, t: streamed.setdefault(rid, []).append(t)) for p in prompts]
    done = eng.step()                                               # a request may end at once (eos)
    assert set(eng.running) | set(done) == set(rids[:4])
    assert [r.rid for r in eng.queue] == rids[4:]                   # queued, not failed
    eng.run()
    assert not eng.has_work and eng.allocator.free_count == 4
    gens = [eng.requests[r] for r in rids]
    logits = _forward(model, [p + g.tokens for p, g in zip(prompts, gens)])
    for b, (p, g) in enumerate(zip(prompts, gens)):
        want = np.argmax(logits[b, len(p) - 1:], -1)
        assert g.tokens == want[:len(g.tokens)].tolist()
        assert streamed.get(g.rid, []) == g.tokens
        if g.finish_reason == "eos":
            assert int(want[len(g.tokens)]) == EOS and len(g.tokens) < 10
        else:
            assert g.finish_reason == "length" and len(g.tokens) == 10


def test_outputs_identical_across_budgets_prefix_cache_and_speculation(make_engine, rng):
    prompts = _shared_prefix_prompts(rng)
    ref = _tokens(make_engine(prefill_token_budget=64).generate(prompts, 12))
    for budget in (1, 7, 4096):
        assert _tokens(make_engine(prefill_token_budget=budget).generate(prompts, 12)) == ref, budget

    eng = make_engine(prefill_token_budget=16, prefix_cache_bytes=1 << 20)
    assert _tokens(eng.generate(prompts[:1], 12)) == ref[:1]           # snapshot at the block cut 16
    assert _tokens(eng.generate(prompts[1:], 12)) == ref[1:]           # two of them restore it
    again = eng.generate(prompts, 12)
    assert _tokens(again) == ref
    st = eng.prefix_cache.stats()
    assert st["hits"] >= 2 + 3 and st["hit_tokens"] >= 16 * 5 and st["inserts"] >= 3

    spec = make_engine(prefill_token_budget=7, speculative=SpeculativeConfig(num_draft=3), prefix_cache_bytes=1 << 20)
    assert _tokens(spec.generate(prompts, 12)) == ref
    assert spec.counters["drafted_tokens"] > 0 and spec.counters["verify_rows"] > 0


class _Oracle:
    """A drafter that knows each prompt's greedy continuation (or proposes a wrong token, bad=True)."""

    def __init__(self, answers, bad=False):
        self.answers, self.bad = answers, bad

    def new_sequence(self, context):
        return _OracleSeq(list(context), self.answers[tuple(context)], self.bad)


class _OracleSeq:
    def __init__(self, prompt, answer, bad):
        self.n, self.answer, self.bad, self.got = len(prompt), answer, bad, 0

    def append(self, token):
        self.got += 1

    def propose(self, limit):
        d = self.answer[self.got:self.got + limit]
        return [(t + 1) % EOS for t in d] if self.bad else d


def test_write_on_accept_with_all_drafts_right_and_all_wrong(make_engine, rng):
    prompts = _prompts(rng, [6, 15, 10])
    ref = _tokens(make_engine().generate(prompts, 12))
    answers = {tuple(p): r for p, r in zip(prompts, ref)}
    spec = SpeculativeConfig(num_draft=3)
    right = make_engine(speculative=spec, drafter=_Oracle(answers))
    assert _tokens(right.generate(prompts, 12)) == ref
    c = right.counters
    assert c["drafted_tokens"] > 0 and c["accepted_tokens"] == c["drafted_tokens"]
    assert c["steps"] < sum(len(r) for r in ref)                        # several tokens per step
    wrong = make_engine(speculative=spec, drafter=_Oracle(answers, bad=True))
    assert _tokens(wrong.generate(prompts, 12)) == ref
    assert wrong.counters["drafted_tokens"] > 0 and wrong.counters["accepted_tokens"] == 0


def test_released_and_padding_slots_leak_nothing(make_engine, rng):
    """After a request releases slot 0, every slot's state is overwritten with noise and the padding slot
    with NaN: the next requests still get exactly what a fresh engine gives them."""
    first, nxt = _prompts(rng, [9]), _prompts(rng, [12, 7])
    want = _tokens(make_engine().generate(nxt, 8))
    eng = make_engine()
    eng.generate(first, 8)
    c = eng.cache

    def poison(a):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            return a
        noise = jnp.asarray(rng.standard_normal(a.shape), a.dtype) * 3
        return noise.at[:, eng.pad].set(jnp.nan)

    eng.cache = ModelCache(jax.tree.map(poison, c.ssm), jax.tree.map(poison, c.kv),
                           jnp.asarray(rng.integers(1, 60, c.seq_lens.shape), jnp.int32))
    rids = [eng.submit(p, 8) for p in nxt]
    eng.run()
    assert [eng.requests[r].tokens for r in rids] == want
    assert eng.requests[rids[0]].slot == 0                               # the released slot was reused


def test_a_sequence_gets_the_same_alone_as_in_a_batch(make_engine, rng):
    """Greedy and seeded sampling (temperature 1, top-p 0.9): each request's tokens do not depend on the
    requests it shares steps with; a tiny top-p is greedy; another seed draws another sequence."""
    prompts = _prompts(rng, [7, 18, 11, 4])
    eng = make_engine(prefill_token_budget=16)
    for kw in (dict(), dict(temperature=1.0, top_p=0.9)):
        batch = [eng.submit(p, 10, seed=40 + i, **kw) for i, p in enumerate(prompts)]
        eng.run()
        for i, p in enumerate(prompts):
            alone = eng.submit(p, 10, seed=40 + i, **kw)
            eng.run()
            assert eng.requests[alone].tokens == eng.requests[batch[i]].tokens
    greedy = _tokens(eng.generate(prompts, 10))
    assert _tokens(eng.generate(prompts, 10, temperature=1.0, top_p=1e-6, seed=5)) == greedy
    a = _tokens(eng.generate(prompts, 10, temperature=2.0, seed=1))
    assert a == _tokens(eng.generate(prompts, 10, temperature=2.0, seed=1))
    assert a != _tokens(eng.generate(prompts, 10, temperature=2.0, seed=2))
    assert all(0 <= t < V for row in a for t in row)


def test_score_equals_log_softmax_of_forward(model, make_engine, rng):
    ids = rng.integers(0, EOS, (3, 30)).astype(np.int32)
    lengths = np.array([30, 17, 2])
    eng = make_engine(prefill_token_budget=7)                            # chunks cut through the rows
    lp = eng.score(ids, lengths)
    assert lp.shape == (3, 29)
    logits = _forward(model, list(ids))[:3, :29]
    want = np.take_along_axis(ref.log_softmax(logits), ids[:, 1:, None], -1)[..., 0]
    valid = np.arange(1, 30)[None] < lengths[:, None]
    assert rel_err(lp[valid], want[valid]) < 1e-4
    assert (lp[~valid] == 0).all()


def test_no_compile_after_warmup_over_200_mixed_steps(make_engine, rng, capsys):
    """Prefix cache, speculation, sampling, scoring, streaming, chunked prefill and eos, all at once."""
    eng = make_engine(prefill_token_budget=24, prefix_cache_bytes=1 << 20,
                      speculative=SpeculativeConfig(num_draft=3))
    eng.warmup(sampling=True, score=True)
    compiles, stats = eng.compiles, eng.exe.stats()
    bases = _prompts(rng, [17, 24, 9])
    streamed, submitted = [], 0
    while eng.counters["steps"] < 200:
        while len(eng.queue) < 3:
            kind = rng.integers(0, 4)
            prompt = shared_prefix_prompt(rng, bases, submitted)
            submitted += 1
            if kind == 0:
                eng.submit_score(prompt + [1])
            else:
                eng.submit(prompt, int(rng.integers(1, 64 - len(prompt) + 1) % 14), temperature=float(kind == 1),
                           top_p=0.8, seed=int(rng.integers(0, 100)), on_token=lambda rid, t: streamed.append(t))
        eng.step()
    eng.run(progress=True)
    assert eng.compiles == compiles, (stats, eng.exe.stats())
    c = eng.counters
    assert c["steps"] >= 200 and c["finished"] > 20 and len(streamed) == c["generated_tokens"] > 0
    assert c["verify_rows"] > 0 and c["decode_rows"] > 0 and eng.prefix_cache.hits > 0
    assert "engine" in capsys.readouterr().err                            # the tqdm bar ran


def test_bad_requests_and_settings_raise_typed_errors(model, make_engine, rng):
    eng = make_engine()
    with pytest.raises(ShapeError, match="max_len"):
        eng.submit(list(range(60)), 10)
    with pytest.raises(ShapeError, match="token ids must lie"):
        eng.submit([1, V], 2)
    with pytest.raises(ShapeError, match="non-empty"):
        eng.submit([], 2)
    with pytest.raises(ConfigError, match="top_p"):
        eng.submit([1, 2], 2, top_p=0.0)
    with pytest.raises(ConfigError, match="tokenizer"):
        eng.generate(["hello"], 2)
    with pytest.raises(ShapeError, match="lengths"):
        eng.score(np.ones((2, 5), np.int32), [5, 6])
    with pytest.raises(ConfigError, match="prefix_block"):
        make_engine(prefix_cache_bytes=1000, prefix_block=12)
    with pytest.raises(ConfigError, match="drafter"):
        make_engine(drafter=_Oracle({}))
    with pytest.raises(ConfigError, match="prefill_token_budget"):
        Engine(model, prefill_token_budget=0)
    with pytest.raises(ConfigError, match="sharding.TensorParallel"):
        Engine(types.SimpleNamespace(tp=object()))                  # a .tp that is no tensor-parallel plan
    assert not eng.has_work                                               # nothing bad was queued
