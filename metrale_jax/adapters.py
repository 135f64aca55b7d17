"""LoRA adapters on a NemotronH: installed as overlays on its blocks' projections (layers/lora.py), never in
place of their weights.

A model holds its adapters in load order (`model.adapters`, index i + 1 in the per-slot tables; 0 = none) and
one active adapter (`model.active_adapter`) that its own entry points (forward, prefill, decode, score,
generate) apply to every row; the Engine applies each request's own (`Engine.submit(..., adapter=name)`).
`merge` folds an adapter into dense base weights (keeping the originals), `remove` takes adapters off and puts
merged weights back, so that removing every adapter leaves the model as it was, bit for bit.
Adapters on a model split over a mesh are refused (ConfigError): the overlays are not sharded.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from metrale_jax.errors import CheckpointError, ConfigError, WeightFormatError
from metrale_jax.layers.lora import LoraOverlay, UnmergedWeight
from metrale_jax.layers.projection import Projection
from metrale_jax.weights.containers import DenseWeight
from metrale_jax.weights.lora import LoraConfig, match_factors, read_config, read_factors, targets, write_adapter


@dataclasses.dataclass(frozen=True)
class AdapterInfo:
    """One loaded adapter: its name, config and the projections (module names) it targets."""

    name: str
    config: LoraConfig
    modules: tuple[str, ...]


def lora_projections(model) -> dict[str, Projection]:
    """The projections of the model's blocks that take LoRA, by checkpoint module name (not lm_head, not MTP)."""
    return {node.name: node for _, node in nnx.iter_graph(model.layers)
            if isinstance(node, Projection) and node.name.startswith("backbone.layers.")}


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
    _check_model(model)
    name = os.path.basename(os.path.normpath(directory)) if name is None else str(name)
    config = read_config(directory)
    projs = lora_projections(model)
    factors = match_factors(config, read_factors(directory), {n: p.shape for n, p in projs.items()},
                            model.config.num_hidden_layers)
    if not factors:
        raise CheckpointError(f"{directory}: the adapter holds no LoRA factors")
    install(model, name, config, factors)
    return name


def create(model, name: str, *, r: int, lora_alpha: float, target_modules, key: jax.Array,
           use_rslora: bool = False) -> str:
    """A fresh adapter for training, initialised as PEFT does: A ~ U(-1/sqrt(K), 1/sqrt(K)) (kaiming-uniform with
    a = sqrt(5)), B = 0 (so the model's outputs are unchanged until B is trained); active once made."""
    _check_model(model)
    config = LoraConfig(int(r), float(lora_alpha), bool(use_rslora), tuple(target_modules))
    projs = {n: p for n, p in lora_projections(model).items() if targets(config, n.split(".", 1)[1])}
    if not projs:
        raise ConfigError("target_modules", f"{tuple(target_modules)} names no projection of this model")
    factors = {}
    for i, (n, p) in enumerate(sorted(projs.items())):
        N, K = p.shape
        a = jax.random.uniform(jax.random.fold_in(key, i), (r, K), jnp.float32, -K ** -0.5, K ** -0.5)
        factors[n] = (np.asarray(a), np.zeros((N, r), np.float32), config.scale(n.split(".", 1)[1]))
    install(model, name, config, factors)
    return name


def install(model, name: str, config: LoraConfig, factors) -> None:
    """Add adapter `name` as the next slot of every overlay (factors: module -> (A [r, K], B [N, r], scale)) and
    make it active."""
    if any(a.name == name for a in model.adapters):
        raise ConfigError("name", f"an adapter named {name!r} is already loaded; unload it first")
    S = len(model.adapters)
    for n, proj in lora_projections(model).items():
        if proj.lora is None and n not in factors:
            continue
        N, K = proj.shape
        old = proj.lora
        a_old = np.zeros((S, 0, K), np.float32) if old is None else np.asarray(old.a[...])
        b_old = np.zeros((S, N, 0), np.float32) if old is None else np.asarray(old.b[...])
        s_old = np.zeros((S,), np.float32) if old is None else np.asarray(old.scale[...])
        a_new, b_new, s_new = factors.get(n, (np.zeros((0, K)), np.zeros((N, 0)), 0.0))
        R = max(a_old.shape[1], a_new.shape[0])
        a = np.concatenate([_pad(a_old, 1, R), _pad(np.asarray(a_new, np.float32)[None], 1, R)])
        b = np.concatenate([_pad(b_old, 2, R), _pad(np.asarray(b_new, np.float32)[None], 2, R)])
        overlay = LoraOverlay(a, b, np.append(s_old, np.float32(s_new)))
        if old is not None:
            overlay.merged, overlay.unmerged = old.merged, old.unmerged
        proj.lora = overlay
    model.adapters = (*model.adapters, AdapterInfo(name, config, tuple(sorted(factors))))
    model.active_adapter = name


def _pad(x: np.ndarray, axis: int, size: int) -> np.ndarray:
    """Zero-pad the rank axis of stacked factors to `size` (zeros add exact zero products)."""
    width = [(0, 0)] * x.ndim
    width[axis] = (0, size - x.shape[axis])
    return np.pad(x, width)


def _check_model(model) -> None:
    if model.tp is not None:
        raise ConfigError("adapter", "LoRA adapters on a model split over a mesh are not supported (the overlays "
                                     "are not sharded); load the adapter on an unsharded model")


# ---- choosing, merging, removing ----------------------------------------------------------------------------
def set_active(model, name: str | None) -> None:
    index_of(model, name)
    model.active_adapter = name


def merge(model, name: str | None = None) -> None:
    """Fold adapter `name` (default: the active one) into the dense base weights of every projection it targets:
    W + scale * B A in float32, rounded to W's dtype once; the originals are kept for `remove`. The overlay then
    skips that adapter. A projection whose base is quantized is a WeightFormatError (before anything changes)."""
    name = model.active_adapter if name is None else name
    i = index_of(model, name)
    if i == 0:
        raise ConfigError("adapter", "no adapter is active; name the one to merge")
    projs = lora_projections(model)
    info = model.adapters[i - 1]
    for n in info.modules:
        p = projs[n]
        if p.dense is None or p.installed_arms() != ("dense",):
            raise WeightFormatError(f"{n}: merge_adapter folds LoRA into dense weights, but this projection's base "
                                    f"is quantized (arms {p.installed_arms()}); serve the adapter as an overlay")
        if p.lora.merged:
            raise ConfigError("adapter", f"{n}: adapter {model.adapters[p.lora.merged - 1].name!r} is merged "
                                         f"already; unload it before merging {name!r}")
    for n in info.modules:
        p = projs[n]
        base = p.dense_weight()
        w = base.weight.astype(jnp.float32) + p.lora.scale[i - 1] * (p.lora.b[i - 1] @ p.lora.a[i - 1])
        p.lora.unmerged = UnmergedWeight(base)
        p.lora.merged = i
        p.install("dense", p.prepare("dense", DenseWeight(w.astype(base.weight.dtype))))


def remove(model, name: str | None = None) -> None:
    """Take adapter `name` off (None: every adapter), putting merged base weights back as they were."""
    names = [a.name for a in model.adapters] if name is None else [name]
    for n in names:
        _remove_one(model, index_of(model, n))


def _remove_one(model, i: int) -> None:
    """Remove slot i - 1 from every overlay; overlays left with no adapter go, restoring the original pytree."""
    for proj in lora_projections(model).values():
        lo = proj.lora
        if lo is None:
            continue
        if lo.merged == i:                                     # the exact original weights back
            proj.install("dense", lo.unmerged.get_value())
            lo.merged, lo.unmerged = 0, None
        keep = [s for s in range(lo.num_adapters) if s != i - 1]
        if not keep:
            proj.lora = None
            continue
        overlay = LoraOverlay(lo.a[...][np.array(keep)], lo.b[...][np.array(keep)], lo.scale[...][np.array(keep)])
        overlay.merged = lo.merged - (lo.merged > i)
        overlay.unmerged = lo.unmerged
        proj.lora = overlay
    removed = model.adapters[i - 1].name
    model.adapters = tuple(a for a in model.adapters if a.name != removed)
    if model.active_adapter == removed:
        model.active_adapter = None


# ---- saving -------------------------------------------------------------------------------------------------
def save(model, directory: str | os.PathLike, name: str | None = None) -> list:
    """Adapter `name` (default: the active one) as a PEFT adapter directory (adapter_config.json +
    adapter_model.safetensors) that `load` and PEFT read back."""
    name = model.active_adapter if name is None else name
    i = index_of(model, name)
    if i == 0:
        raise ConfigError("adapter", "no adapter is active; name the one to save")
    info, projs = model.adapters[i - 1], lora_projections(model)
    factors = {}
    for n in info.modules:
        r = info.config.rank(n.split(".", 1)[1])
        lo = projs[n].lora
        factors[n] = (np.asarray(lo.a[...][i - 1, :r]), np.asarray(lo.b[...][i - 1, :, :r]))
    return write_adapter(directory, info.config, factors)
