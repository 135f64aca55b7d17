"""The engine on a tensor / expert-parallel model (2 and 4 of the host CPU devices tests/conftest.py asks for).

Greedy (and seeded sampled) outputs equal the single-device engine's for batched generation with queueing,
chunked prefill, prefix-cache hits and speculative decoding (n-gram drafts accepted, write-on-accept with
all drafts right or all wrong); the cache and the prefix snapshots stay split over the devices across steps;
after warm-up a mixed workload compiles nothing; the compiled decode holds one all-reduce per block and
verify one all-gather (of the vocabulary) more."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from metrale_jax import sharding
from metrale_jax.errors import ConfigError
from metrale_jax.model import NemotronH
from metrale_jax.runtime import Engine, Executables, SpeculativeConfig
from tests.numpy_refs import rel_err
from tests.runtime.conftest import CFG, ENGINE, EOS, FAST_COMPILE, shared_prefix_prompt
from tests.runtime.test_engine import _Oracle

SPEC = SpeculativeConfig(num_draft=3)


@pytest.fixture(scope="module")
def mesh():
    return sharding.make_mesh(2)


@pytest.fixture(scope="module")
def sharded(mesh):
    """The session model's weights (same key) split over 2 devices."""
    return NemotronH.from_config(CFG, jax.random.key(3), dtype=jnp.float32, mesh=mesh)


@pytest.fixture(scope="module")
def tp_engine(sharded):
    """Engine(sharded model, **ENGINE, **overrides), all sharing one registry of executables."""
    exe = Executables(compiler_options=FAST_COMPILE)

    def make(**overrides):
        kw = {**ENGINE, "executables": exe, **overrides}
        return Engine(kw.pop("model", sharded), **kw)
    return make


def _tokens(gens):
    return [g.tokens for g in gens]


def _prompts(rng, lengths):
    return [rng.integers(0, EOS, n).tolist() for n in lengths]


def _split_as(x, *spec):
    return len(x.addressable_shards) == len(x.sharding.mesh.devices.flat) and \
        x.sharding.is_equivalent_to(NamedSharding(x.sharding.mesh, P(*spec)), x.ndim)


def _assert_cache_split(cache):
    assert _split_as(cache.ssm.ssm_state, None, None, "tp")         # by head
    assert _split_as(cache.ssm.conv_state, None, None, "tp")        # by (device-major) channel
    assert _split_as(cache.kv.k, None, None, None, "tp") and _split_as(cache.kv.v, None, None, None, "tp")
    assert _split_as(cache.seq_lens)


def _poison(cache, rng, pad):
    """Every slot's state noise and the padding slot's NaN (each array keeps its split), lengths random."""
    def one(a):
        host = (rng.standard_normal(a.shape) * 3).astype(a.dtype)
        host[:, pad] = np.nan
        return jax.device_put(host, a.sharding)

    ssm, kv = jax.tree.map(one, cache.ssm), jax.tree.map(one, cache.kv)
    seq_lens = jax.device_put(rng.integers(1, 60, cache.seq_lens.shape).astype(np.int32), cache.seq_lens.sharding)
    return dataclasses.replace(cache, ssm=ssm, kv=kv, seq_lens=seq_lens)


def test_batched_generation_with_queueing_and_chunked_prefill(make_engine, tp_engine, rng):
    """6 requests on 4 slots, prefill budgets 16 and 7 (chunks cut through the prompts), on a cache first
    filled with noise (NaN in the padding slot): the tokens equal the single-device engine's, and the cache is
    still split over the devices after every kind of step."""
    prompts = _prompts(rng, [5, 13, 21, 9, 3, 17])
    want = _tokens(make_engine(prefill_token_budget=16).generate(prompts, 10))
    assert sum(map(len, want)) > 20                                       # not a run of instant eos
    for budget in (16, 7):
        eng = tp_engine(prefill_token_budget=budget)
        assert eng.model.tp.size == 2
        eng.cache = _poison(eng.cache, rng, eng.pad)
        _assert_cache_split(eng.cache)
        rids = [eng.submit(p, 10) for p in prompts]
        done = eng.step()                                                 # a request may end at once (eos)
        assert set(eng.running) | set(done) == set(rids[:4]) and [r.rid for r in eng.queue] == rids[4:]
        eng.run()
        assert [eng.pop(r).tokens for r in rids] == want, budget
        _assert_cache_split(eng.cache)


def test_prefix_cache_hits_and_speculation(make_engine, tp_engine, rng):
    """Three prompts share 19 tokens: the first leaves a snapshot at the block cut 16 (split over the devices
    like the pool), the others restore it; n-gram drafts on repetitive prompts are accepted; the tokens and
    the accepted counts equal the single-device engine's."""
    base = rng.integers(0, EOS, 19).tolist()
    prompts = [base + rng.integers(0, EOS, n).tolist() for n in (4, 11, 2)]
    want = _tokens(make_engine(prefill_token_budget=64).generate(prompts, 12))
    eng = tp_engine(prefill_token_budget=16, prefix_cache_bytes=1 << 20)
    assert _tokens(eng.generate(prompts[:1], 12)) == want[:1]
    assert _tokens(eng.generate(prompts[1:], 12)) == want[1:]
    st = eng.prefix_cache.stats()
    assert st["hits"] >= 2 and st["hit_tokens"] >= 32 and st["inserts"] >= 1
    hit = eng.prefix_cache.lookup(prompts[0])
    assert hit.length == 16 and _split_as(hit.ssm.ssm, None, "tp") and _split_as(hit.ssm.conv, None, "tp")
    assert _split_as(hit.kv_blocks[0].k, None, None, "tp")
    _assert_cache_split(eng.cache)

    # repetitive prompts, no stop token: greedy continuations fall into loops the n-gram index predicts
    rep = [(rng.integers(0, EOS, n).tolist() * 8)[:20] for n in (3, 4, 5, 6)]
    one = make_engine(eos_ids=[], speculative=SPEC)
    want = _tokens(one.generate(rep, 40))
    spec = tp_engine(eos_ids=[], speculative=SPEC, prefill_token_budget=7, prefix_cache_bytes=1 << 20)
    assert _tokens(spec.generate(rep, 40)) == want
    c = spec.counters
    assert c["verify_rows"] > 0 and c["accepted_tokens"] > 0 and c["drafted_tokens"] > c["accepted_tokens"]
    assert c["accepted_tokens"] == one.counters["accepted_tokens"]
    _assert_cache_split(spec.cache)


def test_write_on_accept_with_all_drafts_right_and_all_wrong(make_engine, tp_engine, rng):
    prompts = _prompts(rng, [6, 15, 10])
    want = _tokens(make_engine().generate(prompts, 12))
    answers = {tuple(p): r for p, r in zip(prompts, want)}
    right = tp_engine(speculative=SPEC, drafter=_Oracle(answers))
    assert _tokens(right.generate(prompts, 12)) == want
    c = right.counters
    assert c["drafted_tokens"] > 0 and c["accepted_tokens"] == c["drafted_tokens"]
    wrong = tp_engine(speculative=SPEC, drafter=_Oracle(answers, bad=True))
    assert _tokens(wrong.generate(prompts, 12)) == want
    assert wrong.counters["drafted_tokens"] > 0 and wrong.counters["accepted_tokens"] == 0


def _mixed_workload(eng, rng_seed: int, steps: int):
    """Scoring, greedy and sampled requests on shared prefixes, fed 3 at a time; returns per-request results."""
    rng = np.random.default_rng(rng_seed)
    bases = _prompts(rng, [17, 24, 9])
    rids = []
    while eng.counters["steps"] < steps:
        while len(eng.queue) < 3:
            kind = rng.integers(0, 4)
            prompt = shared_prefix_prompt(rng, bases, len(rids))
            if kind == 0:
                rids.append(eng.submit_score(prompt + [1]))
            else:
                rids.append(eng.submit(prompt, int(rng.integers(1, 64 - len(prompt) + 1) % 14),
                                       temperature=float(kind == 1), top_p=0.8, seed=int(rng.integers(0, 100))))
        eng.step()
    eng.run()
    return [(r.tokens, r.logprobs) for r in map(eng.pop, rids)]


def test_no_compile_after_warmup_and_the_designed_collectives(make_engine, tp_engine, rng):
    """Prefix cache, speculation, seeded sampling, scoring and chunked prefill at once: after warm-up 60
    steps compile nothing, every request gets what the single-device engine gives it, and the compiled decode
    and verify hold only their designed collectives."""
    kw = dict(prefill_token_budget=24, prefix_cache_bytes=1 << 20, speculative=SPEC)
    eng = tp_engine(**kw)
    eng.warmup(sampling=True, score=True)
    compiles, stats = eng.compiles, eng.exe.stats()
    seed = int(rng.integers(1 << 30))
    got = _mixed_workload(eng, seed, 60)
    assert eng.compiles == compiles, (stats, eng.exe.stats())
    c = eng.counters
    assert c["finished"] > 10 and c["verify_rows"] > 0 and c["decode_rows"] > 0 and eng.prefix_cache.hits > 0
    _assert_cache_split(eng.cache)
    want = _mixed_workload(make_engine(**kw), seed, 60)
    assert len(got) == len(want) and any(lp for _, lp in got)
    for (tokens, lp), (want_tokens, want_lp) in zip(got, want):
        assert tokens == want_tokens
        assert len(lp) == len(want_lp) and (not lp or rel_err(np.array(lp), np.array(want_lp)) < 1e-4)

    blocks = CFG.num_hidden_layers
    (decode,) = eng.exe.compiled("decode")
    assert sharding.collective_counts(decode.as_text()) == {
        "all-reduce": blocks, "all-gather": 0, "all-to-all": 0, "collective-permute": 0, "reduce-scatter": 0}
    for verify in eng.exe.compiled("verify"):                            # greedy and sampling variants
        counts = sharding.collective_counts(verify.as_text())
        assert counts["all-reduce"] == blocks and counts["all-gather"] == 1 and sum(counts.values()) == blocks + 1


def test_mesh_argument(model, sharded, mesh, tp_engine, rng):
    """Engine(model, mesh=...) splits an unsharded model over the mesh: it runs the executables compiled for
    the sharded fixture (no compile) and gives its tokens; a mesh other than a sharded model's own raises."""
    prompts = _prompts(rng, [7, 12])
    want = _tokens(tp_engine().generate(prompts, 8))
    eng = tp_engine(model=model, mesh=mesh)
    before = eng.compiles
    assert eng.model is not model and eng.model.tp == sharded.tp and model.tp is None
    assert _tokens(eng.generate(prompts, 8)) == want and eng.compiles == before
    assert tp_engine(mesh=mesh).model is sharded
    with pytest.raises(ConfigError, match="mesh: the model is split over 2 device"):
        Engine(sharded, mesh=sharding.make_mesh(4), **ENGINE)


def test_four_devices(rng):
    """tp = 4 on a model whose heads, groups and kv heads 4 divides: batched generation with queueing and
    n-gram speculation gives the argmax of the single-device model's no-cache forward at every position."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    cfg = dataclasses.replace(CFG, mamba_num_heads=8, mamba_head_dim=4, n_groups=4, num_key_value_heads=4)
    prompts = [(rng.integers(0, EOS, n).tolist() * 8)[:m] for n, m in ((2, 9), (3, 20), (4, 14), (5, 17), (3, 6))]
    eng = Engine(NemotronH.from_config(cfg, jax.random.key(5), dtype=jnp.float32, mesh=sharding.make_mesh(4)),
                 **dict(ENGINE, max_len=48, token_buckets=(16,), prefill_token_budget=16, speculative=SPEC,
                        eos_ids=[], executables=Executables(compiler_options=FAST_COMPILE)))
    gens = _tokens(eng.generate(prompts, 24))
    assert eng.counters["accepted_tokens"] > 0
    _assert_cache_split(eng.cache)
    assert len(eng.cache.ssm.ssm_state.addressable_shards) == 4
    one = NemotronH.from_config(cfg, jax.random.key(5), dtype=jnp.float32)
    ids = np.array([p + g[:-1] + [0] * (44 - len(p) - len(g)) for p, g in zip(prompts, gens)], np.int32)
    want = np.argmax(np.asarray(one.forward(ids)), -1)
    for b, (p, g) in enumerate(zip(prompts, gens)):
        assert len(g) == 24 and g == want[b, len(p) - 1:len(p) + 23].tolist()
