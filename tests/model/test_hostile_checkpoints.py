"""Hostile checkpoints, each built from a copy of the built-in model as a user would get it: index entries that
point outside the directory, malformed safetensors headers / index files / config.json, FIFOs named like weights
files, non-finite config floats and weights. Every one is a typed error naming the file and the tensor or field;
nothing outside the checkpoint directory is opened."""

import builtins
import io
import json
import math
import os
import shutil
import struct
import threading

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors

from metrale_jax.builtin import builtin_model_dir
from metrale_jax.config import ModelConfig
from metrale_jax.errors import CheckpointError, ConfigError
from metrale_jax.model import NemotronH
from metrale_jax.weights import checkpoint
from metrale_jax.weights.checkpoint import expected_tensors, mtp_tensors, tensor_count
from metrale_jax.weights.quantize import quantize_checkpoint
from metrale_jax.weights.safetensors_io import SafetensorsFile, save_safetensors

INDEX = "model.safetensors.index.json"


@pytest.fixture
def ckpt(tmp_path):
    """A private copy of the built-in checkpoint."""
    return shutil.copytree(builtin_model_dir(), tmp_path / "ckpt")


@pytest.fixture
def opened(monkeypatch):
    """Every path opened through builtins.open, io.open (pathlib), os.open or safetensors.safe_open, absolute
    (a test clears the list once its set-up is done)."""
    paths: list[str] = []

    def recording(real):
        def wrapper(file, *args, **kwargs):
            if isinstance(file, (str, bytes, os.PathLike)):
                paths.append(os.path.abspath(os.fsdecode(file)))
            return real(file, *args, **kwargs)
        return wrapper

    for owner, name in ((builtins, "open"), (io, "open"), (os, "open"), (safetensors, "safe_open")):
        monkeypatch.setattr(owner, name, recording(getattr(owner, name)))
    return paths


def _under(paths, directory) -> list[str]:
    root = os.path.abspath(directory) + os.sep
    return [p for p in paths if p.startswith(root)]


def _header(path):
    """(header dict, data bytes) of a safetensors file."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def _rewrite(path, header=None, raw: bytes | None = None, length: int | None = None):
    """Replace a safetensors file's header (a dict, or raw bytes; `length` overrides the stated size), keeping
    its data bytes."""
    _, data = _header(path)
    head = raw if raw is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head) if length is None else length) + head + data)


def _by_offset(header):
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _finishes(fn, seconds=60):
    """Run fn in a thread; (finished in time, what it raised). A blocking open never returns: the thread is a
    daemon, so a failing test still ends."""
    out = {}

    def target():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive(), out.get("error")


# ---- the probe ----------------------------------------------------------------------------------
def test_the_open_probe_sees_every_route(tmp_path, opened):
    """The probe the next tests rely on records an outside path whichever way it is opened."""
    target = tmp_path / "outside" / "x.safetensors"
    target.parent.mkdir()
    save_safetensors(target, {"a": np.zeros(2, np.float32)})
    routes = [lambda: open(target, "rb").close(), lambda: target.read_bytes(),
              lambda: os.close(os.open(target, os.O_RDONLY)),
              lambda: safetensors.safe_open(str(target), framework="numpy").keys()]
    for k, route in enumerate(routes):
        before = len(opened)
        route()
        assert _under(opened[before:], target.parent) == [str(target)], k


# ---- index entries ------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["../outside/model.safetensors", "ABSOLUTE", "sub/model.safetensors", "..", "",
                                   "./model.safetensors"])
def test_index_entries_must_be_plain_names_inside_the_directory(ckpt, tmp_path, opened, entry):
    """An index naming a shard outside the directory (relative, absolute or in a subfolder) is refused before any
    shard is opened; the outside file, a valid checkpoint, is never read."""
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(ckpt / "model.safetensors", outside / "model.safetensors")
    (ckpt / "sub").mkdir()
    shutil.copy(ckpt / "model.safetensors", ckpt / "sub" / "model.safetensors")
    entry = str(outside / "model.safetensors") if entry == "ABSOLUTE" else entry
    names = SafetensorsFile(ckpt / "model.safetensors").keys()
    (ckpt / INDEX).write_text(json.dumps({"weight_map": {n: entry for n in names}}))
    opened.clear()                                            # from here on: the library's opens
    with pytest.raises(CheckpointError, match="not a plain file name inside the checkpoint directory") as e:
        NemotronH.from_pretrained(ckpt, progress=False)
    assert str(ckpt / INDEX) in str(e.value) and repr(entry) in str(e.value)
    assert _under(opened, outside) == [] and _under(opened, ckpt / "sub") == []


def test_symlinked_shards_like_the_hf_cache_load(tmp_path, opened, rng):
    """HF's cache layout: snapshots/<rev>/<file> are symlinks into blobs/. Sharded, through an index; the files
    are opened by their names inside the snapshot directory."""
    src = builtin_model_dir()
    blobs, snap = tmp_path / "hub" / "blobs", tmp_path / "hub" / "snapshots" / "rev"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    reader = SafetensorsFile(src / "model.safetensors")
    names = list(reader.keys())
    cut = int(rng.integers(1, len(names)))                   # a random split into two shards
    shards = {"model-00001-of-00002.safetensors": names[:cut], "model-00002-of-00002.safetensors": names[cut:]}
    for k, (fname, part) in enumerate(shards.items()):
        save_safetensors(blobs / f"sha{k}", {n: reader.get(n) for n in part})
        (snap / fname).symlink_to(os.path.relpath(blobs / f"sha{k}", snap))
    (blobs / "idx").write_text(json.dumps({"weight_map": {n: f for f, part in shards.items() for n in part}}))
    (snap / INDEX).symlink_to(os.path.relpath(blobs / "idx", snap))
    for f in ("config.json", "byte_tokenizer.json"):
        shutil.copy(src / f, blobs / f)
        (snap / f).symlink_to(os.path.relpath(blobs / f, snap))
    opened.clear()                                            # from here on: the library's opens
    model = NemotronH.from_pretrained(snap, progress=False)
    want = {n: reader.get(n) for n in names}
    got = model.state_dict()
    for n in names:
        np.testing.assert_array_equal(got[n].view(np.uint8), want[n].view(np.uint8), err_msg=n)
    assert _under(opened, blobs) == [] and len(_under(opened, snap)) >= 3


# ---- safetensors headers ------------------------------------------------------------------------
def _negative_offsets(h):
    first = _by_offset(h)[0]
    b, e = h[first]["data_offsets"]
    h[first]["data_offsets"] = [b - 64, e - 64]                # would read the header's own bytes
    return first


def _overlapping(h):
    names = _by_offset(h)
    size = lambda n: h[n]["data_offsets"][1] - h[n]["data_offsets"][0]
    a, b = next((a, b) for a in names for b in names if a < b and size(a) == size(b))
    h[b]["data_offsets"] = list(h[a]["data_offsets"])           # two tensors on the same bytes
    return a, b                                                # the library names either


def _float_offsets(h):
    first = _by_offset(h)[0]
    h[first]["data_offsets"] = [float(x) for x in h[first]["data_offsets"]]
    return first


def _number_entry(h):
    first = _by_offset(h)[0]
    h[first] = 3
    return first


def _wrong_shape(h):
    first = _by_offset(h)[0]
    h[first]["shape"] = [3]
    return first


def _unknown_dtype(h):
    first = _by_offset(h)[0]
    h[first]["dtype"] = "Q9"
    return first


@pytest.mark.parametrize("mutate", [_negative_offsets, _overlapping, _float_offsets, _number_entry, _wrong_shape,
                                    _unknown_dtype, "list", "deep", "non-utf8", "length past the end", "empty"])
def test_malformed_headers_are_checkpoint_errors_naming_the_file(ckpt, mutate):
    path = ckpt / "model.safetensors"
    header, _ = _header(path)
    if mutate == "list":
        _rewrite(path, raw=json.dumps(list(header.values())).encode())
    elif mutate == "deep":
        _rewrite(path, raw=b'{"a":' * 50_000 + b"1" + b"}" * 50_000)
    elif mutate == "non-utf8":
        _rewrite(path, raw=json.dumps(header).encode().replace(b'"format"', b'"f\xffrmat"', 1))
    elif mutate == "length past the end":
        _rewrite(path, header, length=2 ** 40)
    elif mutate == "empty":
        path.write_bytes(b"")
    else:
        hit = mutate(header)
        _rewrite(path, header)
    with pytest.raises(CheckpointError) as e:
        NemotronH.from_pretrained(ckpt, progress=False)
    assert str(path) in str(e.value)
    if callable(mutate):                                       # the tensor at fault is named
        hits = hit if isinstance(hit, tuple) else (hit,)
        assert any(f"tensor {n}" in str(e.value) or f"tensor `{n}`" in str(e.value) for n in hits), str(e.value)


def test_headers_are_read_without_the_data(tmp_path):
    """A 64 GiB sparse file opens at once: only the header is read (the data is mapped, not loaded)."""
    path = tmp_path / "big.safetensors"
    head = json.dumps({"w": {"dtype": "U8", "shape": [64, 2 ** 30], "data_offsets": [0, 2 ** 36]}}).encode()
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(head)) + head)
        fh.truncate(8 + len(head) + 2 ** 36)
    ok, err = _finishes(lambda: SafetensorsFile(path).info("w"), seconds=10)
    assert ok and err is None, err


# ---- index and config files ---------------------------------------------------------------------
BAD_JSON = {"non-utf8": b'{"weight_map": {"\xff": 1}}', "deep": b"[" * 100_000 + b"]" * 100_000,
            "bignum": b'{"weight_map": {}, "n": ' + b"7" * 5000 + b"}", "list": b"[]", "truncated": b'{"weight_map": '}


@pytest.mark.parametrize("kind", [*BAD_JSON, "weight_map list", "weight_map number entry"])
def test_malformed_index_files_are_checkpoint_errors_naming_the_index(ckpt, kind):
    names = SafetensorsFile(ckpt / "model.safetensors").keys()
    raw = {"weight_map list": json.dumps({"weight_map": ["model.safetensors"]}).encode(),
           "weight_map number entry": json.dumps({"weight_map": {n: 7 for n in names}}).encode()}
    (ckpt / INDEX).write_bytes(BAD_JSON.get(kind) or raw[kind])
    with pytest.raises(CheckpointError) as e:
        NemotronH.from_pretrained(ckpt, progress=False)
    assert str(ckpt / INDEX) in str(e.value)


@pytest.mark.parametrize("kind", ["non-utf8", "deep", "bignum", "list", "truncated"])
def test_malformed_config_json_is_a_config_error_naming_the_file(ckpt, kind):
    good = (ckpt / "config.json").read_bytes()
    raw = {"non-utf8": good.replace(b'"model_type"', b'"m\xffdel_type"', 1),      # inside a valid config
           "bignum": good.replace(b'"vocab_size": 259', b'"vocab_size": ' + b"7" * 5000, 1)}.get(kind, BAD_JSON[kind])
    assert raw != good
    (ckpt / "config.json").write_bytes(raw)
    for load in (lambda: NemotronH.from_pretrained(ckpt, progress=False), lambda: ModelConfig.from_hf(ckpt)):
        with pytest.raises(ConfigError) as e:
            load()
        assert str(ckpt / "config.json") in str(e.value)


# ---- files that are not regular -----------------------------------------------------------------
@pytest.mark.parametrize("name", ["model.safetensors", "shard", INDEX, "config.json", "byte_tokenizer.json"])
def test_a_fifo_named_like_a_checkpoint_file_is_refused_without_blocking(ckpt, name):
    if name == "shard":                                       # a FIFO the index names as a shard
        names = SafetensorsFile(ckpt / "model.safetensors").keys()
        (ckpt / INDEX).write_text(json.dumps({"weight_map": {n: "model-00001-of-00001.safetensors"
                                                             for n in names}}))
        name = "model-00001-of-00001.safetensors"
    (ckpt / name).unlink(missing_ok=True)
    os.mkfifo(ckpt / name)
    ok, err = _finishes(lambda: NemotronH.from_pretrained(ckpt, progress=False))
    assert ok, f"loading blocked on the FIFO {name}"
    assert isinstance(err, (CheckpointError, ConfigError)) and name in str(err), err
    assert "regular file" in str(err), err


def test_a_directory_named_like_a_weights_file_is_refused(ckpt):
    (ckpt / "model.safetensors").unlink()
    (ckpt / "model.safetensors").mkdir()
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a regular file \(a directory\)"):
        NemotronH.from_pretrained(ckpt, progress=False)


# ---- non-finite values --------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("routed_scaling_factor", "nan"), ("routed_scaling_factor", "NaN-literal"),
                                          ("layer_norm_epsilon", "inf"), ("time_step_min", "-inf"),
                                          ("time_step_max", 1e400), ("time_step_limit", ["nan", "inf"]),
                                          ("time_step_limit", [0.0, "nan"])])
def test_config_floats_must_be_finite(ckpt, field, value):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg[field] = value
    text = json.dumps(cfg).replace('"NaN-literal"', "NaN")     # Python's json reads the bare NaN literal too
    (ckpt / "config.json").write_text(text)
    with pytest.raises(ConfigError) as e:
        NemotronH.from_pretrained(ckpt, progress=False)
    assert e.value.field == field and field in str(e.value)


def test_an_infinite_time_step_limit_high_bound_still_loads(ckpt):
    assert ModelConfig.from_hf(ckpt).time_step_limit == (0.0, math.inf)


def _poison(path, name, value, rng):
    """Set one random element of tensor `name` of a safetensors file to `value`."""
    r = SafetensorsFile(path)
    tensors = {n: np.array(r.get(n)) for n in r.keys()}
    r.close()
    flat = tensors[name].reshape(-1)
    flat[rng.integers(flat.size)] = value
    save_safetensors(path, tensors, metadata={"format": "pt"})


def _poison_a_tensor_and_an_expert(ckpt, value, rng, skip: str | None = None) -> list[str]:
    """One random tensor and one random routed expert's weight of the checkpoint (names not starting with skip)
    poisoned with value; returns their names."""
    names = [n for n in SafetensorsFile(ckpt / "model.safetensors").keys() if not (skip and n.startswith(skip))]
    experts = [n for n in names if ".experts." in n]
    hit = [names[int(rng.integers(len(names)))], experts[int(rng.integers(len(experts)))]]
    for name in hit:
        _poison(ckpt / "model.safetensors", name, value, rng)
    return hit


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_check_finite_names_the_weight(ckpt, rng, value):
    """One random tensor and one random routed expert (loaded stacked with its layer's others) poisoned: both
    are named."""
    hit = _poison_a_tensor_and_an_expert(ckpt, value, rng)
    with pytest.raises(CheckpointError) as e:
        NemotronH.from_pretrained(ckpt, progress=False)
    assert sorted(e.value.problems) == sorted({f"{n}: holds NaN or infinite values" for n in hit})
    model = NemotronH.from_pretrained(ckpt, progress=False, check_finite=False)     # the check is what refuses
    assert not np.isfinite(np.asarray(model.state_dict()[hit[0]], np.float32)).all()


def test_check_finite_names_the_weight_on_a_mesh(ckpt, rng):
    """On a (dp=2, tp=2) mesh (the weights split and replicated, the check one program per device set) the same
    tensors are named as on one device (of those a mesh loads: the MTP head is not kept on a mesh)."""
    import jax

    from metrale_jax import sharding

    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    hit = _poison_a_tensor_and_an_expert(ckpt, np.nan, rng, skip="mtp.")
    with pytest.raises(CheckpointError) as e:
        NemotronH.from_pretrained(ckpt, progress=False, mesh=sharding.make_mesh(2, dp=2))
    assert sorted(e.value.problems) == sorted({f"{n}: holds NaN or infinite values" for n in hit})


def test_check_finite_counts_an_overflow_of_the_cast(ckpt, rng):
    """A float32 checkpoint value past float16's range is infinite once loaded as float16."""
    r = SafetensorsFile(ckpt / "model.safetensors")
    tensors = {n: np.array(r.get(n), np.float32) for n in r.keys()}
    r.close()
    name = "backbone.layers.2.mixer.up_proj.weight"
    tensors[name].reshape(-1)[rng.integers(tensors[name].size)] = 1e6
    save_safetensors(ckpt / "model.safetensors", tensors)
    assert NemotronH.from_pretrained(ckpt, dtype=jnp.float32, progress=False) is not None
    with pytest.raises(CheckpointError, match=rf"{name}: holds NaN or infinite values"):
        NemotronH.from_pretrained(ckpt, dtype=jnp.float16, progress=False)


def test_check_finite_reads_quantized_scales(ckpt, tmp_path, rng):
    quantize_checkpoint(ckpt, tmp_path / "q", "fp8-block")
    module = "backbone.layers.0.mixer.in_proj"
    _poison(tmp_path / "q" / "model.safetensors", f"{module}.weight_scale_inv", np.nan, rng)
    with pytest.raises(CheckpointError, match=rf"{module}.weight: holds NaN or infinite values"):
        NemotronH.from_pretrained(tmp_path / "q", progress=False)


# ---- shards that disagree with the index or with each other -------------------------------------
def _split_into_shards(ckpt, cut: int) -> list[str]:
    """model.safetensors replaced by a.safetensors (its first `cut` tensors) and b.safetensors (the rest), no
    index; returns the tensor names."""
    r = SafetensorsFile(ckpt / "model.safetensors")
    names = r.keys()
    tensors = {n: np.array(r.get(n)) for n in names}
    r.close()
    (ckpt / "model.safetensors").unlink()
    save_safetensors(ckpt / "a.safetensors", {n: tensors[n] for n in names[:cut]})
    save_safetensors(ckpt / "b.safetensors", {n: tensors[n] for n in names[cut:]})
    return names


def test_an_index_placing_a_tensor_in_a_shard_without_it_names_both(ckpt, rng):
    """The index sends every tensor to a.safetensors, which holds only some: the header check (which asks the
    shard for each tensor's dtype and shape) names the first misplaced tensor and the shard, instead of a
    KeyError."""
    names = _split_into_shards(ckpt, cut := int(rng.integers(1, 20)))
    (ckpt / INDEX).write_text(json.dumps({"weight_map": dict.fromkeys(names, "a.safetensors")}))
    with pytest.raises(CheckpointError, match="the index places .* here, but the file does not hold it") as e:
        NemotronH.from_pretrained(ckpt, progress=False)
    assert str(ckpt / "a.safetensors") in str(e.value)
    assert any(f" {n} here" in str(e.value) for n in names[cut:]), str(e.value)


def test_a_tensor_in_two_shards_without_an_index_is_refused(ckpt, rng):
    """Without an index every *.safetensors is read; a tensor two of them hold (here with different values) is
    ambiguous, so it is named with both files instead of one copy silently winning."""
    names = _split_into_shards(ckpt, len(SafetensorsFile(ckpt / "model.safetensors").keys()))
    twice = names[int(rng.integers(len(names)))]
    save_safetensors(ckpt / "b.safetensors", {twice: np.full(SafetensorsFile(ckpt / "a.safetensors").info(twice)[1],
                                                             7, np.float32)})
    with pytest.raises(CheckpointError) as e:
        NemotronH.from_pretrained(ckpt, progress=False)
    assert e.value.problems == [f"{twice}: held by 2 files ({ckpt / 'a.safetensors'}, {ckpt / 'b.safetensors'}); "
                                f"expected one (or a {INDEX} saying which)"]


# ---- configs far larger than their checkpoint ---------------------------------------------------
@pytest.mark.parametrize("changes", [{}, {"tie_word_embeddings": True, "use_conv_bias": False},
                                     {"attention_bias": True, "mlp_bias": True, "moe_latent_size": 64},
                                     {"n_shared_experts": 0, "n_routed_experts": 8, "hybrid_override_pattern": "EE*"},
                                     {"num_nextn_predict_layers": 3, "mtp_hybrid_override_pattern": "E*-"}])
def test_tensor_count_counts_what_the_tables_list(changes):
    """tensor_count (which bounds the config before its names are listed) agrees with the listing itself."""
    cfg = ModelConfig.from_hf({**json.loads((builtin_model_dir() / "config.json").read_text()), **changes,
                               "num_hidden_layers": None})
    for mtp in (False, True):
        want = {**expected_tensors(cfg), **(mtp_tensors(cfg) if mtp else {})}
        assert tensor_count(cfg, mtp=mtp) == len(want), (changes, mtp)


@pytest.mark.parametrize("field, value", [("n_routed_experts", 10 ** 8), ("num_nextn_predict_layers", 10 ** 9),
                                          ("hybrid_override_pattern", "M" * 20_000)])
def test_a_config_naming_far_more_tensors_than_the_checkpoint_is_refused_by_its_counts(ckpt, monkeypatch, field,
                                                                                       value):
    """A config whose counts name millions of tensors the files do not hold is refused at once, naming the counts,
    without listing the tensors (n_routed_experts = 10**8 listed is 2e8 names, num_nextn_predict_layers = 10**9 a
    2 GB MTP pattern): the tables are never built."""
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update({field: value, "num_hidden_layers": None})
    (ckpt / "config.json").write_text(json.dumps(cfg))

    def refuse(*args, **kwargs):
        raise AssertionError("the config's tensor names were listed")
    for name in ("model_tensors", "expected_tensors", "mtp_tensors"):
        monkeypatch.setattr(checkpoint, name, refuse)
    ok, err = _finishes(lambda: NemotronH.from_pretrained(ckpt, progress=False), seconds=10)
    assert ok and isinstance(err, CheckpointError), err
    shown = "20000 layers" if field == "hybrid_override_pattern" else f"{field} = {value}"
    assert "the config describes another model" in str(err) and shown in str(err), str(err)
