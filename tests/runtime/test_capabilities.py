"""The model's capability flags drive the engine's paths.

A test layer (an MLP layer subclass with one flag set, same weights) replaces the MLP block of a small
"M*-" model; every flagged engine must give the unflagged engine's greedy tokens, and the counters show
the path it took: eager decode / verify, per-sequence decode / verify, dropped executables on a new
sequence, two-pass prefix snapshots. Each flagged engine turns on only the features its flag acts on
(greedy tokens do not depend on them)."""

import jax
import jax.numpy as jnp
import pytest

from metrale_jax.config import ModelConfig
from metrale_jax.errors import ConfigError
from metrale_jax.layers.mlp import NemotronMLPLayer
from metrale_jax.model import NemotronH
from metrale_jax.runtime import Engine, Executables, SpeculativeConfig
from tests.runtime.conftest import FAST_COMPILE

CFG = ModelConfig.from_hf(dict(
    vocab_size=64, hidden_size=32, hybrid_override_pattern="M*-", mamba_num_heads=4, mamba_head_dim=8,
    ssm_state_size=8, n_groups=2, chunk_size=8, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=48, eos_token_id=63))
ENGINE = dict(max_slots=2, max_len=48, batch_buckets=(2,), token_buckets=(16,), prefill_token_budget=16,
              prefix_cache_bytes=1 << 20, speculative=SpeculativeConfig(num_draft=2))


@pytest.fixture(scope="module")
def base():
    return NemotronH.from_config(CFG, jax.random.key(5), dtype=jnp.float32)


def flagged(base, **flags):
    """The base model with its MLP block replaced by a subclass instance that sets `flags`."""
    model = NemotronH(CFG, base.state_dict(), dtype=jnp.float32)
    layer = model.layers[2]
    cls = type("FlaggedMLP", (NemotronMLPLayer,), dict(flags))
    model.layers[2] = cls(layer.input_norm[...], layer.mlp_weights(), CFG, 2, levers=model.levers)
    return model


def _prompts():
    # fixed prompts: the first and the last share a 9-token start (the last, queued behind two on two
    # slots, hits the snapshot at the 8-token block), the middle one repeats itself for the n-gram drafter
    rep = [5, 9, 2, 7] * 5
    return [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], rep, [3, 1, 4, 1, 5, 9, 2, 6, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6]]


def _run(model, **kw):
    eng = Engine(model, executables=Executables(compiler_options=FAST_COMPILE), **{**ENGINE, **kw})
    out = [g.tokens for g in eng.generate(_prompts(), 8)]
    return eng, out


@pytest.fixture(scope="module")
def reference(base):
    eng, out = _run(base)
    assert eng.counters["verify_rows"] > 0 and eng.counters["decode_rows"] > 0
    assert eng.exe.compiles["decode"] == 1 and eng.exe.compiles["verify"] == 1 and not eng.exe.eager_runs
    assert eng.exe.compiles["prefill_capture"] == 1 and eng.prefix_cache.hits > 0
    return out


def test_decode_graph_veto_runs_decode_eagerly(base, reference):
    """(Without speculation: an op-by-op verify costs seconds of per-op compiles on the CPU; it takes the
    same decode_executables path.)"""
    model = flagged(base, decode_graph_unsupported=True)
    assert model.capabilities.decode_graph_veto
    eng, out = _run(model, speculative=None, prefix_cache_bytes=0)
    assert out == reference
    assert not eng.decode_exe.graphs and eng.decode_exe is not eng.exe and "decode" not in eng.exe.compiles
    runs = eng.decode_exe.eager_runs["decode"]                        # every call eager, two rows at most
    assert eng.counters["decode_rows"] / 2 <= runs <= eng.counters["decode_rows"] and eng.decode_exe.size == 0
    assert eng.exe.compiles["prefill"] == 1                           # prefill keeps its executable


def test_multi_seq_veto_decodes_one_sequence_per_call(base, reference):
    eng, out = _run(flagged(base, decode_multi_seq_unsupported=True), speculative=None, prefix_cache_bytes=0)
    assert out == reference and eng.decode_buckets == (1,) and eng.verify_buckets == (2,)
    calls = eng.exe.compiles["decode"] + eng.exe.hits["decode"]
    assert calls == eng.counters["decode_rows"] > 2                    # one call per sequence


def test_verify_multi_veto_verifies_one_sequence_per_call(base, reference):
    eng, out = _run(flagged(base, decode_verify_multi_unsupported=True), prefix_cache_bytes=0)
    assert out == reference and eng.verify_buckets == (1,) and eng.decode_buckets == (2,)
    calls = eng.exe.compiles["verify"] + eng.exe.hits["verify"]
    assert calls == eng.counters["verify_rows"] > 1


def test_stale_graphs_are_dropped_for_a_slot_on_a_new_sequence(base, reference):
    eng, out = _run(flagged(base, graph_stale_on_new_sequence=True), speculative=None, prefix_cache_bytes=0)
    assert out == reference
    assert eng.counters["dropped_executables"] > 0
    assert eng.exe.compiles["decode"] > 1                               # rebuilt after a drop


def test_without_replay_tail_capture_snapshots_take_the_two_pass_split(base, reference):
    eng, out = _run(flagged(base, supports_replay_tail_split=False), speculative=None)
    assert out == reference and not eng.replay_tail
    assert "prefill_capture" not in eng.exe.compiles and eng.exe.compiles["slot_ssm_state"] == 1
    assert eng.prefix_cache.inserts > 0 and eng.prefix_cache.hits > 0


def test_flags_that_forbid_a_feature_raise(base):
    with pytest.raises(ConfigError, match="rollback"):
        Engine(flagged(base, decode_rollback_unsupported=True), **ENGINE)
    with pytest.raises(ConfigError, match="aux state"):
        Engine(flagged(base, has_aux_state=True), **ENGINE)
    Engine(flagged(base, has_aux_state=True), **{**ENGINE, "prefix_cache_bytes": 0})   # fine without it
