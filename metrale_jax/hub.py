"""Checkpoints by name: `org/name` resolved to a local snapshot of the Hugging Face hub repository.

`resolve_checkpoint(name)`: an existing directory is itself; otherwise a name of the form `org/name` is looked up
through `huggingface_hub` (the optional extra `[hub]`) in the local HF cache first (HF_HUB_CACHE / HF_HOME, the
hub client's own layout: models--org--name/snapshots/<revision>/ with symlinks into blobs/), then downloaded
(only the files a checkpoint needs), unless HF_HUB_OFFLINE is set. Anything else is one ModelNotFoundError.
The snapshot is read like any checkpoint directory: files by their plain names inside it (symlinks into the
cache's blobs/ are followed as any symlinked file is; no path outside the snapshot is ever opened by name).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from metrale_jax.errors import ConfigError, ModelNotFoundError

# what from_pretrained reads (weights, index, configs, tokenizers); nothing else is downloaded
CHECKPOINT_PATTERNS = ["config.json", "hf_quant_config.json", "*.safetensors", "model.safetensors.index.json",
                       "tokenizer.json", "tokenizer_config.json", "byte_tokenizer.json", "special_tokens_map.json",
                       "generation_config.json"]
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_TRUE = {"1", "ON", "YES", "TRUE"}


def resolve_checkpoint(name: str | os.PathLike) -> Path:
    """The checkpoint directory `name` stands for: itself when it is a directory, else the hub snapshot of the
    repository `org/name` (local cache first, then a download unless offline); ModelNotFoundError otherwise."""
    if not isinstance(name, (str, os.PathLike)):
        raise ConfigError("directory", f"expected a checkpoint directory or a hub repository name 'org/name', got "
                                       f"{type(name).__name__} {name!r:.60}")
    path = Path(name)
    if path.is_dir():
        return path
    if path.exists():
        raise ModelNotFoundError(f"{name}: not a directory")
    if not _REPO_ID.fullmatch(str(name)):
        raise ModelNotFoundError(f"{name}: no such directory (nor a hub repository name 'org/name')")
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError:
        raise ModelNotFoundError(f"{name}: no such directory; to load the hub repository of that name install "
                                 f"huggingface_hub (pip install 'metrale-jax[hub]')") from None
    cache = hub_cache_dir()
    try:
        return Path(huggingface_hub.snapshot_download(str(name), cache_dir=cache, local_files_only=True,
                                                      allow_patterns=CHECKPOINT_PATTERNS))
    except (errors.LocalEntryNotFoundError, errors.HFValidationError, FileNotFoundError):
        pass
    if offline():
        raise ModelNotFoundError(f"{name}: no such directory, and not in the local Hugging Face cache {cache} "
                                 f"(HF_HUB_OFFLINE is set, so nothing is downloaded)")
    try:
        return Path(huggingface_hub.snapshot_download(str(name), cache_dir=cache,
                                                      allow_patterns=CHECKPOINT_PATTERNS))
    except Exception as e:  # the client raises HTTP, auth, validation and OS errors alike: all mean "not here"
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelNotFoundError(f"{name}: no such directory, not in the local Hugging Face cache {cache}, and "
                                 f"not downloadable ({type(e).__name__}: {why[:200]})") from None


def hub_cache_dir() -> Path:
    """The hub cache as the client finds it now: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub
    (read at each call, so that an environment set after import counts)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    """HF_HUB_OFFLINE (or the older TRANSFORMERS_OFFLINE) set to 1 / on / yes / true."""
    return any(os.environ.get(v, "").upper() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
