"""Data parallelism on the host CPU devices tests/conftest.py asks for: the built-in model on a (dp, tp) mesh gives
the single-device logits, log-probs and greedy tokens (generation through the replicas: tests/runtime/
test_engine_dp.py), each replica computes its rows exactly as any other replica
does, a replica is the same weights on its row of devices, and a checkpoint share is read once per process."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from metrale_jax import data_parallel, sharding
from metrale_jax.builtin import builtin_model_dir
from metrale_jax.errors import ConfigError
from metrale_jax.model import NemotronH
from tests.numpy_refs import rel_err
from tests.sharding.test_tensor_parallel import CFG, TOL

B, T = 3, 24          # rows, tokens per row


def _mesh(tp, dp):
    if tp * dp > len(jax.devices()):
        pytest.skip(f"needs {tp * dp} devices, {len(jax.devices())} available")
    return sharding.make_mesh(tp, dp=dp)


@pytest.fixture(scope="module")
def builtin():
    """(tp, dp) -> the built-in model in float32 on that mesh ((1, 1): no mesh), loaded once."""
    cache = {}

    def get(tp, dp):
        if (tp, dp) not in cache:
            mesh = None if tp * dp == 1 else _mesh(tp, dp)
            cache[tp, dp] = NemotronH.from_pretrained(builtin_model_dir(), dtype=jnp.float32, progress=False,
                                                      mesh=mesh)
        return cache[tp, dp]
    return get


def _close(got, want, tol=TOL):
    err = rel_err(np.asarray(got), np.asarray(want))
    assert err <= tol, f"rel err {err:.3g} > {tol}"


def _check_against_one_device(builtin, rng, tp, dp):
    """forward and score (log-probs and greedy flags) on (tp, dp) match (1, 1), the greedy tokens (the logits'
    argmax) are the same, and the rows two replicas compute alike are the same bits (the batch [a, b, c, a, b, c]
    puts a, b, c on each replica)."""
    one, many = builtin(1, 1), builtin(tp, dp)
    assert many.tp.dp == dp and many.tp.size == tp
    ids = rng.integers(3, one.config.vocab_size, (B, T)).astype(np.int32)
    lens = np.array([T, rng.integers(2, T), rng.integers(2, T)])
    twice, lens2 = np.concatenate([ids, ids]), np.concatenate([lens, lens])
    logits, want = np.asarray(many.forward(twice)), np.asarray(one.forward(ids))
    _close(logits[:B], want)
    np.testing.assert_array_equal(logits[:B].argmax(-1), want.argmax(-1))
    np.testing.assert_array_equal(logits[:B], logits[B:])
    lp, greedy = (np.asarray(x) for x in many.score(twice, lens2, greedy=True))
    want_lp, want_greedy = one.score(ids, lens, greedy=True)
    _close(lp[:B], want_lp)
    np.testing.assert_array_equal(greedy[:B], np.asarray(want_greedy))
    np.testing.assert_array_equal(lp[:B], lp[B:])
    np.testing.assert_array_equal(greedy[:B], greedy[B:])


def test_dp2_tp1_matches_one_device(builtin, rng):
    _check_against_one_device(builtin, rng, 1, 2)


def test_dp2_tp2_matches_one_device(builtin, rng):
    _check_against_one_device(builtin, rng, 2, 2)


def test_prefill_and_decode_on_a_callers_cache_run_on_every_replica(builtin, rng):
    """prefill / decode on a cache the caller holds (model.new_cache: split over tp, one copy per replica) give the
    one-device logits: every replica runs the whole batch."""
    one, many = builtin(1, 1), builtin(1, 2)
    ids = rng.integers(3, one.config.vocab_size, (2, 10)).astype(np.int32)
    slots, lens = np.array([1, 0]), np.array([10, 6])
    out = []
    for m in (one, many):
        logits, cache = m.prefill(m.new_cache(2, 16), slots, ids, lens)
        step, cache = m.decode(cache, slots, ids[:, 3])
        out.append((np.asarray(logits), np.asarray(step), np.asarray(cache.seq_lens)))
    _close(out[1][0], out[0][0])
    _close(out[1][1], out[0][1])
    np.testing.assert_array_equal(out[1][2], out[0][2])


def test_a_replica_is_its_row_of_the_mesh(builtin, rng):
    """replica(model, i) holds the model's own device buffers of row i (no copy), on a tp-only mesh of those
    devices, and scores as the whole model does; a dp=1 mesh and an unknown replica are refused or reported."""
    model = builtin(1, 2)
    rows = model.tp.mesh.devices
    assert model.tp.mesh.axis_names == (sharding.DP_AXIS, sharding.TP_AXIS) and rows.shape == (2, 1)
    ids = rng.integers(3, model.config.vocab_size, (2, 16)).astype(np.int32)
    want = np.asarray(model.score(np.concatenate([ids, ids])))[:2]     # 2 rows on each replica
    for i in (0, 1):
        rep = data_parallel.replica(model, i)
        assert rep.tp.dp == 1 and list(rep.tp.mesh.devices.flat) == list(rows[i])
        w, rw = model.embeddings[...], rep.embeddings[...]
        mine = [s for s in w.addressable_shards if s.device == rows[i][0]]
        assert rw.addressable_shards[0].data.unsafe_buffer_pointer() == mine[0].data.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(rep.score(ids)), want)     # replica 1 alone
    assert data_parallel.local_replicas(model) == [0, 1]
    with pytest.raises(ConfigError, match="replica in \\[0, 2\\)"):
        data_parallel.replica(model, 2)
    with pytest.raises(ConfigError, match="has no replicas"):
        data_parallel.replica(builtin(1, 1), 0)


def test_mesh_shapes_and_the_axes_a_model_accepts():
    mesh = _mesh(2, 2)
    assert mesh.axis_names == ("dp", "tp") and mesh.devices.shape == (2, 2)
    assert list(mesh.devices.flat) == jax.devices()[:4]                 # replica i: devices [2i, 2i + 2)
    tp = sharding.tensor_parallel(mesh)
    assert (tp.size, tp.dp, tp.batch_spec(2)) == (2, 2, jax.sharding.PartitionSpec("dp", None))
    assert sharding.tensor_parallel(sharding.make_mesh(2)).batch_spec(2) == jax.sharding.PartitionSpec(None, None)
    with pytest.raises(ConfigError, match="tp \\* dp <= 4"):
        sharding.make_mesh(3, dp=2)
    with pytest.raises(ConfigError, match="dp: expected an integer >= 1"):
        sharding.make_mesh(1, dp=0)
    data = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("data", "tp"))
    with pytest.raises(ConfigError, match="data parallelism"):
        sharding.tensor_parallel(data)


class _Reads:
    """A host array that records every index read from it."""

    def __init__(self, arr):
        self.arr, self.reads = arr, []

    shape = property(lambda self: self.arr.shape)
    ndim = property(lambda self: self.arr.ndim)

    def __getitem__(self, index):
        self.reads.append(index)
        return self.arr[index]


def test_a_share_is_read_once_per_process(rng):
    """On a (dp=2, tp=2) mesh each of a split tensor's 2 shares is read once (not once per replica) and lands on
    both replicas; a replicated tensor is read once."""
    tp = sharding.tensor_parallel(_mesh(2, 2))
    down = rng.standard_normal((CFG.hidden_size, CFG.intermediate_size)).astype(np.float32)
    src = _Reads(down)
    name = "backbone.layers.3.mixer.down_proj.weight"                   # split by column
    placed = sharding.place(name, src, CFG, tp, jnp.float32)
    assert len(src.reads) == 2 and len(placed.addressable_shards) == 4
    np.testing.assert_array_equal(np.asarray(placed), down)
    emb = _Reads(rng.standard_normal((CFG.vocab_size, CFG.hidden_size)).astype(np.float32))
    placed = sharding.place("backbone.embeddings.weight", emb, CFG, tp, jnp.float32)
    assert len(emb.reads) == 1
    np.testing.assert_array_equal(np.asarray(placed), emb.arr)
