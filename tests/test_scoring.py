"""scoring.windows (every target once, rows within max_length, the promised context) and score_targets against a
float64 log-softmax of model.forward, with the greedy flags against its argmax."""

import numpy as np
import pytest

from metrale_jax.builtin import load_builtin
from metrale_jax.errors import ConfigError, ShapeError
from metrale_jax.scoring import Targets, score_targets, windows
from tests import numpy_refs_model as ref


@pytest.fixture(scope="module")
def model():
    return load_builtin(dtype=np.float32)


def test_windows_score_each_target_once_within_max_length_and_with_the_promised_context(rng):
    for _ in range(300):
        L = int(rng.integers(2, 40))
        S = int(rng.integers(1, L))
        n = int(rng.integers(2, 200))
        first = int(rng.integers(1, n))
        rows = windows(n, first, L, S)
        covered = [t for start, end, a in rows for t in range(a, end)]
        assert covered == list(range(first, n))                                   # once each, in order
        for start, end, a in rows:
            assert 0 <= start < a < end <= n and end - start <= L
            assert a - start >= min(a, L - S)                                       # context before the group
        if n <= L:
            assert rows == [(0, n, first)]
    with pytest.raises(ConfigError, match="stride"):
        windows(10, 1, 8, 8)
    with pytest.raises(ShapeError, match="first"):
        windows(10, 10, 8, 4)


def test_score_targets_equals_log_softmax_of_forward_per_window(model, rng):
    """Three sequences (one short, one long with a context, one long): each target's log-prob equals the float64
    log-softmax of model.forward over the row that scores it; greedy is the forward's argmax."""
    V = model.config.vocab_size
    seqs = [Targets(rng.integers(3, V, 9).tolist(), 1), Targets(rng.integers(3, V, 70).tolist(), 31),
            Targets(rng.integers(3, V, 55).tolist(), 1)]
    L, S = 24, 10
    got = score_targets(model, seqs, max_length=L, stride=S, batch_size=3)
    # every window row of every sequence in one forward, right-padded to L (causal: the padding reaches no earlier
    # logit), one compile instead of one per row length
    rows_of = [windows(len(t.ids), t.first, L, S) for t in seqs]
    padded = np.zeros((sum(map(len, rows_of)), L), np.int32)
    for i, (t, (start, end, _)) in enumerate((t, r) for t, rows in zip(seqs, rows_of) for r in rows):
        padded[i, :end - start] = t.ids[start:end]
    all_logits = iter(np.asarray(model.forward(padded)))
    for t, s, rows in zip(seqs, got, rows_of):
        assert s.windows == len(rows) and len(s.logprobs) == len(t.ids) - t.first
        want_lp, want_greedy = [], []
        for start, end, a in rows:
            logits = next(all_logits)[:end - start]
            lp = ref.log_softmax(logits)
            for pos in range(a, end):
                want_lp.append(lp[pos - start - 1, t.ids[pos]])
                want_greedy.append(np.argmax(logits[pos - start - 1]) == t.ids[pos])
        np.testing.assert_allclose(s.logprobs, want_lp, atol=2e-5)
        np.testing.assert_array_equal(s.greedy, want_greedy)
    with pytest.raises(ConfigError, match="max_length"):
        score_targets(model, seqs, max_length=model.config.max_position_embeddings + 1)


@pytest.mark.parametrize("field, kwargs", [
    ("batch_size", dict(batch_size=0)), ("batch_size", dict(batch_size=-1)), ("batch_size", dict(batch_size=2.5)),
    ("max_length", dict(max_length="64")), ("max_length", dict(max_length=24.9)), ("stride", dict(stride=2.5)),
    ("stride", dict(max_length=24, stride=24)),
])
def test_score_targets_refuses_bad_sizes_by_name_before_scoring(model, field, kwargs):
    """batch_size 0 was range()'s ValueError, -1 a TypeError after scoring nothing; floats were truncated."""
    with pytest.raises(ConfigError) as e:
        score_targets(model, [Targets([5, 6, 7])], **kwargs)
    assert e.value.field == field, str(e.value)
