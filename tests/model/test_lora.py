"""LoRA adapters on NemotronH (issue 36): overlay vs merged weights, unload restoring the base bit for bit, rows of
different adapters in one batch (model steps and the Engine) equal to each adapter alone, the overlay beside every
projection arm, LoRA parameters as the only trainable state with gradients through the kernels, PEFT round trips,
and the typed errors of adapters that do not fit."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from metrale_jax import Engine
from metrale_jax.adapters import lora_projections
from metrale_jax.config import ModelLevers
from metrale_jax.errors import CheckpointError, ConfigError, WeightFormatError
from metrale_jax.layers import lora
from metrale_jax.layers.lora import LoraOverlay, LoraParam
from metrale_jax.layers.projection import Projection
from metrale_jax.layers.stack import DecodeRows
from metrale_jax.model import NemotronH, forward_step, random_tensors
from metrale_jax.weights.containers import quantize_fp8_block_weight, quantize_nvfp4_weight
from metrale_jax.weights.lora import CONFIG_FILE, WEIGHTS_FILE
from metrale_jax.weights.safetensors_io import SafetensorsFile, save_safetensors
from tests.numpy_refs import rel_err
from tests.tiny_models import ALL_KINDS

F32 = jnp.float32
EVERY = ("in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj",
         "fc1_latent_proj", "fc2_latent_proj")


def _model(rng, kernels="reference", tensors=None):
    tensors = tensors or random_tensors(ALL_KINDS, jax.random.key(int(rng.integers(1 << 30))), F32)
    return NemotronH(ALL_KINDS, tensors, dtype=F32, levers=ModelLevers(kernels=kernels))


def _add(model, rng, name, targets=EVERY, r=4):
    """A fresh adapter with B drawn at random too (PEFT starts B at zero), only where the adapter is real."""
    model.add_adapter(name, r=r, lora_alpha=2.0 * r, target_modules=targets,
                      key=jax.random.key(int(rng.integers(1 << 30))))
    i = len(model.adapters) - 1
    for n in model.adapters[i].modules:
        lo = lora_projections(model)[n].lora
        b = np.array(lo.b[...])
        b[i, :, :r] = rng.standard_normal(b[i, :, :r].shape) * 0.3
        lo.b[...] = jnp.asarray(b)
    return name


def _ids(rng, b=3, t=11):
    return rng.integers(0, ALL_KINDS.vocab_size, (b, t))


def _leaves(model):
    return [np.asarray(v) for v in jax.tree.leaves(nnx.state(model))]


# ---- overlay, merge, unload -----------------------------------------------------------------------------
def test_overlay_equals_merged_and_unload_restores_the_base_bitwise(rng):
    model = _model(rng)
    ids = _ids(rng)
    base, before, treedef = np.asarray(model.forward(ids)), _leaves(model), jax.tree.structure(model)
    _add(model, rng, "a")
    assert len(model.adapters[0].modules) == 12            # every projection kind of M * E - that takes LoRA
    overlay = np.asarray(model.forward(ids))
    assert rel_err(overlay, base) > 1e-2                    # the adapter does something
    model.merge_adapter()
    merged = np.asarray(model.forward(ids))
    assert np.abs(merged - overlay).max() <= 1e-5 * np.abs(overlay).max(), np.abs(merged - overlay).max()
    model.unload_adapter()
    assert jax.tree.structure(model) == treedef and model.adapters == () and model.active_adapter is None
    for a, b in zip(_leaves(model), before, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(model.forward(ids)), base)


def test_merge_refuses_a_quantized_base_and_a_second_merge(rng):
    tensors = random_tensors(ALL_KINDS, jax.random.key(int(rng.integers(1 << 30))), F32)
    name = "backbone.layers.1.mixer.q_proj.weight"
    tensors[name] = quantize_fp8_block_weight(tensors[name])
    model = _model(rng, tensors=tensors)
    _add(model, rng, "a", targets=("q_proj", "k_proj"))
    with pytest.raises(WeightFormatError, match=r"backbone.layers.1.mixer.q_proj: merge_adapter .* quantized"):
        model.merge_adapter("a")
    _add(model, rng, "b", targets=("k_proj",))
    model.merge_adapter("b")
    _add(model, rng, "c", targets=("k_proj",))
    with pytest.raises(ConfigError, match="adapter 'b' is merged already"):
        model.merge_adapter("c")


# ---- several adapters in one batch ---------------------------------------------------------------------
def test_rows_with_different_adapters_equal_each_adapter_alone(rng):
    model = _model(rng)
    _add(model, rng, "a")
    _add(model, rng, "b", targets=("in_proj", "q_proj", "down_proj"), r=2)
    ids = _ids(rng, b=4)
    mixed = np.asarray(jax.jit(forward_step)(model, jnp.asarray(ids), jnp.asarray([2, 0, 1, 2], jnp.int32)))
    for row, name in enumerate(("b", None, "a", "b")):
        model.set_adapter(name)
        alone = np.asarray(model.forward(ids))[row]
        np.testing.assert_allclose(mixed[row], alone, rtol=0, atol=1e-5 * np.abs(alone).max())


def test_engine_batches_requests_of_different_adapters(rng):
    model = _model(rng)
    _add(model, rng, "a")
    _add(model, rng, "b", r=2)
    prompts = [list(map(int, p)) for p in _ids(rng, b=3, t=9)]
    engine = Engine(model, max_slots=4, max_len=32)
    rids = [engine.submit(p, 6, adapter=a) for p, a in zip(prompts, (None, "a", "b"))]
    engine.run()
    got = [engine.pop(r).tokens for r in rids]
    for p, name, tokens in zip(prompts, (None, "a", "b"), got):
        model.set_adapter(name)
        assert model.generate([p], 6)[0].tokens == tokens, name
    assert got[1] != got[0] or got[2] != got[0]              # the adapters change what is generated
    with pytest.raises(ConfigError, match="no adapter named 'c'"):
        engine.submit(prompts[0], 2, adapter="c")
    plain = _model(rng)
    early = Engine(plain, max_slots=2, max_len=16)
    _add(plain, rng, "late")
    with pytest.raises(ConfigError, match="'late' was loaded after this Engine was made"):
        early.submit(prompts[0], 2, adapter="late")


# ---- every arm ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["dense", "fp8_block", "nvfp4"])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_overlay_runs_beside_every_arm(rng, fmt, phase):
    """The base arm's kernel (interpret mode) as without an overlay, plus scale B (A x) per row's adapter."""
    N, K, M = 64, 128, 3
    w = rng.standard_normal((N, K)).astype(np.float32) * K ** -0.5
    weight = {"dense": jnp.asarray(w), "fp8_block": quantize_fp8_block_weight(w),
              "nvfp4": quantize_nvfp4_weight(w)}[fmt]
    proj = Projection("p", N, K, kernels="interpret")
    proj.set_weight(weight)
    x = jnp.asarray(rng.standard_normal((M, K)), F32)
    base = np.asarray(proj(x, phase=phase, out_dtype=F32))
    a, b = rng.standard_normal((2, 3, K)) * 0.1, rng.standard_normal((2, N, 3)) * 0.1
    proj.lora = LoraOverlay(a, b, np.array([2.0, 0.5], np.float32))
    table = jnp.asarray([1, 0, 2, 0], jnp.int32)                         # slots 0..2 live, 3 the padding slot
    with lora.slot_adapters(table), lora.block_rows(DecodeRows(jnp.arange(M), jnp.zeros(M, jnp.int32)),
                                                    packed=False):
        got = np.asarray(proj(x, phase=phase, out_dtype=F32))
    assert proj.active_arm(phase, M) == {"dense": "dense", "fp8_block": "fp8_native", "nvfp4": "nvfp4"}[fmt]
    xd = np.asarray(x, np.float64)
    want = base.astype(np.float64)
    want[0] += 2.0 * (xd[0] @ a[0].T) @ b[0].T
    want[2] += 0.5 * (xd[2] @ a[1].T) @ b[1].T
    assert rel_err(got, want) < 1e-5
    np.testing.assert_array_equal(got[1], base[1])                      # adapter 0: the base's bits
    np.testing.assert_array_equal(np.asarray(proj(x, phase=phase, out_dtype=F32)), base)   # no scope: base


# ---- training state and gradients --------------------------------------------------------------------
def test_lora_params_are_the_trainable_state_and_differentiate_through_the_kernels(rng):
    tensors = random_tensors(ALL_KINDS, jax.random.key(int(rng.integers(1 << 30))), F32)
    ids = jnp.asarray(_ids(rng, b=2, t=13))
    target = jnp.asarray(rng.standard_normal((2, 13, ALL_KINDS.vocab_size)), F32)
    grads = {}
    for kernels in ("reference", "interpret"):
        model = _model(np.random.default_rng(0), kernels, tensors)
        _add(model, np.random.default_rng(1), "a")
        graph, params, rest = nnx.split(model, LoraParam, ...)
        names = {".".join(str(getattr(k, "key", k)) for k in p[:-1]) for p, _ in
                 jax.tree_util.tree_leaves_with_path(params)}
        assert names and all(n.endswith((".lora.a", ".lora.b")) for n in names)    # nothing else trains

        def loss(p):
            return jnp.sum(target * jnp.tanh(forward_step(nnx.merge(graph, p, rest), ids, model._adapter_table(2)
                                                          ["adapters"])))

        grads[kernels] = [np.asarray(g) for g in jax.tree.leaves(jax.jit(jax.grad(loss))(params))]
    assert any(np.any(g) for g in grads["reference"])
    for g, w in zip(grads["interpret"], grads["reference"], strict=True):
        assert rel_err(g, w) <= 1e-5 if np.any(w) else not np.any(g)


# ---- PEFT files ----------------------------------------------------------------------------------------
def test_save_and_load_round_trip(tmp_path, rng):
    model = _model(rng)
    ids = _ids(rng)
    _add(model, rng, "a", r=3)
    want = np.asarray(model.forward(ids))
    files = model.save_adapter(tmp_path / "ad")
    assert sorted(f.name for f in files) == [CONFIG_FILE, WEIGHTS_FILE]
    cfg = json.loads((tmp_path / "ad" / CONFIG_FILE).read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 3 and cfg["lora_alpha"] == 6.0
    keys = SafetensorsFile(tmp_path / "ad" / WEIGHTS_FILE).keys()
    assert "base_model.model.model.layers.0.mixer.in_proj.lora_A.weight" in keys
    model.unload_adapter()
    assert model.load_adapter(tmp_path / "ad", name="again") == "again"
    np.testing.assert_array_equal(np.asarray(model.forward(ids)), want)


@pytest.fixture
def saved(tmp_path, rng):
    """A valid adapter directory of the ALL_KINDS model, its tensors and config, to spoil one way per case."""
    model = _model(rng)
    _add(model, rng, "a", targets=("in_proj", "q_proj", "up_proj"))
    model.save_adapter(tmp_path / "ok")
    model.unload_adapter()
    f = SafetensorsFile(tmp_path / "ok" / WEIGHTS_FILE)
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    f.close()
    return model, tmp_path, tensors, json.loads((tmp_path / "ok" / CONFIG_FILE).read_text())


def _write(tmp_path, name, tensors, config):
    d = tmp_path / name
    d.mkdir()
    save_safetensors(d / WEIGHTS_FILE, tensors)
    (d / CONFIG_FILE).write_text(json.dumps(config))
    return d


QP = "base_model.model.model.layers.1.mixer.q_proj"


def test_adapters_that_do_not_fit_name_the_tensor(saved):
    model, tmp, tensors, config = saved
    cases = {
        "shape": ({**tensors, f"{QP}.lora_B.weight": np.zeros((33, 4), np.float32)}, config,
                  rf"{QP}.lora_B.weight: shape \[33, 4\], expected \[32, 4\]"),
        "rank": (tensors, {**config, "r": 8}, r"lora_A.weight: shape \[4, 32\], expected \[8, 32\]"),
        "module": ({**tensors, "base_model.model.model.layers.0.mixer.conv1d.lora_A.weight": np.zeros((4, 4))},
                   config, "layers.0.mixer.conv1d is not a projection of this model"),
        "kind": ({**tensors, "base_model.model.model.layers.1.mixer.in_proj.lora_A.weight": np.zeros((4, 32)),
                  "base_model.model.model.layers.1.mixer.in_proj.lora_B.weight": np.zeros((100, 4))}, config,
                 "layers.1.mixer.in_proj is not a projection of this model"),
        "pair": ({k: v for k, v in tensors.items() if k != f"{QP}.lora_B.weight"}, config,
                 r"q_proj.lora_B.weight: missing"),
        "layers": ({**tensors, "base_model.model.model.layers.7.mixer.q_proj.lora_A.weight": np.zeros((4, 32))},
                   config, "layer 7, but this model has 4 layers: an adapter for another base model"),
        "target": (tensors, {**config, "target_modules": ["q_proj", "gate_proj"]},
                   "target_modules: 'gate_proj' names no projection"),
        "dora": (tensors, {**config, "use_dora": True}, f"{CONFIG_FILE}: use_dora: True is not supported"),
        "modules_to_save": (tensors, {**config, "modules_to_save": ["gate"]}, "modules_to_save: 'gate' is not supported"),
        "no copy": (tensors, {**config, "modules_to_save": ["lm_head"]}, "modules_to_save names lm_head, but the "
                                                                         "adapter holds no full copy"),
        "head pair": ({**tensors, "base_model.model.lm_head.lora_A.weight": np.zeros((4, 32))}, config,
                      "lm_head.lora_B.weight: missing"),
        "prefix": ({**tensors, "base_model.model.norm_f.lora_A.weight": np.zeros((4, 32))}, config,
                   "norm_f.lora_A.weight: not a LoRA factor of a block's projection or lm_head"),
    }
    for case, (t, c, match) in cases.items():
        with pytest.raises(CheckpointError, match=match):
            model.load_adapter(_write(tmp, case, t, c))
        assert model.adapters == () and all(p.lora is None for p in lora_projections(model).values()), case


def test_an_adapter_for_another_hidden_size_is_refused(saved, rng):
    model, tmp, _, _ = saved
    other = NemotronH.from_config(dataclasses.replace(ALL_KINDS, hidden_size=48), jax.random.key(0), F32)
    _add(other, rng, "w", targets=("q_proj",))
    other.save_adapter(tmp / "wide")
    with pytest.raises(CheckpointError, match=r"q_proj.lora_A.weight: shape \[4, 48\], expected \[4, 32\]"):
        model.load_adapter(tmp / "wide")


def test_hostile_adapter_files_are_refused(saved):
    model, tmp, tensors, config = saved
    fifo = _write(tmp, "fifo", tensors, config)
    os.remove(fifo / WEIGHTS_FILE)
    os.mkfifo(fifo / WEIGHTS_FILE)
    with pytest.raises(CheckpointError, match="not a regular file"):
        model.load_adapter(fifo)
    cut = _write(tmp, "cut", tensors, config)
    blob = (cut / WEIGHTS_FILE).read_bytes()
    (cut / WEIGHTS_FILE).write_bytes(blob[:len(blob) // 2])
    with pytest.raises(CheckpointError, match=WEIGHTS_FILE):
        model.load_adapter(cut)
    bad = _write(tmp, "json", tensors, config)
    (bad / CONFIG_FILE).write_text("[" * 100000)
    with pytest.raises(CheckpointError, match=CONFIG_FILE):
        model.load_adapter(bad)
    with pytest.raises(CheckpointError, match=CONFIG_FILE):
        model.load_adapter(tmp / "missing")
    with pytest.raises(ConfigError, match="no adapter named 'x'"):
        model.set_adapter("x")
