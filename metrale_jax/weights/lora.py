"""PEFT LoRA adapter files: reading, checking against a model's projections, and writing.

An adapter directory holds adapter_config.json (peft_type LORA; r, lora_alpha, use_rslora, target_modules,
target_parameters, rank_pattern, alpha_pattern, modules_to_save, ...) and adapter_model.safetensors with one pair
per targeted module (HF's in-memory names; `backbone.` for `model.` is taken too):
    base_model.model.model.layers.{i}.mixer.{module}.lora_A.weight   [r, K]      a block's projection
    base_model.model.model.layers.{i}.mixer.{module}.lora_B.weight   [N, r]
    base_model.model.lm_head.lora_A.weight / lora_B.weight            [r, D] / [V, r]   the logits projection
Routed experts come in either of PEFT's forms, both installed as one stack per layer and projection
(`backbone.layers.{i}.mixer.experts.up_proj` / `.down_proj`, A [E, r, K], B [E, N, r]):
  per expert module (target_modules naming experts.{e}.up_proj, a model whose experts are modules):
    ...mixer.experts.{e}.up_proj.lora_A.weight [r, K], .lora_B.weight [N, r]
  one fused 3-D parameter (target_parameters, PEFT's ParamWrapper on HF's NemotronHExperts, whose up_proj /
  down_proj parameters are [E, N, K]): A [r*E, K] expert-major (row e*r + j), B [N, r*E] rank-major (column
  j*E + e). Two targeted parameters of one module nest: the one registered first (up_proj) is the inner wrapper,
  saved as ...mixer.experts.base_layer.lora_A.weight, the other as ...mixer.experts.lora_A.weight.
A module's scale is lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora, with rank_pattern / alpha_pattern
overriding r / alpha for the modules their keys match (PEFT's rule: the key matches the module name's end).
Full copies (modules_to_save; and lm_head.base_layer.weight, which PEFT saves when lm_head is a target) are read
too: `full_copies` returns them for the model to check against its own weights. LoRA on the embeddings is
refused (CheckpointError).

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

from metrale_jax import files
from metrale_jax.errors import CheckpointError
from metrale_jax.files import read_json, write_json
from metrale_jax.weights.safetensors_io import SafetensorsFile, save_safetensors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# a LoRA factor's tensor name -> (the module inside a block, "A" or "B"); the logits projection's
_FACTOR = re.compile(r"^(?:base_model\.model\.)?(?:model|backbone)\.layers\.(\d+)\.(mixer\..+)\.lora_([AB])"
                     r"(?:\.default)?\.weight$")
_HEAD_FACTOR = re.compile(r"^(?:base_model\.model\.)?lm_head\.lora_([AB])(?:\.default)?\.weight$")
# a routed expert's module (per-expert form) and the fused experts' ParamWrapper nesting (target_parameters form)
_ONE_EXPERT = re.compile(r"^mixer\.experts\.(\d+)\.(up_proj|down_proj)$")
_FUSED = re.compile(r"^mixer\.experts((?:\.base_layer)*)$")
EXPERT_PARAMS = ("up_proj", "down_proj")          # NemotronHExperts' parameters, in registration order
# full copies of a module: tensor name -> the model's tensor it stands for
_FULL = {re.compile(r"^(?:base_model\.model\.)?lm_head(?:\.base_layer)?\.weight$"): "lm_head.weight",
         re.compile(r"^(?:base_model\.model\.)?(?:model|backbone)\.(?:embeddings|embed_tokens)\.weight$"):
             "backbone.embeddings.weight"}
SAVABLE = {"lm_head": "lm_head.weight", "embeddings": "backbone.embeddings.weight",
           "embed_tokens": "backbone.embeddings.weight"}
# config fields that change what the factors mean and that this reader does not implement: (field, allowed)
_UNSUPPORTED = (("use_dora", (False, None)), ("lora_bias", (False, None)), ("fan_in_fan_out", (False, None)),
                ("layer_replication", (None, [])), ("trainable_token_indices", (None, {}, [])))


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """The fields of adapter_config.json that define the factors' scale (hashable: patterns as tuples)."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str = ()
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()
    target_parameters: tuple[str, ...] = ()
    modules_to_save: tuple[str, ...] = ()

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
                "modules_to_save": list(self.modules_to_save) or None,
                "target_parameters": list(self.target_parameters) or None, "init_lora_weights": True,
                "inference_mode": True}


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
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise bad("use_rslora", f"expected true or false, got {use_rslora!r:.60}")
    tm = raw.get("target_modules") or ()
    if not (isinstance(tm, str) or (isinstance(tm, list) and all(isinstance(t, str) for t in tm))):
        raise bad("target_modules", f"expected a list of module names or a regex, got {tm!r}")
    if isinstance(tm, str) and (why := regex_problem(tm)):
        raise bad("target_modules", f"{tm!r:.60} is not a valid regex ({why})")
    patterns = {}
    for field, ok, want in (("rank_pattern", lambda v: isinstance(v, int) and v >= 1, "a positive integer"),
                            ("alpha_pattern", lambda v: isinstance(v, (int, float)) and math.isfinite(v),
                             "a finite number")):
        p = raw.get(field) or {}
        if not isinstance(p, dict):
            raise bad(field, f"expected a mapping of module patterns to numbers, got {p!r:.60}")
        for key, v in p.items():
            if isinstance(v, bool) or not ok(v):
                raise bad(f"{field}: {key}", f"expected {want}, got {v!r:.60}")
            if why := regex_problem(rf"(.*\.)?({key})$"):
                raise bad(f"{field}: {key}", f"the key is not a valid regex ({why})")
        patterns[field] = tuple(p.items())
    lists = {}
    for field in ("target_parameters", "modules_to_save"):
        v = raw.get(field) or []
        if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
            raise bad(field, f"expected a list of names, got {v!r}")
        lists[field] = tuple(v)
    for t in lists["modules_to_save"]:
        if t not in SAVABLE:
            raise bad("modules_to_save", f"{t!r} is not supported (only full copies of {sorted(SAVABLE)})")
    embedding = [t for t in ([tm] if isinstance(tm, str) else tm) if t in ("embeddings", "embed_tokens")]
    if embedding:
        raise bad("target_modules", f"LoRA on the embeddings ({embedding[0]!r}) is not supported")
    return LoraConfig(r, float(alpha), use_rslora,
                      tm if isinstance(tm, str) else tuple(tm), patterns["rank_pattern"], patterns["alpha_pattern"],
                      lists["target_parameters"], lists["modules_to_save"])


def regex_problem(pattern: str) -> str | None:
    """Why `pattern` is not a regex Python compiles (None when it is one)."""
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        return str(e) or type(e).__name__
    return None


def read_factors(directory: str | os.PathLike) -> dict[str, np.ndarray]:
    """adapter_model.safetensors of `directory`: name -> float32 array. A factor holding a NaN or an infinity is
    a CheckpointError naming it (as from_pretrained's check_finite names a weight): it would make every logit of
    the rows it serves NaN."""
    st = SafetensorsFile(Path(directory) / WEIGHTS_FILE)
    try:
        out, problems = {}, []
        for name in st.keys():
            arr = st.get(name)
            if arr.dtype.kind != "f" and arr.dtype.name not in ("bfloat16",):
                raise CheckpointError(f"{st.path}: {name}: a LoRA factor must be floating, got {arr.dtype}")
            out[name] = np.asarray(arr, np.float32)
            if not np.isfinite(out[name]).all():
                problems.append(f"{st.path}: {name}: holds NaN or infinite values")
        if problems:
            raise CheckpointError(problems)
        return out
    finally:
        st.close()


def split_full_copies(tensors: Mapping[str, np.ndarray]) -> tuple[dict, dict]:
    """(the LoRA factors, the full copies by the model tensor they stand for: lm_head.weight,
    backbone.embeddings.weight), from an adapter file's tensors."""
    rest, copies = {}, {}
    for name, arr in tensors.items():
        hit = next((model_name for pat, model_name in _FULL.items() if pat.match(name)), None)
        if hit is None:
            rest[name] = arr
        else:
            copies[hit] = (name, arr)
    return rest, copies


def expert_param_targeted(config: LoraConfig, layer: int, param: str) -> bool:
    """Whether target_parameters names layer `layer`'s fused routed-expert parameter `param` (PEFT's rule: the
    parameter's full name or its dotted end)."""
    key = f"model.layers.{layer}.mixer.experts.{param}"
    return any(key == t or key.endswith("." + t) for t in config.target_parameters)


def match_factors(config: LoraConfig, tensors: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]],
                  num_layers: int) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
    """The adapter's factors by target: module name -> (A, B, scale); a projection (backbone.layers.i.mixer....,
    lm_head) [N, K] takes A [r, K], B [N, r]; a routed-expert stack (backbone.layers.i.mixer.experts.up_proj)
    [E, N, K] takes A [E, r, K], B [E, N, r]. shapes: the model's targets, name -> shape. Every tensor is
    checked; all problems are one CheckpointError (an adapter for another base model shows as layers past the
    model's or projections of another width, named as such)."""
    problems, pairs, per_expert, fused = [], {}, {}, {}

    def put(group: dict, which: str, name: str) -> None:
        """Factor `which` of a target is `name`; a second tensor for it (two spellings of one name) is a problem."""
        if which in group:
            problems.append(f"{name}: the same factor as {group[which][0]}; expected one tensor per factor")
        else:
            group[which] = (name, tensors[name])

    for name in sorted(tensors):
        head = _HEAD_FACTOR.match(name)
        m = _FACTOR.match(name)
        if head is not None:
            if "lm_head" not in shapes:
                problems.append(f"{name}: this model's lm_head is tied to the embeddings; LoRA on it is not "
                                f"supported")
            else:
                put(pairs.setdefault("lm_head", {}), head.group(1), name)
            continue
        if m is None:
            problems.append(f"{name}: not a LoRA factor of a block's projection or lm_head (expected "
                            f"base_model.model.model.layers.<i>.mixer.<module>.lora_A/lora_B.weight)")
            continue
        layer, sub, which = int(m.group(1)), m.group(2), m.group(3)
        module = f"backbone.layers.{layer}.{sub}"
        one, many = _ONE_EXPERT.match(sub), _FUSED.match(sub)
        if layer >= num_layers:
            problems.append(f"{name}: layer {layer}, but this model has {num_layers} layers: an adapter for "
                            f"another base model")
        elif one is not None or many is not None:
            if many is not None:
                params = [p for p in EXPERT_PARAMS if expert_param_targeted(config, layer, p)]
                depth = many.group(1).count(".base_layer")
                if depth >= len(params):
                    problems.append(f"{name}: a fused-expert factor nested {depth} deep, but target_parameters "
                                    f"{list(config.target_parameters)} names {len(params)} parameter(s) of layer "
                                    f"{layer}'s experts")
                    continue
                proj = params[len(params) - 1 - depth]
            else:
                proj = one.group(2)
            stack = f"backbone.layers.{layer}.mixer.experts.{proj}"
            if stack not in shapes:
                problems.append(f"{name}: {stack} is not a routed-expert stack of this model")
            elif many is not None:
                put(fused.setdefault(stack, {}), which, name)
            else:
                put(per_expert.setdefault(stack, {}).setdefault(int(one.group(1)), {}), which, name)
        elif module not in shapes or len(shapes[module]) != 2:
            problems.append(f"{name}: {module} is not a projection of this model that takes LoRA (the Mamba "
                            f"in_proj / out_proj, attention q/k/v/o_proj, MLP and shared-expert up/down_proj, "
                            f"MoE latent projections, routed experts, lm_head)")
        else:
            put(pairs.setdefault(module, {}), which, name)
    factors = {}
    for module, got in sorted(pairs.items()):
        problems += _check_pair(config, module, got, shapes[module])
        if "A" in got and "B" in got:
            factors[module] = (got["A"][1], got["B"][1], config.scale(_short(module)))
    for stack, got in sorted(fused.items()):
        problems += _fused_experts(config, stack, got, shapes[stack], factors)
    for stack, got in sorted(per_expert.items()):
        problems += _per_expert(config, stack, got, shapes[stack], factors)
    problems += _unmatched_targets(config, shapes)
    if problems:
        raise CheckpointError(problems)
    return factors


def _fused_experts(config: LoraConfig, stack: str, got: dict, shape, factors: dict) -> list[str]:
    """PEFT's ParamWrapper factors of one expert stack [E, N, K]: A [r*E, K] (row e*r + j), B [N, r*E] (column
    j*E + e) -> factors[stack] = (A [E, r, K], B [E, N, r], scale)."""
    E, N, K = shape
    r = config.rank(_short(stack))
    problems = _check_pair(config, stack, got, (N, K), (r * E, K), (N, r * E))
    if not problems:
        a = got["A"][1].reshape(E, r, K)
        b = got["B"][1].reshape(N, r, E).transpose(2, 0, 1)
        factors[stack] = (a, b, config.scale(_short(stack)))
    return problems


def _per_expert(config: LoraConfig, stack: str, got: dict, shape, factors: dict) -> list[str]:
    """Per-expert module factors of one stack [E, N, K] (experts.{e}.up_proj: A [r, K], B [N, r]) stacked to
    A [E, r, K], B [E, N, r]; an expert the adapter leaves out gets zeros. Every expert of a stack must have
    the same rank and scale (one scale per stack)."""
    E, N, K = shape
    problems, ranks = [], {}
    for e, pair in sorted(got.items()):
        module = stack.replace(".experts.", f".experts.{e}.")
        if e >= E:
            problems.append(f"{module}: expert {e}, but this model's layers have {E} routed experts")
            continue
        problems += _check_pair(config, module, pair, (N, K))
        ranks[e] = (config.rank(_short(module)), config.scale(_short(module)))
    if len(set(ranks.values())) > 1:
        problems.append(f"{stack}: rank_pattern / alpha_pattern give its experts different ranks or scales "
                        f"({sorted(set(ranks.values()))}); one rank and scale per expert stack is supported")
    if problems:
        return problems
    (r, scale), = set(ranks.values())
    a, b = np.zeros((E, r, K), np.float32), np.zeros((E, N, r), np.float32)
    for e, pair in got.items():
        a[e], b[e] = pair["A"][1], pair["B"][1]
    factors[stack] = (a, b, scale)
    return []


def _unmatched_targets(config: LoraConfig, shapes) -> list[str]:
    """target_modules / target_parameters entries that name nothing of this model."""
    problems = []
    short = set()
    for m, shape in shapes.items():
        s = _short(m)
        short.add(s)
        if len(shape) == 3:                                  # an expert stack: its per-expert modules too
            short |= {s.replace(".experts.", f".experts.{e}.") for e in range(shape[0])}
    if isinstance(config.target_modules, tuple):
        for t in config.target_modules:
            if not any(s == t or s.endswith("." + t) for s in short):
                problems.append(f"target_modules: {t!r} names no projection of this model that takes LoRA")
    stacks = {"model." + _short(m) for m, shape in shapes.items() if len(shape) == 3}
    for t in config.target_parameters:
        if not any(k == t or k.endswith("." + t) for k in stacks):
            problems.append(f"target_parameters: {t!r} names no routed-expert parameter of this model "
                            f"(experts.up_proj / experts.down_proj)")
    return problems


def _short(module: str) -> str:
    """backbone.layers.3.mixer.up_proj -> layers.3.mixer.up_proj (what PEFT's patterns see, less `model.`);
    lm_head stays lm_head."""
    return module.split(".", 1)[1] if module.startswith("backbone.") else module


def _check_pair(config: LoraConfig, module: str, got: dict, shape: tuple[int, int], want_a=None,
                want_b=None) -> list[str]:
    """Problems of one module's (A, B): both present, A [r, K], B [N, r], r the config's rank for it (or the
    shapes given)."""
    n, k = shape
    r = config.rank(_short(module))
    problems = [f"{module}.lora_{w}.weight: missing (its lora_{'B' if w == 'A' else 'A'} is there)"
                for w in "AB" if w not in got]
    for which, want in (("A", want_a or (r, k)), ("B", want_b or (n, r))):
        if which in got:
            name, arr = got[which]
            if tuple(arr.shape) != tuple(want):
                side = ("input width K" if which == "A" else "output width N") + " or rank r"
                problems.append(f"{name}: shape {list(arr.shape)}, expected {list(want)} (r = {r} from the "
                                f"adapter config; this model's {module} is [{n}, {k}]): the {side} does not fit")
    return problems


# ---- writing --------------------------------------------------------------------------------------------
def peft_name(module: str, which: str) -> str:
    """backbone.layers.i.mixer.m, "A" -> base_model.model.model.layers.i.mixer.m.lora_A.weight (PEFT's name);
    lm_head -> base_model.model.lm_head.lora_A.weight."""
    if module == "lm_head":
        return f"base_model.model.lm_head.lora_{which}.weight"
    return f"base_model.model.model.{_short(module)}.lora_{which}.weight"


def _expert_tensors(config: LoraConfig, stack: str, a: np.ndarray, b: np.ndarray) -> dict[str, np.ndarray]:
    """An expert stack's factors (A [E, r, K], B [E, N, r]) under PEFT's names: the fused ParamWrapper form when
    the config has target_parameters, else one module per expert."""
    E, r, K = a.shape
    layer = int(stack.split(".")[2])
    proj = stack.rsplit(".", 1)[1]
    if config.target_parameters:
        params = [p for p in EXPERT_PARAMS if expert_param_targeted(config, layer, p)]
        depth = len(params) - 1 - params.index(proj)
        base = f"base_model.model.model.layers.{layer}.mixer.experts" + ".base_layer" * depth
        return {f"{base}.lora_A.weight": a.reshape(E * r, K),
                f"{base}.lora_B.weight": b.transpose(1, 2, 0).reshape(b.shape[1], r * E)}
    out = {}
    for e in range(E):
        module = stack.replace(".experts.", f".experts.{e}.")
        out[peft_name(module, "A")], out[peft_name(module, "B")] = a[e], b[e]
    return out


def is_adapter_file(name: str) -> bool:
    """Whether a directory entry is one of the adapter's files (what writing an adapter over a directory replaces)."""
    return name in (CONFIG_FILE, WEIGHTS_FILE)


def write_adapter(directory: str | os.PathLike, config: LoraConfig,
                  factors: Mapping[str, tuple[np.ndarray, np.ndarray]], *, overwrite: bool = False) -> list[Path]:
    """adapter_config.json + adapter_model.safetensors (float32) in `directory`, written as save_pretrained writes
    a checkpoint (files.staged_directory): both files or neither; a directory already holding an adapter is
    replaced only with overwrite=True, its other files kept; a path that is not a directory is a CheckpointError.
    factors: module -> (A [r, K], B [N, r]), or an expert stack's (A [E, r, K], B [E, N, r])."""
    out = Path(directory)
    tensors = {}
    for m, (a, b) in factors.items():
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if a.ndim == 3:
            tensors.update(_expert_tensors(config, m, a, b))
        else:
            tensors[peft_name(m, "A")], tensors[peft_name(m, "B")] = a, b
    with files.staged_directory(out, overwrite=overwrite, replaces=is_adapter_file) as d:
        save_safetensors(d / WEIGHTS_FILE, {k: np.ascontiguousarray(v) for k, v in tensors.items()},
                         metadata={"format": "pt"})
        write_json(d / CONFIG_FILE, config.to_peft())
    return [out / CONFIG_FILE, out / WEIGHTS_FILE]
