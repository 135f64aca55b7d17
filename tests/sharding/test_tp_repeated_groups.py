"""Tensor parallelism where tp does not divide the Mamba groups or the kv heads: the built-in model (n_groups = 1,
3 kv heads for 6 query heads) split over 2 devices repeats each group's B/C rows and each kv head on the devices
that need them, reduces the gated norm's mean square across devices, and gives the single-device logits, greedy
tokens, pools and checkpoint."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

from metrale_jax import sharding
from metrale_jax.builtin import builtin_model_dir
from metrale_jax.layers.blocks import gated_rmsnorm_across_devices
from metrale_jax.model import _JITTED, NemotronH
from tests.numpy_refs import rel_err
from tests.sharding.test_tensor_parallel import TOL

SLOTS, MAXLEN, T, STEPS = 2, 32, 9, 4


@pytest.fixture(scope="module")
def pair():
    """(single-device built-in model, the same split over 2 devices), float32."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices")
    one = NemotronH.from_pretrained(builtin_model_dir(), dtype=jnp.float32, progress=False)
    two = NemotronH.from_pretrained(builtin_model_dir(), dtype=jnp.float32, progress=False,
                                    mesh=sharding.make_mesh(2))
    return one, two


def _close(got, want, tol=TOL):
    err = rel_err(got, want)
    assert err <= tol, f"rel err {err:.3g} > {tol}"


def greedy_run(model, prompts, lens, steps=STEPS, max_len=MAXLEN):
    """Prefill right-padded prompts [B, T] (every position's logits), then `steps` greedy decode steps:
    (prefill logits, decode logits, tokens, cache)."""
    slots = np.arange(prompts.shape[0])
    cache = model.new_cache(len(slots), max_len)
    pre, cache = model.prefill(cache, slots, prompts, lens, all_logits=True)
    tok = np.asarray(pre)[slots, lens - 1].argmax(-1)
    dec, toks = [], [tok]
    for _ in range(steps):
        logits, cache = model.decode(cache, slots, tok.astype(np.int32))
        dec.append(np.asarray(logits))
        tok = dec[-1].argmax(-1)
        toks.append(tok)
    return np.asarray(pre), np.stack(dec), np.stack(toks, 1), cache


def test_group_and_kv_head_repetition_tables():
    one_group = dataclasses.replace(_cfg(), mamba_num_heads=12, n_groups=1)
    assert sharding.mamba_groups(one_group, 2) == [[0], [0]]
    assert sharding.mamba_groups(one_group, 4) == [[0], [0], [0], [0]]
    three = dataclasses.replace(one_group, n_groups=3)        # 4 heads a group, 6 a device: groups cut by devices
    assert sharding.mamba_groups(three, 2) == [[0, 0, 1], [1, 2, 2]]
    assert sharding.norm_spans_devices(three, 2) and sharding.norm_spans_devices(one_group, 2)
    assert not sharding.norm_spans_devices(dataclasses.replace(one_group, n_groups=4), 2)
    assert sharding.mamba_groups(dataclasses.replace(one_group, n_groups=4), 2) == [[0, 1], [2, 3]]
    assert sharding.kv_groups(_cfg(), 2) == [[0, 0, 1], [1, 2, 2]]               # 6 heads, 3 kv heads
    local, stored = sharding.local_config(three, 2), sharding.storage_config(three, 2)
    assert (local.n_groups, stored.n_groups, stored.conv_dim) == (3, 6, three.d_inner + 2 * 6 * three.ssm_state_size)
    rows = sharding.in_proj_rows(three, 2)
    assert len(rows) == 2 * local.in_proj_dim and set(rows.tolist()) == set(range(three.in_proj_dim))


def _cfg():
    from metrale_jax.config import ModelConfig
    return ModelConfig.from_hf(builtin_model_dir())


def test_gated_norm_across_devices_matches_float64(rng):
    """A norm group of 12 channels over 2 devices of 18 channels each (groups cut by the device boundary)."""
    mesh = sharding.make_mesh(2)
    y, z = rng.standard_normal((2, 5, 36)), rng.standard_normal((2, 5, 36))
    w = rng.standard_normal(36)
    h = y * z / (1 + np.exp(-z))
    hg = h.reshape(2, 5, 3, 12)
    want = (hg / np.sqrt((hg ** 2).mean(-1, keepdims=True) + 1e-5)).reshape(h.shape) * w
    fn = jax.shard_map(lambda a, b, c: gated_rmsnorm_across_devices(a, b, c, group_size=12, eps=1e-5, axis="tp"),
                       mesh=mesh, in_specs=(P(None, None, "tp"), P(None, None, "tp"), P("tp")),
                       out_specs=P(None, None, "tp"))
    got = fn(*(jnp.asarray(a, jnp.float32) for a in (y, z, w)))
    assert rel_err(got, want) < 1e-6


def test_builtin_on_two_devices_gives_the_single_device_logits_and_tokens(pair, rng):
    """Prefill of two right-padded prompts (every position's logits) and 4 greedy decode steps: logits within the
    TP tolerance, the same greedy tokens; the pools hold the single-device states (repeated B/C conv channels and
    kv heads equal on both devices)."""
    one, two = pair
    lens = np.array([T, 5])
    prompts = np.where(np.arange(T)[None] < lens[:, None], rng.integers(3, 259, (SLOTS, T)), 0).astype(np.int32)
    want, got = greedy_run(one, prompts, lens), greedy_run(two, prompts, lens)
    for b in range(SLOTS):
        _close(got[0][b, :lens[b]], want[0][b, :lens[b]])
    _close(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])
    cw, cg = want[3], got[3]
    live = np.arange(SLOTS)
    _close(np.asarray(cg.ssm.ssm_state)[:, live], np.asarray(cw.ssm.ssm_state)[:, live])
    conv = np.asarray(cg.ssm.conv_state)
    _close(sharding.conv_channels_to_checkpoint_order(conv, one.config, 2)[:, live],
           np.asarray(cw.ssm.conv_state)[:, live])
    C, I = one.config.conv_dim, one.config.d_inner
    half = conv.shape[2] // 2                                   # device 1's channels start here
    np.testing.assert_array_equal(conv[:, live, I // 2:half], conv[:, live, half + I // 2:])   # B/C, both devices
    for name in ("k", "v"):
        kv = np.asarray(getattr(cg.kv, name))
        assert kv.shape[3] == 6 and getattr(cg.kv, name).sharding.spec[3] == "tp"
        np.testing.assert_array_equal(kv[:, live, :, 2], kv[:, live, :, 3])              # kv head 1 on both
        _close(sharding.kv_heads_to_checkpoint_order(kv, one.config, 2)[:, live],
               np.asarray(getattr(cw.kv, name))[:, live])
    assert conv.shape[2] == C + 2 * one.config.ssm_state_size     # B and C stored once per device


def test_decode_has_one_more_all_reduce_per_mamba_block(pair):
    """A group split over devices costs one all-reduce of [B, groups] per Mamba block, beside one per block."""
    _, two = pair
    cache = two.new_cache(SLOTS, MAXLEN)
    hlo = _JITTED["decode"].lower(two, cache, jnp.arange(SLOTS, dtype=jnp.int32),
                                  jnp.ones(SLOTS, jnp.int32)).compile().as_text()
    c = two.config
    counts = sharding.collective_counts(hlo)
    assert counts["all-reduce"] == c.num_hidden_layers + c.hybrid_override_pattern.count("M"), counts
    assert sum(counts.values()) == counts["all-reduce"], counts


def test_save_pretrained_of_the_split_model_equals_the_single_device_one(pair, tmp_path):
    """Bitwise the same tensors (one copy of each repeated row); the MTP head is not kept on a mesh."""
    one, two = pair
    one.save_pretrained(tmp_path / "one")
    two.save_pretrained(tmp_path / "two")
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert set(a) - set(b) == {n for n in a if n.startswith("mtp.")} and set(b) <= set(a)
    for name in b:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)


def test_lora_adapter_over_repeated_groups_and_kv_heads(rng, tmp_path):
    """An adapter on every target of the built-in model, split over 2 devices: its in_proj B rows follow the
    repeated B/C rows and its k/v_proj B rows the repeated kv heads; the logits are the single device's and
    save_adapter writes the adapter's own rows back (one copy of each)."""
    from metrale_jax.adapters import lora_targets
    from metrale_jax.weights.lora import LoraConfig, write_adapter
    from tests.test_lora_tp import _tensors

    one = NemotronH.from_pretrained(builtin_model_dir(), dtype=jnp.float32, progress=False)
    two = NemotronH.from_pretrained(builtin_model_dir(), dtype=jnp.float32, progress=False,
                                    mesh=sharding.make_mesh(2))
    modules = ("in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")
    factors = {}
    for n, t in lora_targets(one).items():
        if n.rsplit(".", 1)[-1] in modules and ".experts." not in n:     # routed experts: tests/test_lora_tp.py
            N, K = t.shape
            factors[n] = ((rng.standard_normal((2, K)) * K ** -0.5).astype(np.float32),
                          (rng.standard_normal((N, 2)) * 0.3).astype(np.float32))
    path = tmp_path / "a"
    write_adapter(path, LoraConfig(2, 4.0, target_modules=modules), factors)
    one.load_adapter(path, "a")
    two.load_adapter(path, "a")
    sharding.check_placement(two)
    ids = jnp.asarray(rng.integers(3, 259, (2, 9)))
    rows = jnp.array([1, 1], jnp.int32)                        # both rows on the adapter
    want = np.asarray(_JITTED["forward"](one, ids, rows))
    _close(np.asarray(_JITTED["forward"](two, ids, rows)), want)
    assert rel_err(want, np.asarray(_JITTED["forward"](one, ids, jnp.zeros(2, jnp.int32)))) > 1e-2
    two.save_adapter(tmp_path / "back", "a")
    saved, written = _tensors(tmp_path / "back"), _tensors(path)
    assert saved.keys() == written.keys()
    for k in written:
        np.testing.assert_array_equal(saved[k], written[k], err_msg=k)
