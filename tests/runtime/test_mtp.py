"""MTP head (layers/mtp.py) and MTP drafting in the engine, on the tiny every-kind model with one MTP step "*E".

The MTP step is checked against a float64 numpy reference written here (over the shared block references);
greedy outputs are identical with MTP speculation on and off, alone and in a batch; the drafts the engine
proposes are the reference's argmax drafts for the sequence at that point (so the MTP keys/values and the
carried hidden state follow write-on-accept through chunked prefill and partly accepted verifies); unused
slots are never written; with the prefix cache, a restored snapshot puts back the MTP state a no-cache run has
at the cut bit for bit (so drafts and tokens are those of the no-cache run) and its bytes count in the LRU;
after warm-up a mixed MTP workload with prefix hits compiles nothing. The random weights are nudged
towards one token in both the main model and the MTP head so that some drafts, not all, are accepted.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.errors import ConfigError
from metrale_jax.layers.mtp import MtpCache
from metrale_jax.model import NemotronH, random_tensors
from metrale_jax.runtime import Engine, Executables, SpeculativeConfig
from metrale_jax.runtime.prefix_cache import tree_nbytes
from tests import numpy_refs_model as ref
from tests.numpy_refs import rel_err
from tests.runtime.conftest import CFG, EOS, FAST_COMPILE

MTP_CFG = dataclasses.replace(CFG, num_nextn_predict_layers=1)
FAVOURED = 7
ENGINE = dict(max_slots=4, max_len=64, batch_buckets=(4,), token_buckets=(8, 64), eos_ids=[EOS])
SPEC = SpeculativeConfig(method="mtp", num_draft=3)


@pytest.fixture(scope="module")
def tensors():
    """Random weights (host float32) with embedding column 0 raised, which lm_head row FAVOURED and the MTP's
    eh_proj row 0 read: the main model often predicts FAVOURED and the MTP head often drafts it."""
    t = {k: np.array(v) for k, v in random_tensors(MTP_CFG, jax.random.key(11), jnp.float32).items()}
    t["backbone.embeddings.weight"][:, 0] += 3.0
    t["lm_head.weight"][FAVOURED, 0] += 1.0
    eh = t["mtp.layers.0.eh_proj.weight"]
    eh[0] *= 0.2
    eh[0, 0] += 1.5
    return t


@pytest.fixture(scope="module")
def mtp_model(tensors):
    return NemotronH(MTP_CFG, tensors, dtype=jnp.float32)


@pytest.fixture(scope="module")
def engine(mtp_model):
    """Engine(mtp_model, **ENGINE, **overrides), all sharing one registry of executables."""
    exe = Executables(compiler_options=FAST_COMPILE)
    return lambda **kw: Engine(mtp_model, **{**ENGINE, "executables": exe, **kw})


# ---- float64 references ------------------------------------------------------------------------------
def ref_hidden(t, cfg, ids):
    """The main model's final-normed hidden states [T, D] of one sequence (float64)."""
    h = ref.f64(t["backbone.embeddings.weight"])[np.asarray(ids)]
    eps = cfg.layer_norm_epsilon
    for i, kind in enumerate(cfg.hybrid_override_pattern):
        p = f"backbone.layers.{i}.mixer."
        x = ref.rmsnorm(h, t[f"backbone.layers.{i}.norm.weight"], eps)
        if kind == "M":
            h = h + ref.mamba_mixer(x, t, p, cfg)
        elif kind == "*":
            h = h + _attention(x, t, p, cfg)
        elif kind == "-":
            h = h + ref.mlp(x, t[p + "up_proj.weight"], t[p + "down_proj.weight"])
        else:
            h = h + ref.moe(x, t, p, cfg)
    return ref.rmsnorm(h, t["backbone.norm_f.weight"], eps)


def _attention(x, t, p, cfg):
    return ref.attention(x, t[p + "q_proj.weight"], t[p + "k_proj.weight"], t[p + "v_proj.weight"],
                         t[p + "o_proj.weight"], heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                         head_dim=cfg.head_dim)


def ref_mtp(t, cfg, emb, h):
    """The MTP step over pairs at positions 0.. of one sequence: emb (embedding of tok_{t+1}), h (h_t) [T, D]
    -> final-normed [T, D]: x = eh_proj [enorm(emb), hnorm(h)], then each block x + mixer(norm(x))."""
    eps = cfg.layer_norm_epsilon
    x = ref.lin(np.concatenate([ref.rmsnorm(emb, t["mtp.layers.0.enorm.weight"], eps),
                                ref.rmsnorm(h, t["mtp.layers.0.hnorm.weight"], eps)], axis=-1),
                t["mtp.layers.0.eh_proj.weight"])
    for j, kind in enumerate(cfg.mtp_hybrid_override_pattern):
        p = f"mtp.layers.{j}.mixer."
        y = ref.rmsnorm(x, t[f"mtp.layers.{j}.norm.weight"], eps)
        x = x + {"*": lambda: _attention(y, t, p, cfg), "E": lambda: ref.moe(y, t, p, cfg),
                 "-": lambda: ref.mlp(y, t[p + "up_proj.weight"], t[p + "down_proj.weight"])}[kind]()
    last = len(cfg.mtp_hybrid_override_pattern) - 1
    return ref.rmsnorm(x, t[f"mtp.layers.{last}.final_layernorm.weight"], eps)


def ref_draft_logits(t, cfg, context, drafts):
    """Logits [len(drafts), V] of each drafting step for a sequence whose tokens are `context` (the last one
    pending, not fed to the main model yet), the earlier drafts fed back as the engine fed them."""
    L = len(context) - 1
    E = ref.f64(t["backbone.embeddings.weight"])
    emb, h = E[np.asarray(context[1:])], ref_hidden(t, cfg, context[:L])        # pairs (h_p, tok_{p+1})
    out = []
    for d in drafts:
        g = ref_mtp(t, cfg, emb, h)[-1]
        out.append(g @ ref.f64(t["lm_head.weight"]).T)
        emb, h = np.concatenate([emb, E[d][None]]), np.concatenate([h, g[None]])
    return np.array(out)


# ---- the MTP step ------------------------------------------------------------------------------------------
def test_mtp_step_matches_the_numpy_reference(mtp_model, tensors, rng):
    D, B, T, k = MTP_CFG.hidden_size, 2, 8, 3
    lengths = np.array([8, 5])
    pool = MtpCache.for_config(MTP_CFG, 2, 16, jnp.float32).kv
    pool = type(pool)(*(jnp.asarray(rng.standard_normal(a.shape) * 100, jnp.float32) for a in (pool.k, pool.v)))
    emb = rng.standard_normal((B, T + k, D)).astype(np.float32)        # garbage in the pool: it must not be read
    h = rng.standard_normal((B, T + k, D)).astype(np.float32)
    slots = jnp.array([0, 1])
    mtp = mtp_model.mtp
    g, pool = jax.jit(mtp.prefill)(pool, slots, emb[:, :T], h[:, :T], jnp.asarray(lengths), jnp.zeros(2, jnp.int32))
    # then k rows per sequence right after each one's prefill (the verify / drafting form)
    tail_e = np.stack([emb[b, lengths[b]:lengths[b] + k] for b in range(B)]).reshape(B * k, D)
    tail_h = np.stack([h[b, lengths[b]:lengths[b] + k] for b in range(B)]).reshape(B * k, D)
    g2, _ = jax.jit(mtp.rows, static_argnums=5)(pool, slots, tail_e, tail_h, jnp.asarray(lengths), k)
    g2 = np.asarray(g2).reshape(B, k, D)
    for b in range(B):
        n = lengths[b]
        want = ref_mtp(tensors, MTP_CFG, emb[b, :n + k], h[b, :n + k])
        assert rel_err(np.asarray(g)[b, :n], want[:n]) < 1e-5
        assert rel_err(g2[b], want[n:]) < 1e-5


# ---- drafting in the engine --------------------------------------------------------------------------------
def _prompts(rng, lengths):
    return [rng.integers(0, EOS, n).tolist() for n in lengths]


def _tokens(gens):
    return [g.tokens for g in gens]


def _mixed(draw, engine, n_new, **kw):
    """Prompts from draw() on which an MTP engine (kw) keeps some drafts and rejects others, and its tokens: the
    nudged weights make most prompt sets mix, a few do not (e.g. every draft rejected), so redraw up to 8 times."""
    for _ in range(8):
        prompts = draw()
        eng = engine(speculative=SPEC, **kw)
        tokens = _tokens(eng.generate(prompts, n_new))
        if 0 < eng.counters["accepted_tokens"] < eng.counters["drafted_tokens"]:
            return prompts, tokens
    pytest.fail("8 random prompt sets: every draft accepted on each, or none; the nudged weights no longer mix")


def test_greedy_outputs_identical_with_mtp_on_and_off(engine, rng):
    prompts, spec = _mixed(lambda: _prompts(rng, [5, 13, 21, 9, 3, 17]), engine, 12)   # 6 requests, 4 slots
    want = _tokens(engine().generate(prompts, 12))
    assert spec == want                                                 # greedy: speculation changes nothing
    for b in (1, 4):
        alone = engine(speculative=SPEC, prefill_token_budget=7)        # chunked prefill carries h across chunks
        assert _tokens(alone.generate([prompts[b]], 12)) == [want[b]]
        kv, hidden = np.asarray(alone.mtp.kv.k), np.asarray(alone.mtp.hidden)
        assert not kv[:, 1:alone.pad].any() and not hidden[1:alone.pad].any()   # padded rows: pad slot only


def test_proposed_drafts_are_the_references_argmax(engine, tensors, rng):
    eng = engine(speculative=SPEC, prefill_token_budget=7)
    seen = []
    propose = eng._mtp_drafts

    def recording(group, slots, limits):
        drafts = propose(group, slots, limits)
        seen.extend((r.prompt + r.tokens, drafts[r.rid]) for r in group)
        return drafts

    eng._mtp_drafts = recording
    eng.generate(_prompts(rng, [11, 4, 17]), 10)
    assert len(seen) >= 6 and any(FAVOURED in d for _, d in seen) and any(set(d) - {FAVOURED} for _, d in seen)
    picks = sorted(range(len(seen)), key=lambda i: (i % 3, i))[:6]     # spread over the run and the sequences
    for i in picks:
        context, drafts = seen[i]
        logits = ref_draft_logits(tensors, MTP_CFG, context, drafts)
        for j, d in enumerate(drafts):                                  # the argmax, up to f32 near-ties
            assert logits[j].max() - logits[j][d] <= 1e-4 * np.abs(logits[j]).max(), (i, j, d)


# ---- with the prefix cache ---------------------------------------------------------------------------------
def _run_recording(eng, prompts, max_new_tokens=8):
    """Run prompts one after another; per prompt: (tokens, its drafts in order, its MTP state right after its
    prefill: keys/values of positions < len - 1 and the carried hidden state, prefix tokens restored)."""
    out, drafts = [], {}
    propose = eng._mtp_drafts

    def recording(group, slots, limits):
        d = propose(group, slots, limits)
        for r in group:
            drafts.setdefault(r.rid, []).append(d[r.rid])
        return d

    eng._mtp_drafts = recording
    for p in prompts:
        rid = eng.submit(p, max_new_tokens)
        r = eng.requests[rid]
        while r.done < len(p):
            eng.step()
        s, L = r.slot, len(p)
        state = [np.asarray(a[:, s, :L - 1]) for a in (eng.mtp.kv.k, eng.mtp.kv.v)] + [np.asarray(eng.mtp.hidden[s])]
        eng.run()
        out.append((eng.pop(rid).tokens, drafts.get(rid), state, r.prefix_hit))
    return out


@pytest.mark.parametrize("replay_tail", [True, False])
def test_prefix_hits_restore_the_mtp_state_bit_for_bit(engine, rng, replay_tail):
    """Block 8, budget 16: chunks end at the same positions with the cache on and off (the cuts 16 and 32 fall
    on chunk ends), so the states match bitwise. p1 shares only block 0 with p0, so the MTP pair at position 7
    differs between their branches; p2 and p3 hit p1's and p0's snapshots at 16, p3 then snapshots at 32.
    replay_tail=False: the two-pass split (a prefill chunk ends at the cut; set on the engine here as for a
    model without the in-pass capture)."""
    new = lambda n: rng.integers(0, EOS, n).tolist()
    base = new(19)
    p0, p1 = base + new(4), base[:8] + new(13)
    p2, p3 = p1[:18] + new(3), base + new(14)
    # no EOS: every prompt decodes its 8 tokens and so has drafts to compare (a random prompt's first token can be
    # EOS, seed 1028354748)
    kw = dict(speculative=SPEC, prefill_token_budget=16, eos_ids=[])
    on = engine(**kw, prefix_cache_bytes=1 << 20)
    on.replay_tail = replay_tail
    got = _run_recording(on, [p0, p1, p2, p3])
    want = _run_recording(engine(**kw), [p0, p1, p2, p3])
    assert [g[3] for g in got] == [0, 0, 16, 16]
    st = on.prefix_cache.stats()
    assert st["hits"] == 2 and st["misses"] == 2 and st["entries"] == 3            # at 16 (p0, p1), 32 (p3)
    for (tok, drafts, state, _), (tok0, drafts0, state0, _) in zip(got, want):
        assert tok == tok0 and drafts == drafts0 and drafts
        for a, b in zip(state, state0):
            np.testing.assert_array_equal(a, b)
    # bytes: 3 snapshots (Mamba states + hidden [D]) and 5 blocks (0, 1, 1', 2, 3: KV + MTP KV rows)
    snap = tree_nbytes((on.cache.ssm.conv_state[:, 0], on.cache.ssm.ssm_state[:, 0], on.mtp.hidden[0]))
    blk = tree_nbytes((on.cache.kv.k[:, 0, :8], on.cache.kv.v[:, 0, :8], on.mtp.kv.k[:, 0, :8], on.mtp.kv.v[:, 0, :8]))
    assert on.mtp.kv.num_layers and st["bytes"] == 3 * snap + 5 * blk
    hit = on.prefix_cache.lookup(p3)
    assert hit.length == 32 and len(hit.mtp_blocks) == 4 and hit.mtp_hidden.shape == (MTP_CFG.hidden_size,)


def test_greedy_outputs_identical_with_mtp_and_prefix_cache_on_and_off(engine, rng):
    """A batch with chunk cuts off the block grid (budget 7): snapshots and hits inside shared prompts."""
    def draw():
        base = rng.integers(0, EOS, 19).tolist()
        return [base + rng.integers(0, EOS, n).tolist() for n in (4, 11, 2)] + _prompts(rng, [13])

    prompts, want = _mixed(draw, engine, 10, prefill_token_budget=7)
    eng = engine(speculative=SPEC, prefill_token_budget=7, prefix_cache_bytes=1 << 20)
    assert _tokens(eng.generate(prompts[:1], 10)) == want[:1]
    assert _tokens(eng.generate(prompts[1:], 10)) == want[1:]
    st = eng.prefix_cache.stats()
    assert st["hits"] >= 2 and st["hit_tokens"] >= 32
    assert 0 < eng.counters["accepted_tokens"] < eng.counters["drafted_tokens"]


def test_no_compile_after_warmup_over_a_mixed_mtp_workload(engine, rng):
    eng = engine(speculative=SPEC, prefill_token_budget=16, prefix_cache_bytes=1 << 20)
    eng.warmup(sampling=True)
    before = eng.compiles
    base = rng.integers(0, EOS, 20).tolist()
    for i, n in enumerate([3, 19, 8, 30, 12, 5, 22]):
        p = (base[:17] if i % 2 == 0 else []) + _prompts(rng, [n])[0]        # the even ones share 16 tokens
        eng.submit(p, int(rng.integers(1, 14)), temperature=0.8 if i % 2 else 0.0, seed=i)
        if i % 3 == 2:
            eng.step()
    eng.run()
    assert eng.compiles == before, eng.stats()
    hits = eng.exe.hits
    assert hits["mtp_draft"] > 0 and hits["verify"] > 0 and hits["prefill"] > 0
    assert hits["mtp_block_put"] > 0 and hits["mtp_block_get"] > 0 and eng.prefix_cache.hits > 0


def test_mtp_drafting_needs_an_mtp_head(engine, mtp_model, tensors):
    plain = NemotronH(MTP_CFG, {n: v for n, v in tensors.items() if not n.startswith("mtp.")}, dtype=jnp.float32)
    assert plain.mtp is None
    with pytest.raises(ConfigError, match="no mtp.* tensors"):
        Engine(plain, speculative=SPEC, **ENGINE)
    with pytest.raises(ConfigError, match="no MTP head"):
        plain.new_mtp_cache(2, 8)
    two = dataclasses.replace(MTP_CFG, num_nextn_predict_layers=2)
    with pytest.raises(ConfigError, match="one MTP step"):
        Engine(NemotronH.from_config(two, jax.random.key(0), dtype=jnp.float32), speculative=SPEC, **ENGINE)
