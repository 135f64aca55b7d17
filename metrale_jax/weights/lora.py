"""PEFT LoRA adapter files: reading, checking against a model's projections, and writing.

An adapter directory holds adapter_config.json (peft_type LORA; r, lora_alpha, use_rslora, target_modules,
rank_pattern, alpha_pattern, ...) and adapter_model.safetensors with one pair per targeted module,
    base_model.model.model.layers.{i}.mixer.{module}.lora_A.weight   [r, K]
    base_model.model.model.layers.{i}.mixer.{module}.lora_B.weight   [N, r]
(HF's in-memory names; `backbone.` for `model.` is taken too). A module's scale is lora_alpha / r, or
lora_alpha / sqrt(r) with use_rslora, with rank_pattern / alpha_pattern overriding r / alpha for the modules
their keys match (PEFT's rule: the key matches the module name's end).

The checkpoint reader's rules apply (files.py, safetensors_io.py): only the two plain file names inside the
directory are opened, each must be a regular file, the safetensors header is validated, and every problem is a
CheckpointError naming the file, field or tensor; all tensor problems of an adapter are listed at once.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from metrale_jax.errors import CheckpointError
from metrale_jax.files import read_json, write_json
from metrale_jax.weights.safetensors_io import SafetensorsFile, save_safetensors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# a LoRA factor's tensor name -> (the module inside a block, "A" or "B")
_FACTOR = re.compile(r"^(?:base_model\.model\.)?(?:model|backbone)\.layers\.(\d+)\.(mixer\..+)\.lora_([AB])"
                     r"(?:\.default)?\.weight$")
# config fields that change what the factors mean and that this reader does not implement: (field, allowed)
_UNSUPPORTED = (("use_dora", (False, None)), ("lora_bias", (False, None)), ("fan_in_fan_out", (False, None)),
                ("modules_to_save", (None, [])), ("target_parameters", (None, [])),
                ("layer_replication", (None, [])))


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """The fields of adapter_config.json that define the factors' scale (hashable: patterns as tuples)."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str = ()
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()

    def rank(self, module: str) -> int:
        return int(_pattern_value(self.rank_pattern, module, self.r))

    def scale(self, module: str) -> float:
        """lora_alpha / r (or / sqrt(r) with use_rslora) for `module`, after rank_pattern / alpha_pattern."""
        r, alpha = self.rank(module), float(_pattern_value(self.alpha_pattern, module, self.lora_alpha))
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def to_peft(self) -> dict:
        """adapter_config.json as PEFT writes it (the fields PEFT needs to load the adapter)."""
        targets = self.target_modules if isinstance(self.target_modules, str) else sorted(self.target_modules)
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None, "r": self.r,
                "lora_alpha": self.lora_alpha, "use_rslora": self.use_rslora, "target_modules": targets,
                "rank_pattern": dict(self.rank_pattern), "alpha_pattern": dict(self.alpha_pattern),
                "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_dora": False,
                "modules_to_save": None, "init_lora_weights": True, "inference_mode": True}


def _pattern_value(pattern, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of the module name."""
    for key, value in pattern:
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def targets(config: LoraConfig, module: str) -> bool:
    """Whether target_modules names `module` (a list: the module's name or its dotted end; a string: a regex
    matched against the whole name, as PEFT does)."""
    t = config.target_modules
    if isinstance(t, str):
        return re.fullmatch(t, module) is not None
    return any(module == n or module.endswith("." + n) for n in t)


# ---- reading --------------------------------------------------------------------------------------------
def read_config(directory: str | os.PathLike) -> LoraConfig:
    """adapter_config.json of `directory` as a LoraConfig; anything this reader cannot honour exactly is a
    CheckpointError naming the field."""
    path = Path(directory) / CONFIG_FILE
    raw = read_json(path)
    bad = lambda field, why: CheckpointError(f"{path}: {field}: {why}")
    if raw.get("peft_type", "LORA") != "LORA":
        raise bad("peft_type", f"expected 'LORA', got {raw.get('peft_type')!r}")
    for field, allowed in _UNSUPPORTED:
        if raw.get(field) not in allowed:
            raise bad(field, f"{raw.get(field)!r} is not supported (only {allowed[0]!r})")
    r, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise bad("r", f"expected a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise bad("lora_alpha", f"expected a finite number, got {alpha!r}")
    tm = raw.get("target_modules") or ()
    if not (isinstance(tm, str) or (isinstance(tm, list) and all(isinstance(t, str) for t in tm))):
        raise bad("target_modules", f"expected a list of module names or a regex, got {tm!r}")
    patterns = {}
    for field, kind in (("rank_pattern", int), ("alpha_pattern", (int, float))):
        p = raw.get(field) or {}
        if not isinstance(p, dict) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in p.values()):
            raise bad(field, f"expected a mapping of module patterns to numbers, got {p!r}")
        patterns[field] = tuple(p.items())
    return LoraConfig(r, float(alpha), bool(raw.get("use_rslora", False)),
                      tm if isinstance(tm, str) else tuple(tm), patterns["rank_pattern"], patterns["alpha_pattern"])


def read_factors(directory: str | os.PathLike) -> dict[str, np.ndarray]:
    """adapter_model.safetensors of `directory`: name -> float32 array."""
    st = SafetensorsFile(Path(directory) / WEIGHTS_FILE)
    try:
        out = {}
        for name in st.keys():
            arr = st.get(name)
            if arr.dtype.kind != "f" and arr.dtype.name not in ("bfloat16",):
                raise CheckpointError(f"{st.path}: {name}: a LoRA factor must be floating, got {arr.dtype}")
            out[name] = np.asarray(arr, np.float32)
        return out
    finally:
        st.close()


def match_factors(config: LoraConfig, tensors: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, int]],
                  num_layers: int) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
    """The adapter's factors by projection: module name (backbone.layers.i.mixer....) -> (A [r, K], B [N, r],
    scale). shapes: the model's projections that take adapters, name -> (N, K). Every tensor is checked; all
    problems are one CheckpointError (an adapter for another base model shows as layers past the model's or
    projections of another width, named as such)."""
    problems, pairs = [], {}
    for name in sorted(tensors):
        m = _FACTOR.match(name)
        if m is None:
            problems.append(f"{name}: not a LoRA factor of a block's projection (expected "
                            f"base_model.model.model.layers.<i>.mixer.<module>.lora_A/lora_B.weight)")
            continue
        layer, module, which = int(m.group(1)), f"backbone.layers.{m.group(1)}.{m.group(2)}", m.group(3)
        if layer >= num_layers:
            problems.append(f"{name}: layer {layer}, but this model has {num_layers} layers: an adapter for "
                            f"another base model")
        elif module not in shapes:
            problems.append(f"{name}: {module} is not a projection of this model that takes LoRA (the Mamba "
                            f"in_proj / out_proj, attention q/k/v/o_proj, MLP and shared-expert up/down_proj, "
                            f"MoE latent projections)")
        else:
            pairs.setdefault(module, {})[which] = (name, tensors[name])
    factors = {}
    for module, got in sorted(pairs.items()):
        problems += _check_pair(config, module, got, shapes[module])
        if "A" in got and "B" in got:
            factors[module] = (got["A"][1], got["B"][1], config.scale(_short(module)))
    if isinstance(config.target_modules, tuple):
        short = {_short(m) for m in shapes}
        for t in config.target_modules:
            if not any(s == t or s.endswith("." + t) for s in short):
                problems.append(f"target_modules: {t!r} names no projection of this model that takes LoRA")
    if problems:
        raise CheckpointError(problems)
    return factors


def _short(module: str) -> str:
    """backbone.layers.3.mixer.up_proj -> layers.3.mixer.up_proj (what PEFT's patterns see, less `model.`)."""
    return module.split(".", 1)[1]


def _check_pair(config: LoraConfig, module: str, got: dict, shape: tuple[int, int]) -> list[str]:
    """Problems of one module's (A, B): both present, A [r, K], B [N, r], r the config's rank for it."""
    n, k = shape
    r = config.rank(_short(module))
    problems = [f"{module}.lora_{w}.weight: missing (its lora_{'B' if w == 'A' else 'A'} is there)"
                for w in "AB" if w not in got]
    for which, want in (("A", (r, k)), ("B", (n, r))):
        if which in got:
            name, arr = got[which]
            if tuple(arr.shape) != want:
                side = ("input width K" if which == "A" else "output width N") + " or rank r"
                problems.append(f"{name}: shape {list(arr.shape)}, expected {list(want)} (r = {r} from the "
                                f"adapter config; this model's {module} is [{n}, {k}]): the {side} does not fit")
    return problems


# ---- writing --------------------------------------------------------------------------------------------
def peft_name(module: str, which: str) -> str:
    """backbone.layers.i.mixer.m, "A" -> base_model.model.model.layers.i.mixer.m.lora_A.weight (PEFT's name)."""
    return f"base_model.model.model.{_short(module)}.lora_{which}.weight"


def write_adapter(directory: str | os.PathLike, config: LoraConfig,
                  factors: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> list[Path]:
    """adapter_config.json + adapter_model.safetensors (float32) in `directory` (created if missing; the two files
    are replaced whole). factors: module -> (A [r, K], B [N, r])."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {peft_name(m, w): np.asarray(f, np.float32) for m, (a, b) in factors.items()
               for w, f in (("A", a), ("B", b))}
    save_safetensors(out / WEIGHTS_FILE, tensors, metadata={"format": "pt"})
    write_json(out / CONFIG_FILE, config.to_peft())
    return [out / CONFIG_FILE, out / WEIGHTS_FILE]
