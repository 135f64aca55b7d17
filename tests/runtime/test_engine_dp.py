"""The engine on a (dp=2, tp=2) mesh of the 4 host CPU devices tests/conftest.py asks for: Engine(model) gives a
DataParallelEngine whose replicas each serve their requests exactly as an Engine on that replica alone does (tokens
and log-probs bit for bit), admitted to the least-loaded replica; the tokens equal the single-device engine's, and
model.generate / Engine.score split their batch over the replicas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax import data_parallel, sharding
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


@pytest.fixture(scope="module")
def dp_exe():
    return Executables(compiler_options=FAST_COMPILE)


def _prompts(rng, lengths):
    return [rng.integers(0, EOS, n).tolist() for n in lengths]


def test_replicas_serve_their_requests_as_one_replica_does(make_engine, dp_model, dp_exe, rng):
    """6 requests (4 greedy, 2 seeded-sampled with log-probs) on replicas of 2 slots each (so requests queue):
    the least-loaded replica takes each in turn; every request's tokens and log-probs are the bits an Engine on
    its replica alone gives the same requests, and the greedy ones the single-device engine's tokens."""
    kw = {**ENGINE, "max_slots": 2, "batch_buckets": (2,), "executables": dp_exe}
    eng = Engine(dp_model, **kw)
    assert isinstance(eng, DataParallelEngine) and eng.replica_ids == [0, 1]
    assert [e.model.tp.mesh.devices.tolist() for e in eng.engines] == dp_model.tp.mesh.devices.tolist()
    prompts = _prompts(rng, [5, 13, 21, 9, 3, 17])
    params = [dict(temperature=0.0)] * 4 + [dict(temperature=0.9, top_p=0.9, seed=int(rng.integers(1 << 20)),
                                                 logprobs=0)] * 2
    rids = [eng.submit(p, 10, **sp) for p, sp in zip(prompts, params)]
    assert [eng.requests[r].replica for r in rids] == [0, 1, 0, 1, 0, 1]     # least loaded, ties to the lowest
    eng.run()
    got = [eng.pop(r) for r in rids]
    assert [r.replica for r in got] == [0, 1, 0, 1, 0, 1] and [r.rid for r in got] == rids
    for k in (0, 1):
        alone = Engine(data_parallel.replica(dp_model, k), **kw)
        mine = [i for i in range(6) if i % 2 == k]
        ids = [alone.submit(prompts[i], 10, **params[i]) for i in mine]
        alone.run()
        for i, rid in zip(mine, ids):
            r = alone.pop(rid)
            assert (r.tokens, r.logprobs) == (got[i].tokens, got[i].logprobs), i
    want = [g.tokens for g in make_engine().generate(prompts[:4], 10)]
    assert [r.tokens for r in got[:4]] == want
    assert sum(map(len, want)) > 12 and all(len(r.logprobs) == len(r.tokens) for r in got[4:])


def test_generate_and_score_split_over_the_replicas(make_engine, dp_model, dp_exe, rng):
    """model.generate on a dp model (an engine per call, each replica with its share) and Engine.score give the
    single-device results; the engine's counters and stats cover both replicas."""
    prompts = _prompts(rng, [7, 12, 4])
    want = [g.tokens for g in make_engine().generate(prompts, 8)]
    assert [g.tokens for g in dp_model.generate(prompts, max_new_tokens=8)] == want
    eng = Engine(dp_model, **{**ENGINE, "max_slots": 2, "batch_buckets": (2,), "executables": dp_exe})
    ids = rng.integers(0, EOS, (3, 14)).astype(np.int32)
    lens = np.array([14, 9, 5])
    got = eng.score(ids, lens)
    ref = make_engine().score(ids, lens)
    assert rel_err(got, ref) < 1e-5 and (got[2, 4:] == 0).all()
    st = eng.stats()
    assert sorted(st["replicas"]) == [0, 1] and st["counters"]["finished"] == 3
    assert all(s["counters"]["finished"] >= 1 for s in st["replicas"].values())
