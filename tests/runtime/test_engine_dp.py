"""The engine on a (dp=2, tp=2) mesh of the 4 host CPU devices tests/conftest.py asks for: Engine(model) gives a
DataParallelEngine whose replicas each serve their requests exactly as an Engine on that replica alone does (tokens
and log-probs bit for bit), admitted to the least-loaded replica; the tokens and scores equal the single-device
engine's, and model.generate splits its prompts over the replicas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax import data_parallel, sharding
from metrale_jax.errors import ConfigError, RequestError, ShapeError
from metrale_jax.model import NemotronH
from metrale_jax.runtime import DataParallelEngine, Engine, Executables
from tests.numpy_refs import rel_err
from tests.runtime.conftest import CFG, ENGINE, EOS, FAST_COMPILE


@pytest.fixture(scope="module")
def dp_model():
    """The session model's weights (same key) as 2 replicas, each split over 2 devices."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    return NemotronH.from_config(CFG, jax.random.key(3), dtype=jnp.float32, mesh=sharding.make_mesh(2, dp=2))


def _prompts(rng, lengths):
    return [rng.integers(0, EOS, n).tolist() for n in lengths]


def _submit(eng, prompt, kind):
    return eng.submit_score(prompt) if kind == "score" else eng.submit(prompt, 10, **kind)


def test_replicas_serve_their_requests_as_one_replica_does(make_engine, dp_model, rng):
    """8 requests (4 greedy, 2 seeded-sampled with log-probs, 2 scoring) on replicas of 2 slots each (so requests
    queue): the least-loaded replica takes each in turn; every request's tokens and log-probs are the bits an Engine
    on its replica alone gives the same requests; the greedy tokens and the scores are the single-device engine's."""
    kw = {**ENGINE, "max_slots": 2, "batch_buckets": (2,), "executables": Executables(compiler_options=FAST_COMPILE)}
    eng = Engine(dp_model, **kw)
    assert isinstance(eng, DataParallelEngine) and eng.replica_ids == [0, 1]
    assert [e.model.tp.mesh.devices.tolist() for e in eng.engines] == dp_model.tp.mesh.devices.tolist()
    prompts = _prompts(rng, [5, 13, 21, 9, 3, 17, 11, 6])
    kinds = [dict(temperature=0.0)] * 4 + [dict(temperature=0.9, top_p=0.9, seed=int(rng.integers(1 << 20)),
                                                logprobs=0)] * 2 + ["score"] * 2
    rids = [_submit(eng, p, k) for p, k in zip(prompts, kinds)]
    assert [eng.requests[r].replica for r in rids] == [0, 1] * 4      # least loaded, ties to the lowest
    with pytest.raises(RequestError, match=rf"rid: request {rids[-1]} is not finished yet"):   # this engine's id
        eng.pop(rids[-1])
    eng.run()
    got = [eng.pop(r) for r in rids]
    with pytest.raises(RequestError, match=rf"rid: request {rids[0]} is unknown"):
        eng.pop(rids[0])
    assert [r.replica for r in got] == [0, 1] * 4 and [r.rid for r in got] == rids
    st = eng.stats()
    assert st["counters"]["finished"] == 8 and [s["counters"]["finished"] for s in st["replicas"].values()] == [4, 4]
    for k in (0, 1):
        alone = Engine(data_parallel.replica(dp_model, k), **kw)
        mine = [i for i in range(8) if i % 2 == k]
        ids = [_submit(alone, prompts[i], kinds[i]) for i in mine]
        alone.run()
        for i, rid in zip(mine, ids):
            r = alone.pop(rid)
            assert (r.tokens, r.logprobs) == (got[i].tokens, got[i].logprobs), i
    one = make_engine()
    want = [g.tokens for g in one.generate(prompts[:4], 10)]
    assert [r.tokens for r in got[:4]] == want and sum(map(len, want)) > 12
    assert all(len(r.logprobs) == len(r.tokens) for r in got[4:6])
    for i in (6, 7):
        ref = one.score(np.array([prompts[i]]))[0]
        assert len(got[i].logprobs) == len(prompts[i]) - 1 and rel_err(np.array(got[i].logprobs), ref) < 1e-5


def test_model_generate_splits_its_prompts_over_the_replicas(make_engine, dp_model, rng):
    """model.generate on a dp model (an engine per call, each replica with its share of the prompts) gives the
    single-device tokens."""
    prompts = _prompts(rng, [7, 12, 4])
    want = [g.tokens for g in make_engine(eos_ids=sorted(dp_model.eos_ids())).generate(prompts, 8)]  # generate's eos
    assert [g.tokens for g in dp_model.generate(prompts, max_new_tokens=8)] == want


def test_a_refused_request_queues_nothing_on_any_replica(dp_model):
    """The replicas' checks run before any request is queued (generate's batch whole), and on_token is checked
    before the engine wraps it in a callable of its own."""
    eng = Engine(dp_model, **ENGINE)
    with pytest.raises(ShapeError, match=r"prompt: 60 tokens \+ max_new_tokens 10 exceed the engine's max_len 64"):
        eng.generate([[1, 2, 3], list(range(60))], 10)
    with pytest.raises(ConfigError, match="on_token: expected a callable on_token"):
        eng.submit([1, 2], 2, on_token=5)
    assert not eng.has_work and not eng.requests
