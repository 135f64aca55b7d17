"""The overlapped Engine (step n+1 dispatched before step n's tokens are read back) against a plain loop that
reads every token back before the next step: the same tokens and finish reasons, greedy and seeded, for mixed
prompt lengths, eos mid-batch, stop ids and stop strings, requests admitted while others decode, prefix-cache
hits and speculation; and no compile after warm-up."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.errors import ConfigError
from metrale_jax.model import NemotronH
from metrale_jax.runtime import SpeculativeConfig
from metrale_jax.runtime.sampling import sample_tokens
from metrale_jax.tokenizer import ByteTokenizer
from tests.runtime.conftest import CFG, EOS

PLAIN_T = 32                       # the plain loop pads every prompt to this length: one prefill compile


@functools.cache
def _sampler(sampling: bool):
    return jax.jit(functools.partial(sample_tokens, sampling=sampling))


def plain_loop(model, prompt, n, *, temperature=0.0, top_p=1.0, seed=0, eos=(), stop_ids=()):
    """One request alone: prefill, then sample / read back / decode one token at a time (the i-th draw on
    the request's stream (seed, i), as the engine's sampler draws it). Returns (tokens, finish reason)."""
    cache = model.new_cache(1, 64)
    ids = np.zeros((1, PLAIN_T), np.int32)
    ids[0, :len(prompt)] = prompt
    logits, cache = model.prefill(cache, [0], ids, [len(prompt)])
    sample = _sampler(temperature > 0)
    out = []
    for i in range(n):
        t = int(sample(logits, jnp.float32([temperature]), jnp.float32([top_p]), jnp.int32([seed]),
                       jnp.int32([i]))[0])
        if t in eos or t in stop_ids:
            return out, "eos" if t in eos else "stop"
        out.append(t)
        if len(out) == n:
            break
        logits, cache = model.decode(cache, [0], [t])
    return out, "length"


def _requests(rng, n):
    """n requests of mixed prompt lengths and budgets (a few share a prefix, for prefix-cache hits)."""
    base = rng.integers(0, EOS, 17).tolist()
    out = []
    for i in range(n):
        head = base if i % 3 == 0 else []
        prompt = head + rng.integers(0, EOS, int(rng.integers(1, 14))).tolist()
        out.append(dict(prompt=prompt, n=int(rng.integers(3, 12)), seed=100 + i))
    return out


def _mid_batch_eos(free):
    """A token that some continuation draws after its first token and some other never draws: as eos it ends
    one request mid-way while another runs to its length."""
    for t in (t for cont in free for t in cont[1:]):
        if any(t not in cont for cont in free):
            return t
    raise AssertionError(f"no continuation token is missing from another: {free}")


def _run(eng, reqs, **kw):
    rids = [eng.submit(r["prompt"], r["n"], seed=r["seed"], **kw) for r in reqs]
    eng.run()
    return [(eng.requests[i].tokens, eng.requests[i].finish_reason) for i in rids]


@pytest.mark.parametrize("kw", [dict(), dict(temperature=1.0, top_p=0.9)], ids=["greedy", "seeded"])
def test_overlapped_engine_equals_the_plain_loop(model, make_engine, rng, kw):
    """7 requests over 4 slots (admissions while others decode), chunked prefill, an eos token that the
    greedy / sampled continuations hit mid-batch, and the prefix cache on."""
    reqs = _requests(rng, 7)
    free = [plain_loop(model, r["prompt"], r["n"], seed=r["seed"], **kw)[0] for r in reqs]
    eos = _mid_batch_eos(free)
    want = [plain_loop(model, r["prompt"], r["n"], seed=r["seed"], eos={eos}, **kw) for r in reqs]
    assert any(reason == "eos" for _, reason in want) and any(reason == "length" for _, reason in want)
    eng = make_engine(prefill_token_budget=12, eos_ids=[eos], prefix_cache_bytes=1 << 20)
    got = _run(eng, reqs, **kw)
    assert got == want
    assert eng.prefix_cache.hits > 0 and not eng.has_work and eng.allocator.free_count == 4


class _Oracle:
    """A drafter that proposes each prompt's plain-loop continuation, every other step a wrong token instead."""

    def __init__(self, answers):
        self.answers = answers

    def new_sequence(self, context):
        return _OracleSeq(self.answers[tuple(context)])


class _OracleSeq:
    def __init__(self, answer):
        self.answer, self.got, self.calls = answer, 0, 0

    def append(self, token):
        self.got += 1

    def propose(self, limit):
        self.calls += 1
        d = list(self.answer[self.got:self.got + limit])
        return [(t + 1) % EOS for t in d] if self.calls % 2 else d


def test_overlapped_engine_with_speculation_equals_the_plain_loop(model, make_engine, rng):
    """Speculative steps (accepted and rejected drafts) between overlapped decode and prefill steps."""
    reqs = _requests(rng, 6)
    free = [plain_loop(model, r["prompt"], r["n"])[0] for r in reqs]
    eos = _mid_batch_eos(free)
    want = [plain_loop(model, r["prompt"], r["n"], eos={eos}) for r in reqs]
    drafter = _Oracle({tuple(r["prompt"]): t for r, t in zip(reqs, free)})
    eng = make_engine(eos_ids=[eos], speculative=SpeculativeConfig(num_draft=3), drafter=drafter,
                      prefill_token_budget=12)
    assert _run(eng, reqs) == want
    c = eng.counters
    assert c["verify_rows"] > 0 and 0 < c["accepted_tokens"] < c["drafted_tokens"]


def test_stop_ids_end_with_reason_stop_and_the_step_after_a_stop_is_discarded(model, make_engine, rng):
    """A stop id the caller gives ends a request with 'stop' (eos ids with 'eos'); the token its slot drew in
    the step dispatched before the stop was read back is discarded (never emitted, never streamed)."""
    reqs = _requests(rng, 4)
    free = [plain_loop(model, r["prompt"], r["n"], eos={EOS})[0] for r in reqs]
    stop = next(t[1] for t in free if len(t) > 2)
    want = [plain_loop(model, r["prompt"], r["n"], eos={EOS}, stop_ids={stop}) for r in reqs]
    eng = make_engine(eos_ids=[EOS])
    streamed = {}
    rids = [eng.submit(r["prompt"], r["n"], stop=[stop], on_token=lambda i, t: streamed.setdefault(i, []).append(t))
            for r in reqs]
    eng.run()
    got = [(eng.requests[i].tokens, eng.requests[i].finish_reason) for i in rids]
    assert got == want and any(reason == "stop" for _, reason in got)
    assert all(streamed.get(i, []) == eng.requests[i].tokens for i in rids)
    # the stopped requests drew one token more than they emitted (+1 for the stop token itself)
    stopped = [eng.requests[i] for i in rids if eng.requests[i].finish_reason == "stop"]
    assert all(r.drawn == len(r.tokens) + 2 for r in stopped if len(r.tokens) + 2 <= r.max_new_tokens)


def test_stop_strings_end_the_text_before_them(rng):
    """Stop strings (the model's tokenizer decodes the tokens): the request ends with 'stop' on the token that
    completes one, the text ends before it; the same in a batch as in the plain loop."""
    model = NemotronH.from_config(CFG, jax.random.key(3), dtype=jnp.float32, tokenizer=ByteTokenizer())
    from metrale_jax.runtime import Engine

    tok = model.tokenizer
    prompts = ["".join(map(chr, rng.integers(65, 91, int(rng.integers(2, 9))))) for _ in range(5)]   # A-Z
    plain = [plain_loop(model, tok.encode(p), 12, eos={EOS}) for p in prompts]
    free = [t for t, _ in plain]
    # a two-character stop string that some continuation holds from its 4th token on
    text = next(tok.decode(t) for t in free if len(tok.decode(t)) >= 6)
    stop = text[3:5]
    eng = Engine(model, max_slots=2, max_len=64, batch_buckets=(2,), token_buckets=(16,), eos_ids=[EOS])
    gens = eng.generate(prompts, 12, stop=[stop])
    for (t, reason), g in zip(plain, gens):
        full = tok.decode(t)
        if stop in full:
            # the shortest prefix of the free continuation whose text holds the stop string
            k = next(k for k in range(1, len(t) + 1) if stop in tok.decode(t[:k]))
            assert g.tokens == t[:k] and g.finish_reason == "stop"
            assert g.text == full[:full.find(stop)] and stop not in g.text
        else:
            assert g.tokens == t and g.finish_reason == reason
    assert any(g.finish_reason == "stop" for g in gens)
    with pytest.raises(ConfigError, match="stop"):
        eng.submit([4, 5], 3, stop=[""])
    with pytest.raises(ConfigError, match="stop"):
        eng.submit([4, 5], 3, stop=[1.5])


def test_no_compile_after_warmup_with_overlap_and_sampling(make_engine, rng):
    eng = make_engine(prefill_token_budget=16, prefix_cache_bytes=1 << 20)
    eng.warmup(sampling=True)
    compiles = eng.compiles
    for kw in (dict(), dict(temperature=0.7, top_p=0.8)):
        _run(eng, _requests(rng, 9), **kw)
    assert eng.compiles == compiles, eng.exe.stats()
    assert eng.counters["decode_rows"] > 0
