"""Quantize a dense (BF16 / F32) HF checkpoint into block FP8, ModelOpt FP8 or ModelOpt NVFP4.

Linear layers (in_proj, out_proj, q/k/v/o_proj, up/down/gate_proj, latent projections) are quantized;
everything else (embeddings, lm_head, norms, conv1d, router, A_log, D, dt_bias) is copied unchanged.
`quantize_checkpoint(src_dir, out_dir, format)` is what `metrale-jax quantize` calls.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from metrale_jax import files
from metrale_jax.arguments import integer
from metrale_jax.errors import CheckpointError, ConfigError
from metrale_jax.files import open_regular, read_json
from metrale_jax.weights import quant_formats as qf
from metrale_jax.weights.fp8 import write_fp8_block, write_fp8_tensor
from metrale_jax.weights.nvfp4 import write_nvfp4
from metrale_jax.weights.quant_config import QuantConfig, read_quant_config
from metrale_jax.weights.safetensors_io import DTYPES, INDEX, CheckpointReader, is_checkpoint_file, save_safetensors

FORMATS = {"fp8-block": "fp8_block", "fp8": "fp8", "nvfp4": "nvfp4"}
LINEAR_MODULES = ("in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj",
                  "gate_proj", "fc1_latent_proj", "fc2_latent_proj")
DEFAULT_EXCLUDE = ("lm_head",)
FLOAT_DTYPES = ("BF16", "F16", "F32")
SHARD_BYTES = 2 * 1024 ** 3
_WRITERS = {"fp8_block": write_fp8_block, "fp8": write_fp8_tensor, "nvfp4": write_nvfp4}


def _method(fmt: str) -> str:
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ConfigError("format", f"expected one of {sorted(FORMATS)}, got {fmt!r:.60}")
    return FORMATS[fmt]


def is_linear(name: str, shape, dtype: str) -> bool:
    """A 2-D float `<module>.weight` of a linear layer this tool quantizes."""
    if not name.endswith(".weight") or len(shape) != 2 or dtype not in FLOAT_DTYPES:
        return False
    return name[:-len(".weight")].rsplit(".", 1)[-1] in LINEAR_MODULES


def plan(entries: Iterable[tuple[str, str, tuple[int, ...]]], fmt: str,
         exclude: Iterable[str] = ()) -> tuple[QuantConfig, set[str]]:
    """(config, modules to quantize) from (name, dtype, shape) triples. NVFP4 needs K % 16 == 0: a linear
    layer without it stays dense and is named in the exclusion list, so the config says what the files hold."""
    method = _method(fmt)
    given = exclude
    exclude = [] if isinstance(given, (str, bytes)) else list(given)      # a string is one pattern's letters
    if isinstance(given, (str, bytes)) or not all(isinstance(p, str) for p in exclude):
        raise ConfigError("exclude", f"expected a list of module-name patterns, got {given!r:.60}")
    patterns = list(DEFAULT_EXCLUDE) + [p for p in exclude if p not in DEFAULT_EXCLUDE]
    probe = QuantConfig(method, tuple(patterns))
    todo, skipped = set(), []
    for name, dtype, shape in entries:
        if not is_linear(name, shape, dtype):
            continue
        module = name[:-len(".weight")]
        if probe.is_excluded(module):
            continue
        if method == "nvfp4" and shape[1] % qf.NVFP4_GROUP:
            skipped.append(module)
            continue
        todo.add(module)
    return QuantConfig(method, tuple(patterns + sorted(skipped))), todo


def quantize_tensors(tensors: Mapping[str, np.ndarray], fmt: str, exclude: Iterable[str] = ()
                     ) -> tuple[dict[str, np.ndarray], QuantConfig]:
    """In-memory form: a dense tensor dict -> (tensors in the target layout, its QuantConfig)."""
    names = {np.dtype(v): k for k, v in DTYPES.items()}
    entries = [(n, names.get(np.dtype(a.dtype), str(a.dtype)), tuple(a.shape)) for n, a in tensors.items()]
    qcfg, todo = plan(entries, fmt, exclude)
    out: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        module = name[:-len(".weight")] if name.endswith(".weight") else None
        if module in todo:
            out.update(_WRITERS[qcfg.method](module, np.asarray(arr, np.float32)))
        else:
            out[name] = np.asarray(arr)
    return out, qcfg


def _quantized_bytes(method: str, dtype: str, shape) -> int:
    n, k = shape
    if method == "nvfp4":
        return n * k // 2 + n * k // 16 + 4
    if method == "fp8_block":
        return n * k + 4 * (-(-n // 128)) * (-(-k // 128))
    return n * k + 4


def quantize_checkpoint(src_dir: str | os.PathLike, out_dir: str | os.PathLike, format: str, *,
                        exclude: Iterable[str] = (), shard_bytes: int = SHARD_BYTES, overwrite: bool = False) -> dict:
    """Read the dense checkpoint in src_dir, write out_dir in `format` ('fp8-block' | 'fp8' | 'nvfp4'):
    model.safetensors (or shards + model.safetensors.index.json), config.json with quantization_config,
    hf_quant_config.json for the ModelOpt formats, and every other file of src_dir (tokenizer, generation
    config) copied. Written atomically (files.staged_directory): an out_dir that already holds a checkpoint is
    replaced only with overwrite=True, and then whole (no old shard or index survives); its other files are
    kept. Returns a summary."""
    integer("shard_bytes", shard_bytes, 1)
    _method(format)                                      # a misspelt format before anything is read
    src, out = Path(src_dir), Path(out_dir)
    if src.resolve() == out.resolve():
        raise CheckpointError(f"{out}: the output directory must differ from the source")
    if read_quant_config(src).method != "none":
        raise CheckpointError(f"{src}: already quantized ({read_quant_config(src).source})")
    config = read_json(src / "config.json")
    reader = CheckpointReader(src)
    try:
        entries = [(n, *reader.info(n)) for n in sorted(reader.keys())]
        bad = [f"{n}: {d}" for n, d, _ in entries if d in ("F8_E4M3", "F8_E5M2", "U8")]
        if bad:
            raise CheckpointError([f"{src}: holds quantized tensors; quantize a dense checkpoint"] + bad[:8])
        qcfg, todo = plan(entries, format, exclude)
        with files.staged_directory(out, overwrite=overwrite, replaces=is_checkpoint_file) as tmp:
            names = _write_quantized(reader, tmp, entries, qcfg, todo, shard_bytes)
            _write_configs(src, tmp, config, qcfg)
    finally:
        reader.close()
    return {"format": format, "method": qcfg.method, "quantized_modules": len(todo), "files": names,
            "exclude_modules": list(qcfg.exclude), "out_dir": str(out)}


def _write_quantized(reader, out: Path, entries, qcfg: QuantConfig, todo: set[str], shard_bytes: int) -> list[str]:
    """The quantized weights files in the new directory `out`, sharded from the headers (so that names are final
    before anything is written): model.safetensors, or shards and model.safetensors.index.json."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, dtype, shape in entries:
        module = name[:-len(".weight")]
        nbytes = (_quantized_bytes(qcfg.method, dtype, shape) if module in todo
                  else int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map: dict[str, str] = {}
    for fname, part in zip(names, shards):
        tensors: dict[str, np.ndarray] = {}
        for name in part:
            module = name[:-len(".weight")]
            if module in todo:
                tensors.update(_WRITERS[qcfg.method](module, np.asarray(reader.get(name), np.float32)))
            else:
                tensors[name] = reader.get(name)
        save_safetensors(out / fname, tensors, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    if len(names) > 1:
        files.write_json(out / INDEX, {"metadata": {}, "weight_map": weight_map})
    return names


def _write_configs(src: Path, out: Path, config: dict, qcfg: QuantConfig) -> None:
    """config.json (src's, with quantization_config), hf_quant_config.json for ModelOpt, and src's other regular
    files (tokenizer, generation config; not its weights, index or configs) copied into the new directory out."""
    skip = {"config.json", "hf_quant_config.json", INDEX}
    for f in src.iterdir():
        if f.is_file() and f.name not in skip and not f.name.endswith(".safetensors"):
            with open_regular(f) as fh, files.replacing(out / f.name) as dst:
                shutil.copyfileobj(fh, dst)
    files.write_json(out / "config.json", {**config, "quantization_config": qcfg.quantization_config()})
    hq = qcfg.hf_quant_config()
    if hq is not None:
        files.write_json(out / "hf_quant_config.json", hq)
