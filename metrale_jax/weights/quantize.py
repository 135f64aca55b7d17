"""Quantize a dense (BF16 / F32) HF checkpoint into block FP8, ModelOpt FP8 or ModelOpt NVFP4.

Linear layers (in_proj, out_proj, q/k/v/o_proj, up/down/gate_proj, latent projections) are quantized;
everything else (embeddings, lm_head, norms, conv1d, router, A_log, D, dt_bias) is copied unchanged.
`quantize_checkpoint(src_dir, out_dir, format)` is what `metrale-jax quantize` calls.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from metrale_jax.errors import CheckpointError
from metrale_jax.weights import quant_formats as qf
from metrale_jax.weights.fp8 import write_fp8_block, write_fp8_tensor
from metrale_jax.weights.nvfp4 import write_nvfp4
from metrale_jax.weights.quant_config import QuantConfig, read_quant_config
from metrale_jax.weights.safetensors_io import DTYPES, CheckpointReader, save_safetensors

FORMATS = {"fp8-block": "fp8_block", "fp8": "fp8", "nvfp4": "nvfp4"}
LINEAR_MODULES = ("in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj",
                  "gate_proj", "fc1_latent_proj", "fc2_latent_proj")
DEFAULT_EXCLUDE = ("lm_head",)
FLOAT_DTYPES = ("BF16", "F16", "F32")
SHARD_BYTES = 2 * 1024 ** 3
_WRITERS = {"fp8_block": write_fp8_block, "fp8": write_fp8_tensor, "nvfp4": write_nvfp4}


def _method(fmt: str) -> str:
    if fmt not in FORMATS:
        raise CheckpointError(f"format {fmt!r} is not one of {sorted(FORMATS)}")
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
                        exclude: Iterable[str] = (), shard_bytes: int = SHARD_BYTES) -> dict:
    """Read the dense checkpoint in src_dir, write out_dir in `format` ('fp8-block' | 'fp8' | 'nvfp4'):
    model.safetensors (or shards + model.safetensors.index.json), config.json with quantization_config,
    hf_quant_config.json for the ModelOpt formats, and every other file of src_dir (tokenizer, generation
    config) copied. Returns a summary."""
    src, out = Path(src_dir), Path(out_dir)
    if src.resolve() == out.resolve():
        raise CheckpointError(f"{out}: the output directory must differ from the source")
    if read_quant_config(src).method != "none":
        raise CheckpointError(f"{src}: already quantized ({read_quant_config(src).source})")
    reader = CheckpointReader(src)
    entries = [(n, *reader.info(n)) for n in sorted(reader.keys())]
    bad = [f"{n}: {d}" for n, d, _ in entries if d in ("F8_E4M3", "F8_E5M2", "U8")]
    if bad:
        raise CheckpointError([f"{src}: holds quantized tensors; quantize a dense checkpoint"] + bad[:8])
    qcfg, todo = plan(entries, format, exclude)
    out.mkdir(parents=True, exist_ok=True)
    # shards planned from the headers, so names are final before anything is written
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
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map: dict[str, str] = {}
    for fname, names in zip(files, shards):
        tensors: dict[str, np.ndarray] = {}
        for name in names:
            module = name[:-len(".weight")]
            if module in todo:
                tensors.update(_WRITERS[qcfg.method](module, np.asarray(reader.get(name), np.float32)))
            else:
                tensors[name] = reader.get(name)
        save_safetensors(out / fname, tensors, metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
    reader.close()
    if len(files) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map},
                                                                     indent=2))
    _write_configs(src, out, qcfg)
    return {"format": format, "method": qcfg.method, "quantized_modules": len(todo), "files": files,
            "exclude_modules": list(qcfg.exclude), "out_dir": str(out)}


def _write_configs(src: Path, out: Path, qcfg: QuantConfig) -> None:
    skip = {"config.json", "hf_quant_config.json", "model.safetensors.index.json"}
    for f in src.iterdir():
        if f.is_file() and f.name not in skip and not f.name.endswith(".safetensors"):
            shutil.copy2(f, out / f.name)
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{cfg_path}: missing")
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = qcfg.quantization_config()
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    hq = qcfg.hf_quant_config()
    if hq is not None:
        (out / "hf_quant_config.json").write_text(json.dumps(hq, indent=2))
