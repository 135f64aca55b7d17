"""Writing checkpoints safely (save_pretrained, quantize_checkpoint): atomic (a writer killed at any file leaves
the old checkpoint or the new one, never a mixture), never over an existing checkpoint without overwrite=True,
never deleting a file the library did not write, and never leaving a stale shard or index to be loaded."""

import os

import jax
import numpy as np
import pytest

from metrale_jax import files
from metrale_jax.builtin import load_builtin
from metrale_jax.errors import CheckpointError
from metrale_jax.model import NemotronH
from metrale_jax.tokenizer import ByteTokenizer
from metrale_jax.weights.quantize import quantize_checkpoint
from metrale_jax.weights.safetensors_io import SafetensorsFile

SHARD = 1 << 20                                                # the built-in model (5 MB) in 5-6 shards


@pytest.fixture(scope="module")
def old_model():
    return load_builtin()


@pytest.fixture
def new_model(old_model, rng):
    """Fresh random weights of the built-in model's config: a checkpoint that differs in every tensor."""
    key = jax.random.key(int(rng.integers(2 ** 31)))
    return NemotronH.from_config(old_model.config, key, dtype=old_model.dtype, tokenizer=ByteTokenizer())


def _tree(d) -> dict[str, bytes | str]:
    """Every entry under d: file bytes, or a symlink's target."""
    out = {}
    for root, dirs, names in os.walk(d):
        for name in dirs + names:
            p = os.path.join(root, name)
            rel = os.path.relpath(p, d)
            if os.path.islink(p):
                out[rel] = "-> " + os.readlink(p)
            elif os.path.isfile(p):
                with open(p, "rb") as fh:
                    out[rel] = fh.read()
    return out


def _same_weights(directory, model):
    got = NemotronH.from_pretrained(directory, dtype=model.dtype, progress=False).state_dict()
    want = model.state_dict()
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name].view(np.uint8), want[name].view(np.uint8), err_msg=name)


def _siblings(d) -> list[str]:
    return sorted(os.listdir(d.parent))


# ---- refusing and keeping -------------------------------------------------------------------------
def test_an_existing_checkpoint_is_replaced_only_with_overwrite(tmp_path, old_model, new_model):
    d = tmp_path / "ckpt"
    old_model.save_pretrained(d)
    before = _tree(d)
    with pytest.raises(CheckpointError, match=rf"{d}: already holds a checkpoint \(byte_tokenizer.json, config.json, "
                                              r"model.safetensors\); pass overwrite=True"):
        new_model.save_pretrained(d)
    assert _tree(d) == before
    new_model.save_pretrained(d, overwrite=True)
    _same_weights(d, new_model)
    assert _siblings(d) == ["ckpt"]                            # no temporary directory left beside it


def test_files_the_library_did_not_write_are_kept(tmp_path, old_model, new_model, rng):
    d = tmp_path / "ckpt"
    (d / "runs" / "1").mkdir(parents=True)
    mine = {"notes.txt": rng.bytes(100), "runs/1/log.bin": rng.bytes(1000), "optimizer.safetensors": rng.bytes(64)}
    for rel, data in mine.items():
        (d / rel).write_bytes(data)
    (d / "latest").symlink_to("runs/1")
    old_model.save_pretrained(d)                               # no checkpoint there yet: no overwrite needed
    new_model.save_pretrained(d, overwrite=True)
    _same_weights(d, new_model)
    tree = _tree(d)
    assert {rel: tree[rel] for rel in mine} == mine and tree["latest"] == "-> runs/1"
    assert sorted(os.listdir(d)) == sorted(["runs", "latest", "notes.txt", "optimizer.safetensors", "config.json",
                                            "model.safetensors", "byte_tokenizer.json"])


def test_a_fifo_in_the_target_stops_the_write_before_anything_changes(tmp_path, old_model, new_model):
    d = tmp_path / "ckpt"
    old_model.save_pretrained(d)
    os.mkfifo(d / "pipe")
    before = _tree(d)
    with pytest.raises(CheckpointError, match=rf"{d / 'pipe'}: a FIFO cannot be carried"):
        new_model.save_pretrained(d, overwrite=True)
    assert _tree(d) == before and (d / "pipe").exists() and _siblings(d) == ["ckpt"]


# ---- stale files ----------------------------------------------------------------------------------
@pytest.mark.parametrize("first, second", [(SHARD, 2 ** 40), (2 ** 40, SHARD), (SHARD, SHARD // 2)])
def test_no_stale_shard_or_index_survives_a_save(tmp_path, old_model, new_model, first, second):
    d = tmp_path / "ckpt"
    old_model.save_pretrained(d, max_shard_bytes=first)
    files_ = new_model.save_pretrained(d, max_shard_bytes=second, overwrite=True)
    weights = sorted(n for n in os.listdir(d) if n.endswith((".safetensors", ".json")))
    assert weights == sorted([f.name for f in files_] + ["config.json", "byte_tokenizer.json"]
                             + (["model.safetensors.index.json"] if len(files_) > 1 else []))
    _same_weights(d, new_model)


def test_quantize_over_an_older_sharded_checkpoint(tmp_path, old_model, new_model):
    """The issue's case: a sharded quantized checkpoint in out, then a single-file one quantized from other
    weights. Refused without overwrite; with it, the new weights load (not the old index's)."""
    src_old, src_new, out = tmp_path / "old", tmp_path / "new", tmp_path / "out"
    old_model.save_pretrained(src_old)
    new_model.save_pretrained(src_new)
    assert len(quantize_checkpoint(src_old, out, "fp8-block", shard_bytes=SHARD)["files"]) > 1
    before = _tree(out)
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        quantize_checkpoint(src_new, out, "fp8-block")
    assert _tree(out) == before
    assert quantize_checkpoint(src_new, out, "fp8-block", overwrite=True)["files"] == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists() and _siblings(out) == ["new", "old", "out"]
    quantize_checkpoint(src_new, tmp_path / "want", "fp8-block")
    assert _tree(out) == _tree(tmp_path / "want")


# ---- interrupted writes ---------------------------------------------------------------------------
def _writers(old_model, new_model, tmp_path):
    """(name, write the new checkpoint over d, write the old one into d): single file, sharded, quantized."""
    src_old, src_new = tmp_path / "src_old", tmp_path / "src_new"
    old_model.save_pretrained(src_old)
    new_model.save_pretrained(src_new)
    return {
        "single": (lambda d: new_model.save_pretrained(d, overwrite=True), lambda d: old_model.save_pretrained(d)),
        "sharded": (lambda d: new_model.save_pretrained(d, max_shard_bytes=SHARD, overwrite=True),
                    lambda d: old_model.save_pretrained(d, max_shard_bytes=SHARD // 2)),
        "quantized": (lambda d: quantize_checkpoint(src_new, d, "nvfp4", shard_bytes=SHARD, overwrite=True),
                      lambda d: quantize_checkpoint(src_old, d, "fp8", shard_bytes=SHARD)),
    }


class Killed(BaseException):
    """Stands for the writer's process dying: not an Exception, so nothing on the way catches it."""


def _killing_at(k: int, real, calls: list):
    def create(path):
        calls.append(path)
        if len(calls) == k:
            raise Killed(f"killed at file {k}: {path}")
        return real(path)
    return create


@pytest.mark.parametrize("kind", ["single", "sharded", "quantized"])
@pytest.mark.parametrize("cleanup", [True, False], ids=["raised", "killed"])
def test_a_write_killed_at_any_file_leaves_the_old_checkpoint(tmp_path, monkeypatch, old_model, new_model, kind,
                                                               cleanup):
    """Each file the write creates is, in turn, the one it dies at; then the directory holds exactly the old
    checkpoint (and loads). 'killed': no cleanup runs at all (shutil.rmtree disabled), as after a real kill."""
    write_new, write_old = _writers(old_model, new_model, tmp_path)[kind]
    real = files.create
    calls: list = []
    monkeypatch.setattr(files, "create", _killing_at(0, real, calls))
    write_new(tmp_path / "count")
    n = len(calls)
    assert n >= 3, calls
    if not cleanup:
        monkeypatch.setattr(files.shutil, "rmtree", lambda *a, **k: None)
    for k in range(1, n + 1):
        d = tmp_path / f"k{k}" / "ckpt"
        write_old(d)
        before = _tree(d)
        calls.clear()
        monkeypatch.setattr(files, "create", _killing_at(k, real, calls))
        with pytest.raises(Killed):
            write_new(d)
        monkeypatch.setattr(files, "create", real)
        assert _tree(d) == before, f"killed at file {k} of {n}"
        assert NemotronH.from_pretrained(d, progress=False) is not None
        if cleanup:
            assert _siblings(d) == ["ckpt"]
    write_new(d)                                               # and a write after the kill goes through
    assert _tree(d) == _tree(tmp_path / "count")


def test_a_write_killed_in_the_swap_leaves_the_old_checkpoint(tmp_path, monkeypatch, old_model, new_model):
    """The commit itself: the atomic exchange fails; or, where there is none, the second of the fallback's two
    renames fails (the old directory is put back)."""
    d = tmp_path / "ckpt"
    old_model.save_pretrained(d)
    before = _tree(d)

    def broken_exchange(a, b):
        raise Killed("killed in the exchange")
    monkeypatch.setattr(files, "exchange", broken_exchange)
    with pytest.raises(Killed):
        new_model.save_pretrained(d, overwrite=True)
    assert _tree(d) == before and _siblings(d) == ["ckpt"]

    monkeypatch.setattr(files, "exchange", lambda a, b: False)       # no RENAME_EXCHANGE on this filesystem
    real_rename, renames = os.rename, []

    def rename(a, b):
        renames.append((a, b))
        if len(renames) == 2:
            raise Killed("killed between the renames")
        return real_rename(a, b)
    monkeypatch.setattr(files.os, "rename", rename)
    with pytest.raises(Killed):
        new_model.save_pretrained(d, overwrite=True)
    monkeypatch.setattr(files.os, "rename", real_rename)
    assert _tree(d) == before and _siblings(d) == ["ckpt"]
    new_model.save_pretrained(d, overwrite=True)               # the fallback path, completed
    _same_weights(d, new_model)


def test_the_fallback_without_exchange_replaces_whole(tmp_path, monkeypatch, old_model, new_model):
    d = tmp_path / "ckpt"
    old_model.save_pretrained(d, max_shard_bytes=SHARD)
    (d / "notes.txt").write_text("mine")
    monkeypatch.setattr(files, "exchange", lambda a, b: False)
    new_model.save_pretrained(d, overwrite=True)
    _same_weights(d, new_model)
    assert (d / "notes.txt").read_text() == "mine" and _siblings(d) == ["ckpt"]
    assert not (d / "model.safetensors.index.json").exists()


def test_save_safetensors_replaces_a_file_whole(tmp_path, monkeypatch, rng):
    """The single-file writer: killed mid-file, the old file stays and no partial file is left."""
    from metrale_jax.weights.safetensors_io import save_safetensors
    path = tmp_path / "x.safetensors"
    old = {"a": rng.standard_normal(8).astype(np.float32)}
    save_safetensors(path, old)
    before = path.read_bytes()

    class Dying:
        def __init__(self, fh):
            self.fh = fh

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.fh.close()

        def write(self, data):
            self.fh.write(data[:3])
            raise Killed("killed mid-file")
    real = files.create
    monkeypatch.setattr(files, "create", lambda p: Dying(real(p)))
    with pytest.raises(Killed):
        save_safetensors(path, {"a": rng.standard_normal(8).astype(np.float32)})
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["x.safetensors"]
    f = SafetensorsFile(path)
    np.testing.assert_array_equal(f.get("a"), old["a"])
    f.close()

