"""The built-in default model: a tiny byte-level Nemotron-H (every block kind) trained on the King James
Bible by tools/train_tiny.py, shipped inside the package under metrale_jax/assets/tiny/."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

import jax.numpy as jnp

from metrale_jax.config import ModelLevers
from metrale_jax.errors import CheckpointError, ConfigError
from metrale_jax.files import config_error, read_json


def builtin_model_dir() -> Path:
    """The folder of the packaged built-in model (config.json, model.safetensors, byte_tokenizer.json)."""
    path = Path(str(resources.files("metrale_jax") / "assets" / "tiny"))
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: the built-in model is missing from this installation "
                              f"(rebuild it with tools/train_tiny.py)")
    return path


def checkpoint_dtype(directory: str | os.PathLike):
    """The dtype a checkpoint was saved in (config.json's `dtype`, or `torch_dtype` as older
    transformers wrote it), else bfloat16."""
    raw = read_json(Path(directory) / "config.json", config_error)
    key = "dtype" if raw.get("dtype") else "torch_dtype"
    name = raw.get(key) or "bfloat16"
    if name not in ("float32", "bfloat16", "float16"):
        raise ConfigError(key, f"expected float32, bfloat16 or float16, got {name!r}")
    return jnp.dtype(name)


def load_builtin(dtype=None, levers: ModelLevers | None = None):
    """The built-in model as a NemotronH, in its saved dtype unless `dtype` is given."""
    from metrale_jax.model import NemotronH

    path = builtin_model_dir()
    return NemotronH.from_pretrained(path, dtype=checkpoint_dtype(path) if dtype is None else dtype,
                                     levers=levers, progress=False)
