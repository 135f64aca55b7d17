"""LoRA adapters on a NemotronH: installed as overlays on its projections (layers/lora.py: the blocks'
projections and lm_head) and on its MoE layers' routed-expert stacks (ExpertLoraOverlay beside the grouped GEMMs),
never in place of their weights.

A model holds its adapters in load order (`model.adapters`, index i + 1 in the per-slot tables; 0 = none) and
one active adapter (`model.active_adapter`) that its own entry points (forward, prefill, decode, score,
generate) apply to every row; the Engine applies each request's own (`Engine.submit(..., adapter=name)`).
`merge` folds an adapter into dense base weights (keeping the originals), `remove` takes adapters off and puts
merged weights back, so that removing every adapter leaves the model as it was, bit for bit.
On a model split over a mesh the overlays are split with their base weights (adapter_mesh.py); merging there is
refused (ConfigError).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from metrale_jax import adapter_mesh
from metrale_jax.arguments import integer, real, shown
from metrale_jax.errors import CheckpointError, ConfigError, WeightFormatError
from metrale_jax.layers.lora import ExpertLoraOverlay, LoraOverlay, UnmergedWeight
from metrale_jax.layers.moe import NemotronMoELayer
from metrale_jax.layers.projection import Projection, QuantWeight
from metrale_jax.weights.containers import DenseWeight
from metrale_jax.weights.lora import (LoraConfig, match_factors, read_config, read_factors, regex_problem,
                                      split_full_copies, targets, write_adapter)

# how far a full copy (modules_to_save, lm_head.base_layer) may differ from the model's weights and still count as
# the same tensor (relative Frobenius norm: covers a bfloat16 round trip of the same weights)
SAME_COPY = 1e-2


@dataclasses.dataclass(frozen=True)
class AdapterInfo:
    """One loaded adapter: its name, config and the targets (module names) it has factors for."""

    name: str
    config: LoraConfig
    modules: tuple[str, ...]


def lora_projections(model) -> dict[str, Projection]:
    """The projections of the model's blocks that take LoRA, by checkpoint module name (not lm_head, not MTP)."""
    return {node.name: node for _, node in nnx.iter_graph(model.layers)
            if isinstance(node, Projection) and node.name.startswith("backbone.layers.")}


@dataclasses.dataclass(frozen=True)
class Target:
    """Something an adapter can target: a Projection (its `lora`; shape (N, K)) or a MoE layer's routed-expert
    stack (its experts_up_lora / experts_down_lora beside experts_up / experts_down; shape (E, N, K))."""

    name: str
    owner: object
    attr: str                     # the overlay's attribute on owner
    base_attr: str | None = None  # an expert stack's weights' attribute on owner (None: a Projection)

    @property
    def lora(self):
        return getattr(self.owner, self.attr)

    def set_lora(self, overlay) -> None:
        setattr(self.owner, self.attr, overlay)

    @property
    def shape(self) -> tuple[int, ...]:
        if self.base_attr is None:
            return self.owner.shape
        return tuple(getattr(self.owner, self.base_attr).shape)

    def overlay(self, a, b, scale):
        return (LoraOverlay if self.base_attr is None else ExpertLoraOverlay)(a, b, scale)


def lora_targets(model) -> dict[str, Target]:
    """Every target by module name: the blocks' projections, lm_head (when not tied), the routed-expert stacks
    (backbone.layers.i.mixer.experts.up_proj / .down_proj)."""
    out = {n: Target(n, p, "lora") for n, p in lora_projections(model).items()}
    if model.lm_head is not None:
        out["lm_head"] = Target("lm_head", model.lm_head, "lora")
    for layer in model.layers:
        if isinstance(layer, NemotronMoELayer):
            for proj in ("up", "down"):
                n = f"backbone.layers.{layer.layer_idx}.mixer.experts.{proj}_proj"
                out[n] = Target(n, layer, f"experts_{proj}_lora", f"experts_{proj}")
    return out


def pattern_name(module: str) -> str:
    """What PEFT's target / rank / alpha patterns see: backbone.layers.3.mixer.up_proj -> layers.3.mixer.up_proj
    (less `model.`); lm_head stays lm_head."""
    return module.split(".", 1)[1] if module.startswith("backbone.") else module


def index_of(model, name: str | None) -> int:
    """An adapter's index in the per-slot tables (0 for None); ConfigError naming an unknown one."""
    if name is None:
        return 0
    names = [a.name for a in model.adapters]
    if name not in names:
        raise ConfigError("adapter", f"no adapter named {name!r} is loaded (loaded: {names})")
    return names.index(name) + 1


def slot_table(model, num_slots: int) -> jax.Array | None:
    """The per-slot table the model's own entry points scope: every slot on the active adapter, or None."""
    if model.active_adapter is None:
        return None
    return jnp.full((num_slots,), index_of(model, model.active_adapter), jnp.int32)


# ---- loading and creating ---------------------------------------------------------------------------------
def load(model, directory: str | os.PathLike, name: str | None = None) -> str:
    """Install the PEFT adapter in `directory` under `name` (default: the directory's name) and make it active."""
    name = os.path.basename(os.path.normpath(directory)) if name is None else str(name)
    config = read_config(directory)
    tgts = lora_targets(model)
    tensors, copies = split_full_copies(read_factors(directory))
    shapes = {n: adapter_mesh.checkpoint_shape(model, n, t.shape) for n, t in tgts.items()}
    factors = match_factors(config, tensors, shapes, model.config.num_hidden_layers)
    factors.update(_full_copies(model, config, copies, directory))
    if not factors and not copies:
        raise CheckpointError(f"{directory}: the adapter holds no LoRA factors")
    install(model, name, config, factors)
    return name


def _full_copies(model, config: LoraConfig, copies: dict, directory) -> dict:
    """Check the adapter's full copies (name -> (file name, array)) against the model's tensors. The embeddings'
    copy must equal the model's (a replaced embedding table is not supported). lm_head's: equal to the model's,
    or, when modules_to_save names lm_head, a replacement W' served as the full-rank overlay W x + (W' - W) x
    (A = I, scale 1). Returns those overlays' factors."""
    problems, factors = [], {}
    listed = {"backbone.embeddings.weight": bool({"embeddings", "embed_tokens"} & set(config.modules_to_save)),
              "lm_head.weight": "lm_head" in config.modules_to_save}
    for tensor, named in listed.items():
        if named and tensor not in copies:
            problems.append(f"{directory}: modules_to_save names {tensor.split('.')[-2]}, but the adapter holds no "
                            f"full copy of it")
    for tensor, (file_name, arr) in sorted(copies.items()):
        if tensor == "lm_head.weight" and model.lm_head is None:
            problems.append(f"{file_name}: a copy of lm_head, but this model ties lm_head to the embeddings")
            continue
        base = model.embeddings[...] if tensor.startswith("backbone.") else model.lm_head.base_weight()
        w = np.asarray(base.dequantize(jnp.float32) if hasattr(base, "dequantize") else base, np.float32)
        w = adapter_mesh.to_checkpoint_order(model, tensor.removesuffix(".weight"), w)
        if tuple(arr.shape) != w.shape:
            problems.append(f"{file_name}: shape {list(arr.shape)}, expected {list(w.shape)} (this model's {tensor}): "
                            f"an adapter for another base model")
            continue
        diff = float(np.linalg.norm(arr - w) / max(float(np.linalg.norm(w)), 1e-30))
        if diff <= SAME_COPY:
            continue
        if tensor == "lm_head.weight" and listed[tensor] and ".base_layer." not in file_name:
            factors["lm_head"] = (np.eye(w.shape[1], dtype=np.float32), arr - w, 1.0)
        elif tensor == "lm_head.weight":
            problems.append(f"{file_name}: differs from this model's lm_head.weight by {diff:.3g} (relative): the "
                            f"adapter was made on another base model")
        else:
            problems.append(f"{file_name}: differs from this model's embeddings by {diff:.3g} (relative); a "
                            f"replaced embedding table (modules_to_save) is not supported")
    if problems:
        raise CheckpointError(problems)
    return factors


def _target_modules(value) -> tuple[str, ...] | str:
    """add_adapter's target_modules as PEFT takes it: a list of module names (each the name or its dotted end) or
    one string, a regex matched against the whole module name; else a ConfigError."""
    if isinstance(value, str):
        if why := regex_problem(value):
            raise ConfigError("target_modules", f"{value!r:.60} is not a valid regex ({why})")
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(t, str) for t in value):
        return tuple(value)
    raise ConfigError("target_modules", f"expected a list of module names or a regex string, got {shown(value)}")


def create(model, name: str, *, r: int, lora_alpha: float, target_modules, key: jax.Array,
           use_rslora: bool = False) -> str:
    """A fresh adapter for training on the projections target_modules names (lm_head included), initialised as
    PEFT does: A ~ U(-1/sqrt(K), 1/sqrt(K)) (kaiming-uniform with a = sqrt(5)), B = 0 (so the model's outputs are
    unchanged until B is trained); active once made."""
    config = LoraConfig(integer("r", r, 1), real("lora_alpha", lora_alpha, lambda v: True, "a finite number"),
                        bool(use_rslora), _target_modules(target_modules))
    projs = {n: t for n, t in lora_targets(model).items() if t.base_attr is None and targets(config, pattern_name(n))}
    if not projs:
        raise ConfigError("target_modules", f"{config.target_modules!r:.80} names no projection of this model")
    factors = {}
    for i, (n, t) in enumerate(sorted(projs.items())):
        N, K = adapter_mesh.checkpoint_shape(model, n, t.shape)
        a = jax.random.uniform(jax.random.fold_in(key, i), (r, K), jnp.float32, -K ** -0.5, K ** -0.5)
        factors[n] = (np.asarray(a), np.zeros((N, r), np.float32), config.scale(pattern_name(n)))
    install(model, name, config, factors)
    return name


def install(model, name: str, config: LoraConfig, factors) -> None:
    """Add adapter `name` as the next slot of every overlay (factors: target -> (A [.., r, K], B [.., N, r],
    scale), B's rows in the checkpoint's order) and make it active."""
    if any(a.name == name for a in model.adapters):
        raise ConfigError("name", f"an adapter named {name!r} is already loaded; unload it first")
    S = len(model.adapters)
    for n, tgt in lora_targets(model).items():
        if tgt.lora is None and n not in factors:
            continue
        *lead, N, K = tgt.shape
        old = tgt.lora
        a_old = np.zeros((S, *lead, 0, K), np.float32) if old is None else np.asarray(old.a[...])
        b_old = np.zeros((S, *lead, N, 0), np.float32) if old is None else np.asarray(old.b[...])
        s_old = np.zeros((S,), np.float32) if old is None else np.asarray(old.scale[...])
        a_new, b_new, s_new = factors.get(n, (np.zeros((*lead, 0, K)), np.zeros((*lead, N, 0)), 0.0))
        b_new = adapter_mesh.to_model_order(model, n, np.asarray(b_new, np.float32))
        R = max(a_old.shape[-2], a_new.shape[-2])
        a = np.concatenate([_pad(a_old, -2, R), _pad(np.asarray(a_new, np.float32)[None], -2, R)])
        b = np.concatenate([_pad(b_old, -1, R), _pad(b_new[None], -1, R)])
        overlay = tgt.overlay(*adapter_mesh.put(model, n, a, b, np.append(s_old, np.float32(s_new))))
        if old is not None:
            overlay.merged, overlay.unmerged = old.merged, old.unmerged
        tgt.set_lora(overlay)
    model.adapters = (*model.adapters, AdapterInfo(name, config, tuple(sorted(factors))))
    model.active_adapter = name


def _pad(x: np.ndarray, axis: int, size: int) -> np.ndarray:
    """Zero-pad the rank axis of stacked factors to `size` (zeros add exact zero products)."""
    width = [(0, 0)] * x.ndim
    width[axis] = (0, size - x.shape[axis])
    return np.pad(x, width)


# ---- choosing, merging, removing ----------------------------------------------------------------------------
def set_active(model, name: str | None) -> None:
    index_of(model, name)
    model.active_adapter = name


def merge(model, name: str | None = None) -> None:
    """Fold adapter `name` (default: the active one) into the dense base weights of every target it has:
    W + scale * B A in float32, rounded to W's dtype once; the originals are kept for `remove`. The overlay then
    skips that adapter. A target whose base is quantized is a WeightFormatError, a model split over a mesh a
    ConfigError (before anything changes)."""
    name = model.active_adapter if name is None else name
    i = index_of(model, name)
    if i == 0:
        raise ConfigError("adapter", "no adapter is active; name the one to merge")
    if model.tp is not None:
        raise ConfigError("adapter", "merge_adapter on a model split over a mesh is not supported; serve the "
                                     "adapter as an overlay, or merge on the unsharded model before splitting it")
    tgts = lora_targets(model)
    info = model.adapters[i - 1]
    for n in info.modules:
        _check_mergeable(model, n, tgts[n], name)
    for n in info.modules:
        t = tgts[n]
        lo = t.lora
        delta = lo.scale[i - 1] * jnp.matmul(lo.b[i - 1], lo.a[i - 1], precision=jax.lax.Precision.HIGHEST)
        if t.base_attr is None:
            p = t.owner
            base = p.dense_weight()
            lo.unmerged = UnmergedWeight(base)
            p.install("dense", p.prepare("dense", DenseWeight((base.weight.astype(jnp.float32) + delta)
                                                              .astype(base.weight.dtype))))
        else:
            base = getattr(t.owner, t.base_attr)[...]
            lo.unmerged = UnmergedWeight(base)
            setattr(t.owner, t.base_attr, nnx.Param((base.astype(jnp.float32) + delta).astype(base.dtype)))
        lo.merged = i


def _check_mergeable(model, n: str, t: Target, name: str) -> None:
    if t.base_attr is None:
        p = t.owner
        if p.dense is None or p.installed_arms() != ("dense",):
            raise WeightFormatError(f"{n}: merge_adapter folds LoRA into dense weights, but this projection's base "
                                    f"is quantized (arms {p.installed_arms()}); serve the adapter as an overlay")
    elif isinstance(getattr(t.owner, t.base_attr), QuantWeight):
        raise WeightFormatError(f"{n}: merge_adapter folds LoRA into dense weights, but these routed experts are "
                                f"quantized; serve the adapter as an overlay")
    if t.lora.merged:
        raise ConfigError("adapter", f"{n}: adapter {model.adapters[t.lora.merged - 1].name!r} is merged already; "
                                     f"unload it before merging {name!r}")


def remove(model, name: str | None = None) -> None:
    """Take adapter `name` off (None: every adapter), putting merged base weights back as they were."""
    names = [a.name for a in model.adapters] if name is None else [name]
    for n in names:
        _remove_one(model, index_of(model, n))


def _remove_one(model, i: int) -> None:
    """Remove slot i - 1 from every overlay; overlays left with no adapter go, restoring the original pytree."""
    for n, t in lora_targets(model).items():
        lo = t.lora
        if lo is None:
            continue
        if lo.merged == i:                                     # the exact original weights back
            if t.base_attr is None:
                t.owner.install("dense", lo.unmerged.get_value())
            else:
                setattr(t.owner, t.base_attr, nnx.Param(lo.unmerged.get_value()))
            lo.merged, lo.unmerged = 0, None
        keep = np.array([s for s in range(lo.num_adapters) if s != i - 1], np.int64)
        if not keep.size:
            t.set_lora(None)
            continue
        overlay = t.overlay(*adapter_mesh.put(model, n, np.asarray(lo.a[...])[keep], np.asarray(lo.b[...])[keep],
                                              np.asarray(lo.scale[...])[keep]))
        overlay.merged = lo.merged - (lo.merged > i)
        overlay.unmerged = lo.unmerged
        t.set_lora(overlay)
    removed = model.adapters[i - 1].name
    model.adapters = tuple(a for a in model.adapters if a.name != removed)
    if model.active_adapter == removed:
        model.active_adapter = None


# ---- saving -------------------------------------------------------------------------------------------------
def save(model, directory: str | os.PathLike, name: str | None = None, *, overwrite: bool = False) -> list:
    """Adapter `name` (default: the active one) as a PEFT adapter directory (adapter_config.json +
    adapter_model.safetensors) that `load` and PEFT read back; a directory already holding an adapter is replaced
    only with overwrite=True (weights/lora.write_adapter). An adapter carrying full copies (modules_to_save) is
    not written: ConfigError."""
    name = model.active_adapter if name is None else name
    i = index_of(model, name)
    if i == 0:
        raise ConfigError("adapter", "no adapter is active; name the one to save")
    info, tgts = model.adapters[i - 1], lora_targets(model)
    if info.config.modules_to_save:
        raise ConfigError("adapter", f"{name!r} carries full copies (modules_to_save {list(info.config.modules_to_save)}"
                                     f"), which save_adapter does not write")
    factors = {}
    for n in info.modules:
        lo = tgts[n].lora
        a, b = np.asarray(lo.a[...][i - 1]), np.asarray(lo.b[...][i - 1])
        r = info.config.rank(pattern_name(n))
        factors[n] = (a[..., :r, :], adapter_mesh.to_checkpoint_order(model, n, b[..., :r]))
    return write_adapter(directory, info.config, factors, overwrite=overwrite)
