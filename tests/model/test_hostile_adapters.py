"""Hostile PEFT adapters and adapter arguments: adapter_config.json fields of the wrong kind (a zero or negative
rank_pattern rank, a NaN alpha_pattern value, a string for use_rslora, patterns that are not regexes), factors that
are not finite or given twice, bad ranks to add_adapter, and save_adapter over an existing adapter or onto a file.
Each is a typed error naming the file and the field or tensor, and leaves the model without the adapter."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.adapters import lora_projections
from metrale_jax.config import ModelLevers
from metrale_jax.errors import CheckpointError, ConfigError
from metrale_jax.model import NemotronH, random_tensors
from metrale_jax.weights.lora import CONFIG_FILE, WEIGHTS_FILE
from metrale_jax.weights.safetensors_io import SafetensorsFile, save_safetensors
from tests.tiny_models import ALL_KINDS

QP = "base_model.model.model.layers.1.mixer.q_proj"


@pytest.fixture(scope="module")
def model():
    return NemotronH(ALL_KINDS, random_tensors(ALL_KINDS, jax.random.key(0), jnp.float32), dtype=jnp.float32,
                     levers=ModelLevers(kernels="reference"))


@pytest.fixture
def saved(model, tmp_path, rng):
    """(a valid adapter directory of the model, its tensors, its config) to spoil one way per case."""
    model.add_adapter("a", r=4, lora_alpha=8.0, target_modules=("in_proj", "q_proj", "up_proj"),
                      key=jax.random.key(int(rng.integers(1 << 30))))
    model.save_adapter(tmp_path / "ok")
    model.unload_adapter()
    f = SafetensorsFile(tmp_path / "ok" / WEIGHTS_FILE)
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    f.close()
    return tmp_path / "ok", tensors, json.loads((tmp_path / "ok" / CONFIG_FILE).read_text())


def _write(d, tensors, config: dict | str):
    d.mkdir()
    save_safetensors(d / WEIGHTS_FILE, tensors)
    (d / CONFIG_FILE).write_text(config if isinstance(config, str) else json.dumps(config))
    return d


def _refused(model, d, error, match):
    with pytest.raises(error, match=match) as e:
        model.load_adapter(d)
    assert model.adapters == () and all(p.lora is None for p in lora_projections(model).values())
    return e.value


@pytest.mark.parametrize("field, value, message", [
    ("rank_pattern", {"q_proj": 0}, "rank_pattern: q_proj: expected a positive integer, got 0"),
    ("rank_pattern", {"q_proj": -2}, "rank_pattern: q_proj: expected a positive integer, got -2"),
    ("rank_pattern", {"q_proj(": 4}, r"rank_pattern: q_proj\(: the key is not a valid regex"),
    ("alpha_pattern", {"q_proj": "NaN"}, "alpha_pattern: q_proj: expected a finite number, got nan"),
    ("alpha_pattern", {"q_proj": True}, "alpha_pattern: q_proj: expected a finite number, got True"),
    ("use_rslora", "false", "use_rslora: expected true or false, got 'false'"),
    ("target_modules", "layers[.(1", "target_modules: .* is not a valid regex"),
])
def test_adapter_config_fields_of_the_wrong_kind_name_the_field(model, saved, tmp_path, field, value, message):
    """A zero rank divided the scale by zero (ZeroDivisionError), a negative one under use_rslora took a square
    root of it (ValueError), a bad pattern key raised re.error, a NaN alpha made every logit NaN, and the string
    "false" turned rsLoRA on: each is now refused before the adapter is installed."""
    _, tensors, config = saved
    text = json.dumps({**config, field: value}).replace('"NaN"', "NaN")   # Python's json reads a bare NaN
    err = _refused(model, _write(tmp_path / "bad", tensors, text), CheckpointError, message)
    assert str(tmp_path / "bad" / CONFIG_FILE) in str(err)


def test_a_rank_pattern_rank_that_fits_the_factors_loads(model, saved, tmp_path, rng):
    """rank_pattern's own rank decides the factor shapes and the scale: q_proj at rank 2 beside the others at 4."""
    _, tensors, config = saved
    tensors = {**tensors, f"{QP}.lora_A.weight": rng.standard_normal((2, 32)).astype(np.float32),
               f"{QP}.lora_B.weight": rng.standard_normal((32, 2)).astype(np.float32)}
    d = _write(tmp_path / "r2", tensors, {**config, "rank_pattern": {"q_proj": 2}, "alpha_pattern": {"q_proj": 1.0}})
    model.load_adapter(d)
    try:
        lo = lora_projections(model)["backbone.layers.1.mixer.q_proj"].lora
        assert float(lo.scale[...][0]) == 0.5 and model.adapters[0].config.rank("layers.1.mixer.q_proj") == 2
    finally:
        model.unload_adapter()


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_factors_are_named(model, saved, tmp_path, rng, value):
    _, tensors, config = saved
    name = sorted(tensors)[int(rng.integers(len(tensors)))]
    tensors[name].reshape(-1)[rng.integers(tensors[name].size)] = value
    err = _refused(model, _write(tmp_path / "bad", tensors, config), CheckpointError, "holds NaN or infinite values")
    assert err.problems == [f"{tmp_path / 'bad' / WEIGHTS_FILE}: {name}: holds NaN or infinite values"]


def test_a_factor_given_twice_under_two_spellings_is_refused(model, saved, tmp_path):
    """`backbone.` for `model.` (and a `.default` adapter name) are taken as the same factor: two tensors for one
    factor (here with different values) are named, instead of one silently winning."""
    _, tensors, config = saved
    twin = "backbone.layers.1.mixer.q_proj.lora_A.default.weight"
    tensors[twin] = tensors[f"{QP}.lora_A.weight"] + 1
    err = _refused(model, _write(tmp_path / "bad", tensors, config), CheckpointError, "the same factor as")
    first, second = sorted([twin, f"{QP}.lora_A.weight"])
    assert err.problems == [f"{second}: the same factor as {first}; expected one tensor per factor"]


@pytest.mark.parametrize("kwargs, field", [({"r": 0}, "r"), ({"r": -1}, "r"), ({"r": 2.5}, "r"), ({"r": True}, "r"),
                                           ({"lora_alpha": float("nan")}, "lora_alpha"),
                                           ({"lora_alpha": "8"}, "lora_alpha"),
                                           ({"target_modules": "q_proj("}, "target_modules"),
                                           ({"target_modules": ()}, "target_modules"),
                                           ({"target_modules": [3]}, "target_modules"),
                                           ({"target_modules": "v_proj"}, "target_modules")])
def test_add_adapter_refuses_bad_ranks_alphas_and_targets_by_name(model, kwargs, field):
    """r = 0 divided by zero, r = -1 failed in XLA, r = 2.5 in jax.random, a NaN alpha gave NaN logits; a string
    target_modules is one regex (as in PEFT), not a sequence of letters ("v_proj" names nothing of this model)."""
    args = {"r": 2, "lora_alpha": 4.0, "target_modules": ("q_proj",), "key": jax.random.key(0), **kwargs}
    with pytest.raises(ConfigError) as e:
        model.add_adapter("z", **args)
    assert e.value.field == field and model.adapters == ()


def test_add_adapter_takes_a_string_target_as_a_regex_over_the_whole_name(model):
    model.add_adapter("re", r=2, lora_alpha=4.0, target_modules=r".*\.(q|k)_proj", key=jax.random.key(1))
    try:
        info = model.adapters[-1]
        assert info.config.target_modules == r".*\.(q|k)_proj"
        assert {m.rsplit(".", 1)[1] for m in info.modules} == {"q_proj", "k_proj"}
    finally:
        model.unload_adapter()


def test_save_adapter_keeps_an_existing_adapter_without_overwrite(model, saved, tmp_path):
    """save_adapter over a directory holding an adapter replaced it silently; now, as save_pretrained, it needs
    overwrite=True, and then replaces the adapter's two files whole and keeps the directory's other files."""
    d, _, _ = saved
    (d / "README.md").write_text("notes")
    before = {f: (d / f).read_bytes() for f in (CONFIG_FILE, WEIGHTS_FILE)}
    model.add_adapter("b", r=2, lora_alpha=2.0, target_modules=("k_proj",), key=jax.random.key(3))
    try:
        with pytest.raises(CheckpointError, match="pass overwrite=True"):
            model.save_adapter(d)
        assert {f: (d / f).read_bytes() for f in before} == before
        model.save_adapter(d, overwrite=True)
    finally:
        model.unload_adapter()
    assert json.loads((d / CONFIG_FILE).read_text())["target_modules"] == ["k_proj"]
    assert (d / "README.md").read_text() == "notes"
    assert sorted(p.name for p in d.iterdir()) == sorted([CONFIG_FILE, WEIGHTS_FILE, "README.md"])


def test_save_adapter_onto_a_file_is_refused(model, tmp_path):
    (tmp_path / "f").write_text("mine")
    model.add_adapter("b", r=2, lora_alpha=2.0, target_modules=("k_proj",), key=jax.random.key(3))
    try:
        with pytest.raises(CheckpointError, match="exists and is not a directory"):
            model.save_adapter(tmp_path / "f")
    finally:
        model.unload_adapter()
    assert (tmp_path / "f").read_text() == "mine"
