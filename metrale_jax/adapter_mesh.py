"""LoRA overlays on a model split over a mesh (sharding.py): each overlay is split with its base weights, and the
per-slot adapter table goes into the shard_map of every step.

The factors of a target whose base W [N, K] is
  split by output row (column parallel: Mamba in_proj, attention q/k/v, MLP / shared-expert up_proj, lm_head split
  by vocabulary):  A [S, R, K] replicated, B [S, N, R] split by row, in the base's row order (the Mamba in_proj's
  device-major permutation, sharding.in_proj_rows), so that each device's B rows are those of its own W rows;
  split by input column (row parallel: out_proj, o_proj, down_proj): A split by column, B replicated: each device
  adds B (A_d x_d) to its partial sum, and the block's one psum adds the shares, B (A x);
  replicated (MoE latent projections, an unsplit lm_head): both replicated;
  routed experts (expert parallel, [E, N, K] split by expert): A [S, E, R, K] and B [S, E, N, R] by expert.
The device view (sharding.device_view) is built with zero overlays of each target's local shapes
(`install_view_overlays`), so that its leaves line up with the model's; the specs then follow from the shapes.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from metrale_jax.layers import lora


def _layout(model, name: str):
    """The sharding layout of the base weights of target `name` (sharding.tensor_layout), or None unsharded."""
    from metrale_jax import sharding

    if model.tp is None:
        return None
    tensor = name if ".experts." in name else f"{name}.weight"
    return sharding.tensor_layout(tensor, model.config, model.tp)


def to_model_order(model, name: str, b: np.ndarray) -> np.ndarray:
    """B [..., N, R] with its rows in the checkpoint's order -> in the order the model holds its base rows."""
    layout = _layout(model, name)
    if layout is None or layout.rows is None:
        return b
    return np.take(b, layout.rows, axis=-2)


def to_checkpoint_order(model, name: str, b) -> np.ndarray:
    """The inverse of `to_model_order`: rows (axis -2) of B [..., N, R], or of a base weight [N, K] of target
    `name`, from the model's order back to the checkpoint's."""
    layout = _layout(model, name)
    b = np.asarray(b)
    if layout is None or layout.rows is None:
        return b
    out = np.empty_like(b)
    out[..., layout.rows, :] = b
    return out


def factor_specs(model, name: str) -> tuple[P, P]:
    """(A's spec, B's spec) of target `name`'s stacked factors on the model's mesh."""
    spec = tuple(_layout(model, name).spec)
    a = model.tp.axis
    if ".experts." in name:                              # [E, N, K] split by expert
        by_expert = P(None, a, None, None) if spec and spec[0] == a else P()
        return by_expert, by_expert
    rows, cols = (spec + (None, None))[:2]
    return (P(None, None, a) if cols == a else P()), (P(None, a, None) if rows == a else P())


def put(model, name: str, a, b, scale):
    """The stacked factors (A [S, .., R, K], B [S, .., N, R] in the model's row order, scale [S]) where the model
    keeps them: as they are on an unsharded model, else on the mesh with `factor_specs`."""
    if model.tp is None:
        return a, b, scale
    sa, sb = factor_specs(model, name)
    return (jax.device_put(np.asarray(a, np.float32), model.tp.sharding(sa)),
            jax.device_put(np.asarray(b, np.float32), model.tp.sharding(sb)),
            jax.device_put(np.asarray(scale, np.float32), model.tp.sharding(P())))


# ---- the device view ------------------------------------------------------------------------------------
def overlay_layout(model) -> tuple:
    """What a device view needs to carry the model's overlays: (target name, adapters, rank) per overlay
    (hashable: part of the view's cache key)."""
    from metrale_jax.adapters import lora_targets

    out = []
    for n, t in lora_targets(model).items():
        lo = t.lora
        if lo is not None:
            out.append((n, lo.num_adapters, lo.a.shape[-2]))
    return tuple(out)


def install_view_overlays(view, layout: tuple) -> None:
    """Put zero overlays of each target's local shapes on a device view (built under nnx.eval_shape)."""
    from metrale_jax.adapters import lora_targets

    if not layout:
        return
    tgts = lora_targets(view)
    for name, S, R in layout:
        t = tgts[name]
        *lead, N, K = t.shape
        a = jax.numpy.zeros((S, *lead, R, K), jax.numpy.float32)
        b = jax.numpy.zeros((S, *lead, N, R), jax.numpy.float32)
        t.set_lora(t.overlay(a, b, jax.numpy.zeros((S,), jax.numpy.float32)))


# ---- the per-slot table through shard_map ---------------------------------------------------------------
def table_argument() -> tuple:
    """The adapter table scoped around a mesh step, as extra shard_map arguments (replicated): () when none."""
    table = lora.scoped_table()
    return () if table is None else (table,)


@contextlib.contextmanager
def scoped(extra: tuple):
    """Inside shard_map: scope the table `table_argument` passed in (nothing when it passed none)."""
    with lora.slot_adapters(extra[0] if extra else None):
        yield
