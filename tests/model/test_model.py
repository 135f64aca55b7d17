"""NemotronH on a tiny random config with every block kind: forward against float64 numpy, and the
entry points against forward (prefill, chunked prefill, decode, mixed batches, generate, score)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.config import ModelLevers
from tests.tiny_models import ALL_KINDS
from metrale_jax.errors import ConfigError, ShapeError, SlotError
from metrale_jax.layers.capabilities import combine_capabilities
from metrale_jax.model import _IMPLS, _JITTED, TRACE_COUNTS, NemotronH
from metrale_jax.runtime.sampling import sample_tokens
from tests import numpy_refs_model as ref
from tests.numpy_refs import rel_err

CFG = ALL_KINDS
V = CFG.vocab_size
TOL = 1e-4


@pytest.fixture(scope="module")
def model():
    return NemotronH.from_config(CFG, jax.random.key(7), dtype=jnp.float32)


@pytest.fixture(scope="module")
def ids16():
    return np.random.default_rng(11).integers(0, V, (3, 16)).astype(np.int32)


@pytest.fixture(scope="module")
def full16(model, ids16):
    return np.asarray(model.forward(ids16))


def _close(got, want, tol=TOL):
    err = rel_err(got, want)
    assert err <= tol, f"rel err {err:.3g} > {tol}"


def test_forward_matches_float64_numpy(model, ids16, full16):
    """Every block kind, MoE with group limits and latents, sequences longer than two SSD chunks."""
    assert full16.shape == (3, 16, V) and full16.dtype == np.float32
    t = model.state_dict()
    for b in range(3):
        _close(full16[b], ref.model_forward(t, CFG, ids16[b]), 1e-5)


def test_prefill_mixed_lengths_then_decode_equals_forward(model, ids16, full16):
    """Right-padded rows of lengths 9 / 4 / 6, then 7 decode steps with every row at its own position."""
    lens = np.array([9, 4, 6])
    padded = np.where(np.arange(9)[None] < lens[:, None], ids16[:, :9], 0)
    cache = model.new_cache(3, 16)
    slots = np.array([2, 0, 1])
    logits, cache = model.prefill(cache, slots, padded, lens, all_logits=True)
    logits = np.asarray(logits)
    for b in range(3):
        _close(logits[b, :lens[b]], full16[b, :lens[b]])
    np.testing.assert_array_equal(np.asarray(cache.seq_lens), [4, 6, 9, 0])
    for s in range(7):
        pos = lens + s
        step, cache = model.decode(cache, slots, ids16[np.arange(3), pos])
        _close(np.asarray(step), full16[np.arange(3), pos])
    np.testing.assert_array_equal(np.asarray(cache.seq_lens), [11, 13, 16, 0])


def test_a_sequence_gets_the_same_alone_as_in_a_batch(model, ids16):
    lens = np.array([9, 4, 6])
    padded = np.where(np.arange(9)[None] < lens[:, None], ids16[:, :9], 0)
    batch, cache = model.prefill(model.new_cache(3, 16), [0, 1, 2], padded, lens)
    nxt = ids16[np.arange(3), lens]
    batch_step, _ = model.decode(cache, [0, 1, 2], nxt)
    for b in (1, 2):
        alone, c1 = model.prefill(model.new_cache(1, 16), [0], padded[b:b + 1], lens[b:b + 1])
        np.testing.assert_allclose(np.asarray(alone)[0], np.asarray(batch)[b], rtol=1e-5, atol=1e-5)
        step, _ = model.decode(c1, [0], nxt[b:b + 1])
        np.testing.assert_allclose(np.asarray(step)[0], np.asarray(batch_step)[b], rtol=1e-5, atol=1e-5)


def test_a_decoded_row_alone_has_the_bits_it_has_beside_another(rng):
    """On the built-in model (bf16): one sequence decoded alone and the same state decoded beside another live
    sequence give the same logits bit for bit (a lone row is not compiled as a batch of one)."""
    from metrale_jax.builtin import load_builtin

    m = load_builtin()
    ids = rng.integers(3, m.config.vocab_size, (2, 12)).astype(np.int32)
    _, cache = m.prefill(m.new_cache(2, 32), [0, 1], ids)
    alone, _ = m.decode(jax.tree.map(jnp.copy, cache), [0], ids[:1, 5])
    pair, _ = m.decode(cache, [0, 1], ids[:, 5])
    np.testing.assert_array_equal(np.asarray(alone)[0], np.asarray(pair)[0])


@pytest.mark.parametrize("kernels", ["reference", "interpret"])
def test_a_decode_leaves_the_padding_slot_as_it_was(model, ids16, rng, kernels):
    """The padding row beside a lone sequence is padding: the Mamba layers neither read nor write its conv and SSM
    states (random here: a write would change them), and the live row's logits are those of the same decode with
    the padding slot zeroed."""
    m = model if kernels == "reference" else NemotronH.from_config(CFG, jax.random.key(7), dtype=jnp.float32,
                                                                 levers=ModelLevers(kernels=kernels))
    cache = m.new_cache(2, 16)
    _, cache = m.prefill(cache, [0], ids16[:1, :5])
    pad = cache.padding_slot
    noise = lambda a: a.at[:, pad].set(jnp.asarray(rng.standard_normal(a[:, pad].shape), a.dtype))
    noisy = dataclasses.replace(jax.tree.map(jnp.copy, cache),          # decode donates its cache
                                ssm=type(cache.ssm)(noise(cache.ssm.conv_state), noise(cache.ssm.ssm_state)))
    before = jax.tree.map(np.asarray, noisy.ssm)
    got, after = m.decode(noisy, [0], ids16[:1, 5])
    want, _ = m.decode(cache, [0], ids16[:1, 5])
    for b, a in zip(jax.tree.leaves(before), jax.tree.leaves(after.ssm)):
        np.testing.assert_array_equal(np.asarray(a)[:, pad], b[:, pad])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_chunked_prefill_continues_from_the_cache(model, ids16, full16):
    """5 tokens, then 6 more continuing the slot (the other row starts fresh in the same call)."""
    cache = model.new_cache(2, 16)
    first, cache = model.prefill(cache, [1], ids16[:1, :5], all_logits=True)
    cache = cache.zero_slot(0)
    rest = np.stack([ids16[0, 5:11], ids16[1, :6]])
    with pytest.raises(SlotError, match="max_len"):
        model.prefill(cache, [1, 0], np.concatenate([rest, rest, rest], 1), continue_from_cache=True)
    out, cache = model.prefill(cache, [1, 0], rest, continue_from_cache=True, all_logits=True)
    _close(np.asarray(first)[0], full16[0, :5])
    _close(np.asarray(out)[0], full16[0, 5:11])
    _close(np.asarray(out)[1], full16[1, :6])      # slot 0 had length 0: it started fresh
    np.testing.assert_array_equal(np.asarray(cache.seq_lens)[:2], [6, 11])


def test_decode_compiles_once_over_20_steps(model, ids16):
    """The first step may compile (once per bucket); the next 19 reuse the executable."""
    cache = model.new_cache(3, 32)
    _, cache = model.prefill(cache, [0, 1, 2], ids16[:, :4])
    start = TRACE_COUNTS["decode"]
    tok = ids16[:, 4]
    for step in range(20):
        logits, cache = model.decode(cache, [0, 1, 2], tok)
        tok = np.asarray(jnp.argmax(logits, -1))
        if step == 0:
            warm = TRACE_COUNTS["decode"]
            assert warm - start <= 1
    assert TRACE_COUNTS["decode"] == warm
    np.testing.assert_array_equal(np.asarray(cache.seq_lens), [24, 24, 24, 0])


def test_generate_greedy_equals_argmax_of_forward(model, ids16):
    prompts = [ids16[0, :7].tolist(), ids16[1, :3].tolist(), ids16[2, :5].tolist()]
    outs = model.generate(prompts, max_new_tokens=6)
    eos = model.eos_ids()
    seqs = np.zeros((3, 16), np.int32)                 # causal: padding after a row changes nothing before it
    for b, (p, g) in enumerate(zip(prompts, outs)):
        seqs[b, :len(p) + len(g.tokens)] = p + g.tokens
    logits = np.asarray(model.forward(seqs))
    for b, (p, g) in enumerate(zip(prompts, outs)):
        want = np.argmax(logits[b, len(p) - 1:], -1)
        assert g.tokens == want[:len(g.tokens)].tolist()
        if g.finish_reason == "eos":
            assert int(want[len(g.tokens)]) in eos and len(g.tokens) < 6
        else:
            assert g.finish_reason == "length" and len(g.tokens) == 6
        assert g.text is None


def test_sampling(model, ids16):
    prompts = [ids16[0, :4].tolist(), ids16[1, :6].tolist(), ids16[2, :2].tolist()]
    greedy = model.generate(prompts, 5)
    tiny_p = model.generate(prompts, 5, temperature=1.0, top_p=1e-6, seed=3)   # only the top token survives
    assert [g.tokens for g in tiny_p] == [g.tokens for g in greedy]
    a = model.generate(prompts, 5, temperature=1.5, seed=1)
    b = model.generate(prompts, 5, temperature=1.5, seed=1)
    c = model.generate(prompts, 5, temperature=1.5, seed=2)
    assert [g.tokens for g in a] == [g.tokens for g in b]
    assert [g.tokens for g in a] != [g.tokens for g in c] or [g.tokens for g in a] != [g.tokens for g in greedy]
    assert all(0 <= t < V for g in a for t in g.tokens)


def test_top_p_keeps_the_smallest_set_reaching_p():
    """probs (0.4, 0.3, 0.2, 0.1), top_p 0.5: only tokens 0 and 1 are drawn, in the ratio 4 : 3."""
    logits = jnp.tile(jnp.log(jnp.array([0.4, 0.3, 0.2, 0.1])), (4000, 1))
    n = logits.shape[0]
    draws = np.asarray(sample_tokens(logits, jnp.ones(n), jnp.full(n, 0.5), jnp.arange(n), jnp.zeros(n, jnp.int32),
                                     sampling=True))
    assert set(draws.tolist()) == {0, 1}
    assert abs((draws == 0).mean() - 4 / 7) < 0.03


def test_score_is_log_softmax_of_forward_and_reuses_its_bucket(model, ids16, full16):
    lens = np.array([16, 9, 12])
    lp = np.asarray(model.score(ids16, lens))
    assert lp.shape == (3, 15)
    want = np.take_along_axis(ref.log_softmax(full16[:, :-1]), ids16[:, 1:, None], -1)[..., 0]
    valid = np.arange(1, 16)[None] < lens[:, None]
    _close(lp[valid], want[valid])
    assert (lp[~valid] == 0).all()
    before = TRACE_COUNTS["score"]
    for B, T in ((3, 11), (4, 16), (3, 9)):       # all in the (4, 16) bucket
        again = np.asarray(model.score(ids16[:B, :T] if B <= 3 else np.concatenate([ids16, ids16[:1]])[:, :T]))
        assert again.shape == (B, T - 1)
        np.testing.assert_allclose(again[:min(B, 3), :8], want[:min(B, 3), :8], rtol=1e-4, atol=1e-4)
    assert TRACE_COUNTS["score"] == before


def test_capabilities_and_eager_levers(model):
    caps = model.capabilities
    assert not caps.decode_graph_veto and not caps.multi_seq_per_sequence and caps.replay_tail_capture
    assert caps == combine_capabilities(model.layers)
    eager = NemotronH(CFG, model.state_dict(), dtype=jnp.float32, levers=ModelLevers(graphs=False))
    assert eager._step("decode") is _IMPLS["decode"] and model._step("decode") is _JITTED["decode"]


def test_repr_shows_the_config_once_and_every_block(model):
    """A notebook's view of the model: its weights and blocks, the ModelConfig once (not inside every block)."""
    r = repr(model)
    assert r.count("ModelConfig(") == 1
    kinds = {"M": "NemotronMamba2Layer(", "*": "NemotronAttentionLayer(", "-": "NemotronMLPLayer(",
             "E": "NemotronMoELayer("}
    for kind, cls in kinds.items():
        assert r.count(cls) == model.config.hybrid_override_pattern.count(kind)
    assert all(layer.config is model.config for layer in model.layers)


def test_bad_arguments_raise_typed_errors(model, ids16):
    cache = model.new_cache(2, 8)
    with pytest.raises(ShapeError, match="token ids must lie"):
        model.prefill(cache, [0], np.array([[1, V]]))
    with pytest.raises(ShapeError, match="ids"):
        model.forward(np.ones((4,), np.int32))
    with pytest.raises(ShapeError, match="lengths"):
        model.prefill(cache, [0], ids16[:1, :4], [5])
    with pytest.raises(SlotError, match="twice"):
        model.prefill(cache, [1, 1], ids16[:2, :4])
    with pytest.raises(SlotError, match="slots"):
        model.decode(cache, [3], ids16[:1, 0])
    with pytest.raises(SlotError, match="max_len"):
        model.prefill(cache, [0], ids16[:1, :9])
    with pytest.raises(ConfigError, match="tokenizer"):
        model.generate(["hello"], 3)
    with pytest.raises(ShapeError, match="empty"):
        model.generate([[1, 2], []], 3)
    with pytest.raises(ConfigError, match="top_p"):
        model.generate([[1, 2]], 3, top_p=0.0)
    with pytest.raises(ShapeError, match="at least 2"):
        model.score(ids16[:, :1])
