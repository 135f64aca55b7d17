"""Hostile arguments to the model's entry points (host-side checks): the padding slot used as a live slot, a live
slot prefilled with nothing, non-finite / non-integer sampling arguments, prompts that are not token ids, and
lengths past max_position_embeddings, refused before anything is allocated; and to loading and saving (dtype,
directory, shard size, overwrite, quantize_checkpoint's), refused before anything is read or written."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax import model as model_module
from metrale_jax.builtin import builtin_model_dir, load_builtin
from metrale_jax.errors import CheckpointError, ConfigError, ShapeError, SlotError
from metrale_jax.model import NemotronH
from metrale_jax.state.cache import ModelCache
from metrale_jax.weights.quantize import quantize_checkpoint


@pytest.fixture(scope="module")
def model():
    return load_builtin()


def _ids(rng, model, *shape):
    return rng.integers(3, model.config.vocab_size, shape).astype(np.int32)


# ---- slots ------------------------------------------------------------------------------------------------
def test_the_padding_slot_is_not_a_live_slot(model, rng):
    cache = model.new_cache(2, 32)
    pad = cache.padding_slot
    ids = _ids(rng, model, 2, 5)
    with pytest.raises(SlotError, match=rf"the padding slot {pad} is not a live slot; its rows must have length 0, "
                                        r"got lengths \[4\]"):
        model.prefill(cache, [0, pad], ids, [5, 4])
    logits, cache = model.prefill(cache, [0, pad], ids, [5, 0])          # as a no-op row it is fine
    assert logits.shape == (2, model.vocab_size) and np.asarray(cache.seq_lens)[0] == 5
    with pytest.raises(SlotError, match=rf"holds the padding slot {pad}, which holds no sequence to decode"):
        model.decode(cache, [0, pad], ids[:, 0])
    with pytest.raises(SlotError, match="padding slot"):
        model.decode(cache, [pad], ids[:1, 0])


@pytest.mark.parametrize("continue_from_cache", [False, True])
def test_a_live_slot_prefilled_with_nothing_is_an_error(model, rng, continue_from_cache):
    cache = model.new_cache(3, 32)
    _, cache = model.prefill(cache, [0, 1], _ids(rng, model, 2, 4))
    with pytest.raises(ShapeError, match=r"lengths: live slots \[1\] are given 0 tokens"):
        model.prefill(cache, [0, 1], _ids(rng, model, 2, 4), [3, 0], continue_from_cache=continue_from_cache)


# ---- generate's arguments ---------------------------------------------------------------------------------
@pytest.mark.parametrize("field, kwargs", [
    ("temperature", {"temperature": float("nan")}), ("temperature", {"temperature": float("inf")}),
    ("temperature", {"temperature": -0.5}), ("temperature", {"temperature": "0.5"}),
    ("temperature", {"temperature": None}), ("top_p", {"top_p": float("nan")}), ("top_p", {"top_p": 1.5}),
    ("max_new_tokens", {"max_new_tokens": 2.5}), ("max_new_tokens", {"max_new_tokens": "3"}),
    ("max_new_tokens", {"max_new_tokens": True}), ("max_new_tokens", {"max_new_tokens": -1}),
    ("max_new_tokens", {"max_new_tokens": np.float64(2.0)}), ("seed", {"seed": 2 ** 63}), ("seed", {"seed": 1.5}),
])
def test_generate_refuses_bad_sampling_arguments_by_name(model, field, kwargs):
    args = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(ConfigError) as e:
        model.generate([[1, 40, 50]], **args)
    assert e.value.field == field and str(e.value).startswith(f"{field}: expected")


def test_numpy_scalars_are_fine_arguments(model, rng):
    prompt = _ids(rng, model, 6)
    got = model.generate([prompt], np.int64(3), temperature=np.float32(0.0), seed=np.int32(4))
    want = model.generate([prompt.tolist()], 3)
    assert got[0].tokens == want[0].tokens


@pytest.mark.parametrize("prompt, shown", [
    ([1.0, 2.0], "list of float64[2]"), (["1", "2"], "list of <U1[2]"), (b"\x05\x06", "bytes are not token ids"),
    (bytearray(b"\x05\x06"), "bytes are not token ids"), ([[1, 2]], "list of int64[1, 2]"),
    (np.array([1.5, 2.0]), "ndarray of float64[2]"), ([1, True], "list of bool"), ((1, 2 ** 70), "tuple of object"),
    ({1, 2}, "got set"),
])
def test_prompts_that_are_not_token_ids_are_refused(model, prompt, shown):
    with pytest.raises(ShapeError) as e:
        model.generate([[1, 40], prompt], 2)
    assert str(e.value).startswith("prompts[1]: ") and shown in str(e.value), str(e.value)


def test_empty_and_ragged_batches_are_shape_errors(model):
    """numpy's own errors (a reduction over no rows, an inhomogeneous nested list) are not the message."""
    with pytest.raises(ShapeError, match=r"ids: expected integer token ids \[B, T\] with B >= 1, got int32\[0, 5\]"):
        model.score(np.ones((0, 5), np.int32))
    with pytest.raises(ShapeError, match="ids: expected a rectangular array of integers, got ragged or mixed list"):
        model.score([[1, 2, 3], [1, 2]])
    with pytest.raises(ShapeError, match=r"prompts\[1\]: expected a rectangular array of integers"):
        model.generate([[1, 2], [1, [2, 3]]], 2)


def test_a_text_prompt_that_is_not_unicode(model):
    with pytest.raises(ShapeError, match=r"prompts\[0\]: not valid Unicode text"):
        model.generate(["abc\udcff"], 2)


# ---- lengths past what the model supports -----------------------------------------------------------------
@pytest.fixture
def no_allocation(monkeypatch):
    """Fails the test if a cache is allocated."""
    def refuse(*args, **kwargs):
        raise AssertionError("a cache was allocated")
    monkeypatch.setattr(ModelCache, "for_config", classmethod(refuse))


def test_generate_past_max_position_embeddings_is_refused_before_allocating(model, no_allocation, rng):
    limit = model.config.max_position_embeddings
    for prompt_len, new in ((5, 100_000_000), (5, limit - 4), (limit, 1)):
        with pytest.raises(ConfigError, match=rf"max_new_tokens: a prompt of {prompt_len} tokens \+ {new} new tokens "
                                              rf"exceeds the model's max_position_embeddings {limit}"):
            model.generate([_ids(rng, model, prompt_len).tolist()], new)
    with pytest.raises(ConfigError, match=rf"max_len: expected an integer in \[1, {limit}\] \(the model's "
                                          r"max_position_embeddings\), got 100000000"):
        model.new_cache(1, 100_000_000)


def test_a_cache_larger_than_the_devices_memory_is_refused_before_allocating(model, monkeypatch):
    """A config may set max_position_embeddings to 10**15, which lifts the length guard: the cache's own bytes (a
    shape evaluation) are then checked against what the devices hold (here the host's memory)."""
    monkeypatch.setattr(model, "config", dataclasses.replace(model.config, max_position_embeddings=10 ** 15))
    limit = model_module.memory_limit(jax.devices()[:1])
    assert limit is not None and limit > 2 ** 30
    fits = model.new_cache(2, 64)
    assert fits.max_len == 64
    with pytest.raises(ConfigError, match=r"max_len: a cache of 2 slots x 1000000000000 positions needs [\d,.]+ GiB, "
                                          r"more than the [\d,.]+ GiB its devices hold"):
        model.new_cache(2, 10 ** 12)                   # petabytes: allocating them would be a crash, not this error


def test_generate_right_at_the_limit_runs(model, rng):
    """A prompt + new tokens of exactly max_position_embeddings: the cache is capped there, not at its bucket."""
    limit = model.config.max_position_embeddings
    out = model.generate([_ids(rng, model, limit - 2).tolist()], 2)
    assert 1 <= len(out[0].tokens) + (out[0].finish_reason == "eos") <= 2


@pytest.mark.parametrize("entry", ["score", "forward"])
def test_rows_past_max_position_embeddings_are_refused(model, no_allocation, entry):
    T = model.config.max_position_embeddings + 1
    with pytest.raises(ShapeError, match=rf"ids: {T} tokens per row exceed the model's max_position_embeddings"):
        getattr(model, entry)(np.ones((1, T), np.int32))


# ---- loading and saving arguments -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["foo", jnp.int8, jnp.float8_e4m3fn, None, "float64"])
def test_from_pretrained_refuses_a_dtype_the_layers_do_not_compute_in(monkeypatch, dtype):
    """"foo" was a TypeError from deep in the cast, float8 loaded a model of E4M3 norms and embeddings: refused by
    name before any weight is read."""
    def refuse(*args, **kwargs):
        raise AssertionError("the checkpoint was read")
    monkeypatch.setattr(model_module, "read_checkpoint", refuse)
    with pytest.raises(ConfigError, match=r"^dtype: expected one of float32, bfloat16, float16, got ") as e:
        NemotronH.from_pretrained(builtin_model_dir(), dtype=dtype, progress=False)
    assert e.value.field == "dtype"


@pytest.mark.parametrize("directory", [None, 3, ["a/b"]])
def test_from_pretrained_refuses_a_directory_that_is_not_a_path(directory):
    with pytest.raises(ConfigError, match="expected a checkpoint directory or a hub repository name") as e:
        NemotronH.from_pretrained(directory, progress=False)
    assert e.value.field == "directory"


@pytest.mark.parametrize("kwargs, field", [({"max_shard_bytes": "2GB"}, "max_shard_bytes"),
                                           ({"max_shard_bytes": None}, "max_shard_bytes"),
                                           ({"max_shard_bytes": 0}, "max_shard_bytes"),
                                           ({"max_shard_bytes": 1.5e9}, "max_shard_bytes"),
                                           ({"overwrite": "no"}, "overwrite"), ({"overwrite": 1}, "overwrite")])
def test_save_pretrained_refuses_bad_arguments_before_writing(model, tmp_path, kwargs, field):
    """A string or None shard size was a TypeError mid-write; overwrite="no" read as consent and replaced the
    checkpoint: both are ConfigErrors naming the argument, with the existing checkpoint untouched."""
    d = tmp_path / "ckpt"
    model.save_pretrained(d)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    with pytest.raises(ConfigError) as e:
        model.save_pretrained(d, **{"overwrite": True, **kwargs})
    assert e.value.field == field
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before


def test_save_pretrained_to_the_current_directory_and_not_the_root(model, tmp_path, monkeypatch):
    """"" is the current directory (its real name: the staging directory goes beside it), the root has no place
    beside it: a CheckpointError, not ValueError('has an empty name')."""
    monkeypatch.chdir(tmp_path)
    model.save_pretrained("")
    assert NemotronH.from_pretrained(tmp_path, progress=False).config == model.config
    with pytest.raises(CheckpointError, match="the filesystem root cannot be replaced"):
        model.save_pretrained("/", overwrite=True)


@pytest.mark.parametrize("kwargs, field", [({"shard_bytes": "1"}, "shard_bytes"), ({"exclude": "lm_head"}, "exclude"),
                                           ({"exclude": [3]}, "exclude")])
def test_quantize_checkpoint_refuses_bad_arguments(tmp_path, kwargs, field):
    """exclude="lm_head" excluded the single letters l, m, _, ... (nothing) and wrote them into the config."""
    with pytest.raises(ConfigError) as e:
        quantize_checkpoint(builtin_model_dir(), tmp_path / "q", "fp8-block", **kwargs)
    assert e.value.field == field and not (tmp_path / "q").exists()


@pytest.mark.parametrize("fmt", ["fp4", "FP8", "nvfp4 ", None, 8])
def test_quantize_checkpoint_refuses_a_misspelt_format_before_reading(tmp_path, fmt):
    """A format not among fp8-block / fp8 / nvfp4 is a ConfigError naming `format`, raised before the source is read
    (a missing source directory is not what the caller hears about) and before anything is written."""
    with pytest.raises(ConfigError) as e:
        quantize_checkpoint(tmp_path / "no-such-dir", tmp_path / "q", fmt)
    assert e.value.field == "format" and "fp8-block" in str(e.value) and not (tmp_path / "q").exists()
