"""Which quantization a checkpoint uses, which modules it excludes, and one linear layer's container.

Sources, in this order: hf_quant_config.json (ModelOpt: {"quantization": {"quant_algo": "FP8" | "NVFP4",
"exclude_modules": [...], "group_size": 16}}), else config.json "quantization_config" (quant_method
"modelopt" with quant_algo, or "fp8" with weight_block_size [128, 128] = block FP8). Exclusions are
fnmatch patterns over module names ("lm_head", "backbone.layers.*.mixer.q_proj"); an excluded module
stays BF16.

`load_linear(reader, prefix, shape, qcfg)` returns the container for one linear module (DenseWeight,
Fp8Weight, Nvfp4Weight) from the tensors present, checked against the config.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from pathlib import Path

import jax.numpy as jnp

from metrale_jax.errors import CheckpointError
from metrale_jax.files import read_json
from metrale_jax.weights.containers import DenseWeight
from metrale_jax.weights.fp8 import _has, read_fp8_block, read_fp8_tensor
from metrale_jax.weights.nvfp4 import read_nvfp4

METHODS = ("none", "fp8", "fp8_block", "nvfp4")
FLOAT_DTYPES = ("BF16", "F16", "F32")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """method: none | fp8 (ModelOpt per-tensor) | fp8_block | nvfp4; exclude: fnmatch patterns."""

    method: str = "none"
    exclude: tuple[str, ...] = ()
    group_size: int = 16
    block_size: tuple[int, int] = (128, 128)
    source: str = ""

    def __post_init__(self):
        if self.method not in METHODS:
            raise CheckpointError(f"quantization method {self.method!r} is not one of {METHODS}")

    def is_excluded(self, module: str) -> bool:
        """Whether `module` (no ".weight" suffix) matches an exclusion pattern, or lies under one."""
        return any(fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(module, p + ".*") for p in self.exclude)

    def expected(self, module: str) -> str:
        """The format a linear module should be stored in: 'dense' or the method."""
        return "dense" if self.method == "none" or self.is_excluded(module) else self.method

    # ---- what a writer puts in the checkpoint ------------------------------------------------------
    def hf_quant_config(self) -> dict | None:
        """hf_quant_config.json for the ModelOpt formats (None for block FP8 / unquantized)."""
        algo = {"fp8": "FP8", "nvfp4": "NVFP4"}.get(self.method)
        if algo is None:
            return None
        q = {"quant_algo": algo, "kv_cache_quant_algo": None, "exclude_modules": list(self.exclude)}
        if self.method == "nvfp4":
            q["group_size"] = self.group_size
        return {"producer": {"name": "modelopt", "version": "metrale-jax"}, "quantization": q}

    def quantization_config(self) -> dict | None:
        """config.json's "quantization_config"."""
        if self.method == "fp8_block":
            return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": list(self.block_size), "modules_to_not_convert": list(self.exclude)}
        hq = self.hf_quant_config()
        if hq is None:
            return None
        return {"quant_method": "modelopt", **hq["quantization"]}


def quant_config_from_dicts(hf_quant: dict | None, config_json: dict | None, source: str = "") -> QuantConfig:
    """Pure form of `read_quant_config`: hf_quant_config.json's content and config.json's content."""
    if hf_quant is not None:
        where = f"{source}hf_quant_config.json"
        q = _object(_object(hf_quant, where).get("quantization", hf_quant), f"{where}: quantization")
        return _modelopt(q, where)
    qc = _object(config_json or {}, f"{source}config.json").get("quantization_config")
    if not qc:
        return QuantConfig(source=source or "none")
    where = f"{source}config.json: quantization_config"
    qc = _object(qc, where)
    method = str(qc.get("quant_method", "")).lower()
    if method == "modelopt":
        return _modelopt(qc, where)
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is None:
            raise CheckpointError(f"{where}: quant_method 'fp8' without weight_block_size (per-tensor FP8 "
                                  "checkpoints come as ModelOpt FP8)")
        if block != [128, 128]:
            raise CheckpointError(f"{where}.weight_block_size: {block!r:.100}, only [128, 128] is supported")
        excl = _patterns(qc.get("modules_to_not_convert") or qc.get("ignored_layers"), f"{where}.modules_to_not_convert")
        return QuantConfig("fp8_block", excl, block_size=(128, 128), source=where)
    raise CheckpointError(f"{where}.quant_method: {qc.get('quant_method')!r:.100} is not supported "
                          "(supported: 'modelopt' FP8 / NVFP4, 'fp8' with 128x128 blocks)")


def _object(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _patterns(value, where: str) -> tuple[str, ...]:
    """An exclusion list: a list of module-name patterns (None: none)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise CheckpointError(f"{where}: expected a list of module-name patterns, got {value!r:.100}")
    return tuple(value)


def _modelopt(q: dict, where: str) -> QuantConfig:
    algo = str(q.get("quant_algo", "")).upper()
    method = {"FP8": "fp8", "NVFP4": "nvfp4"}.get(algo)
    if method is None:
        raise CheckpointError(f"{where}: quant_algo {q.get('quant_algo')!r:.100} is not supported (FP8, NVFP4)")
    group = q.get("group_size", 16)
    if method == "nvfp4" and group != 16:
        raise CheckpointError(f"{where}: group_size {group!r:.100}, NVFP4 uses 16")
    excl = _patterns(q.get("exclude_modules") or q.get("ignore"), f"{where}: exclude_modules")
    return QuantConfig(method, excl, source=where)          # group_size: 16, the only one NVFP4 has


def read_quant_config(directory: str | os.PathLike) -> QuantConfig:
    """The quantization of the checkpoint in `directory` (QuantConfig('none') when unquantized)."""
    d = Path(directory)
    load = lambda name: read_json(d / name) if os.path.lexists(d / name) else None
    return quant_config_from_dicts(load("hf_quant_config.json"), load("config.json"), source=f"{d}/")


def stored_format(reader, prefix: str) -> str:
    """'dense' | 'fp8' | 'fp8_block' | 'nvfp4', from the dtypes and scale tensors present under prefix."""
    name = f"{prefix}.weight"
    if not _has(reader, name):
        raise CheckpointError(f"{name}: missing")
    dtype = reader.info(name)[0]
    if dtype in FLOAT_DTYPES:
        return "dense"
    if dtype == "F8_E4M3":
        if _has(reader, f"{prefix}.weight_scale_inv"):
            return "fp8_block"
        if _has(reader, f"{prefix}.weight_scale"):
            return "fp8"
        raise CheckpointError(f"{name}: F8_E4M3 weight without weight_scale or weight_scale_inv")
    if dtype == "U8":
        return "nvfp4"
    raise CheckpointError(f"{name}: dtype {dtype} is not a weight format this loader reads "
                          f"(BF16/F16/F32, F8_E4M3, U8 NVFP4)")


def load_linear(reader, prefix: str, shape: tuple[int, int] | None = None, qcfg: QuantConfig | None = None, *,
                fp8_to_block: bool = False, dtype=None, host: bool = False):
    """The container of linear module `prefix` ([N, K] = `shape` when given). With `qcfg`, an excluded
    module must be stored dense and a quantized one in the config's format (a dense weight where the config
    expects a quantized one is accepted: some exports leave small layers unquantized unlisted).
    fp8_to_block expands a ModelOpt per-tensor FP8 scale to the 128x128 grid (what the FP8 arm takes);
    dtype casts a dense weight. host: the container holds the reader's arrays as they come (memory-mapped views:
    nothing of the weight or of an NVFP4 group scale is read yet, a mesh's placement reads each device's share;
    a dense weight stays uncast), only the small FP8 / global scales are read."""
    fmt = stored_format(reader, prefix)
    if qcfg is not None:
        want = qcfg.expected(prefix)
        if fmt != "dense" and want != fmt:
            why = "excluded by the quantization config" if want == "dense" else f"the config says {want}"
            raise CheckpointError(f"{prefix}.weight: stored as {fmt}, but {why} ({qcfg.source})")
    if fmt == "dense":
        name = f"{prefix}.weight"
        got = tuple(reader.info(name)[1])
        if len(got) != 2 or (shape is not None and got != tuple(shape)):
            raise CheckpointError(f"{name}: shape {list(got)}, expected {list(shape) if shape else '[N, K]'}")
        if host:
            return DenseWeight(reader.get(name))
        w = jnp.asarray(reader.get(name))
        return DenseWeight(w if dtype is None else w.astype(dtype))
    if fmt == "fp8_block":
        return read_fp8_block(reader, prefix, shape, host=host)
    if fmt == "fp8":
        return read_fp8_tensor(reader, prefix, shape, to_block=fp8_to_block, host=host)
    return read_nvfp4(reader, prefix, shape, host=host)
