"""Checkpoints by hub name, offline: a Hugging Face cache laid out as the hub client makes it (models--org--name/
snapshots/<rev>/ files as symlinks into blobs/, refs/main) is found by from_pretrained("org/name") and the CLI's
--model ORG/NAME; the library opens files by name inside the snapshot only; a name found nowhere is one
ModelNotFoundError (one CLI line); without HF_HUB_OFFLINE a name missing from the cache is downloaded, with only a
checkpoint's files asked for."""

import hashlib
import os
import sys

import numpy as np
import pytest

from metrale_jax import cli, hub
from metrale_jax.builtin import builtin_model_dir
from metrale_jax.errors import ModelNotFoundError
from metrale_jax.model import NemotronH


def make_hub_cache(root, repo="org/tiny", extra=None):
    """The built-in model's files (and `extra` {name: text}) as the hub client caches repo at a random revision."""
    rev = hashlib.sha1(os.urandom(8)).hexdigest()
    d = root / ("models--" + repo.replace("/", "--"))
    blobs, snap = d / "blobs", d / "snapshots" / rev
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    files = {f.name: f.read_bytes() for f in builtin_model_dir().iterdir() if f.name != "train_log.json"}
    files.update({k: v.encode() for k, v in (extra or {}).items()})
    for name, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        (blobs / sha).write_bytes(data)
        (snap / name).symlink_to(os.path.join("..", "..", "blobs", sha))
    (d / "refs").mkdir()
    (d / "refs" / "main").write_text(rev)
    return snap


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub"


@pytest.fixture
def opened(monkeypatch):
    """Every path the library opens through os.open, as given."""
    paths, real = [], os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: paths.append(os.fspath(p)) or real(p, *a, **k))
    return paths


def test_from_pretrained_by_name_reads_the_local_cache(cache, opened):
    snap = make_hub_cache(cache, extra={"tokenizer_config.json": '{"add_bos_token": false}'})
    opened.clear()
    model = NemotronH.from_pretrained("org/tiny", dtype=np.float32)
    want = NemotronH.from_pretrained(builtin_model_dir(), dtype=np.float32).state_dict()
    got = model.state_dict()
    assert set(got) == set(want)
    for n in want:
        np.testing.assert_array_equal(got[n], want[n], err_msg=n)
    assert model.tokenizer.encode("ab") == [100, 101]                  # its tokenizer_config.json was read
    mine = [p for p in opened if "models--org--tiny" in p]
    assert mine and all(os.path.dirname(p) == str(snap) for p in mine), mine   # by name, inside the snapshot


def test_cli_takes_a_hub_name_and_a_missing_one_is_one_line(cache, capsys):
    make_hub_cache(cache)
    assert cli.main(["info", "--model", "org/tiny", "--json"]) == 0
    assert '"pattern": "M*-EM-"' in capsys.readouterr().out
    assert cli.main(["info", "--model", "org/absent"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("metrale-jax: error: --model org/absent: no such directory, and "
                                                   "not in the local Hugging Face cache") and "HF_HUB_OFFLINE" in err


def test_names_found_nowhere_are_one_model_not_found_error(cache, tmp_path, monkeypatch):
    with pytest.raises(ModelNotFoundError, match=r"org/absent: .*HF_HUB_OFFLINE is set"):
        NemotronH.from_pretrained("org/absent")
    with pytest.raises(ModelNotFoundError, match="no such directory \\(nor a hub repository name"):
        hub.resolve_checkpoint(tmp_path / "a" / "b" / "c")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelNotFoundError, match="not a directory"):
        hub.resolve_checkpoint(tmp_path / "file")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)           # the [hub] extra not installed
    with pytest.raises(ModelNotFoundError, match=r"install huggingface_hub \(pip install 'metrale-jax\[hub\]'\)"):
        hub.resolve_checkpoint("org/tiny")


def test_online_a_name_missing_from_the_cache_is_downloaded_with_a_checkpoints_files_only(cache, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []

    def fake_download(repo_id, **kw):
        calls.append(kw)
        if kw.get("local_files_only"):
            raise LocalEntryNotFoundError("not cached")
        return str(make_hub_cache(cache, repo_id))                     # what a download leaves in the cache

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    path = hub.resolve_checkpoint("org/fresh")
    assert (path / "config.json").is_file() and [c.get("local_files_only", False) for c in calls] == [True, False]
    assert calls[1]["allow_patterns"] == hub.CHECKPOINT_PATTERNS and calls[1]["cache_dir"] == cache
    def unreachable(repo_id, **kw):
        raise LocalEntryNotFoundError("not cached") if kw.get("local_files_only") else OSError("no route to host")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ModelNotFoundError, match="not downloadable \\(OSError: no route to host\\)"):
        hub.resolve_checkpoint("org/unreachable")
