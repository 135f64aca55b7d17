"""Tensor and expert parallelism with jax.sharding: meshes, partition specs, row permutations, and the
shard_map wrapper that runs a model step as the same layer code on every device's share of the weights.

Layout over the mesh axis (tp devices), one all-reduce (psum) per block and nothing else in a step:
  Mamba-2    heads split: in_proj rows permuted into device-major [z_d | x_d | B_d | C_d | dt_d], conv channels
             [x_d | B_d | C_d], dt_bias / A_log / D / gated-norm weight by head, the SSM pool by head and the conv
             pool by (permuted) channel; out_proj by input column + psum. B_d / C_d are the groups device d's heads
             read (`mamba_groups`): n_groups / tp of them when tp divides n_groups, else each group repeated on
             every device that needs it (as vLLM does); a gated-norm group split over devices adds one psum of its
             sums of squares (blocks.gated_rmsnorm_across_devices).
  attention  q/k/v rows by head (a kv head repeated on each device whose query heads read it when tp does not
             divide num_key_value_heads: `kv_groups`), the KV pool by (repeated) kv head; o_proj columns + psum.
  MLP        up_proj rows, down_proj columns + psum.
  MoE        expert parallel: each device holds E/tp routed experts and adds their contributions for every
             token; the router, e_score_correction_bias and latent projections are replicated; shared
             experts split like the MLP; one psum for routed + shared.
  embeddings replicated (a lookup of B rows costs nothing and needs no collective).
  lm_head    split by vocabulary row when vocab_size % tp == 0 and it is not tied: its GEMV is the largest
             single read of a decode step; logits come out sharded over the vocabulary, with no collective
             in the step (whoever samples reduces them). Tied or indivisible: replicated.
Data parallelism over a second mesh axis ("dp", make_mesh(tp=..., dp=...)): the weights are replicated over it (each
dp row of devices holds one tensor-parallel replica); batch jobs without a cache (forward, score) split their rows
over it (`batch_spec`), a step on a caller's cache runs replicated over it, and the serving engine keeps one slot
pool per replica (`replica` gives replica i as a model of its own, runtime/engine_dp.py).
A step on a sharded model (NemotronH(mesh=...)) runs inside shard_map on a *device view*: the same NemotronH
class built with `local_config` sizes, whose layers reduce over the axis (their `tp_axis`). The global arrays hold
every device's share side by side (`storage_config`: repeated groups / kv heads counted once per device); the conv
pool's channels are stored in the permuted order (see `conv_channels_to_checkpoint_order`), and `checkpoint_order`
restores a tensor's checkpoint rows from one copy of each. Quantized containers (FP8 block / per-tensor, NVFP4,
stacked routed experts) are placed by sharding_quant.py with every scale beside the elements it scales.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from metrale_jax import adapter_mesh
from metrale_jax.config import ModelConfig
from metrale_jax.errors import CheckpointError, ConfigError
from metrale_jax.state.cache import ModelCache
from metrale_jax.weights.checkpoint import expected_tensors

TP_AXIS = "tp"
DP_AXIS = "dp"
_BLOCK_NORM = re.compile(r"^backbone\.layers\.\d+\.norm\.weight$")
_LAYER = re.compile(r"^backbone\.layers\.(?P<i>\d+)\.mixer\.(?P<suffix>.+)$")
_EXPERT = re.compile(r"^experts\.(\d+\.)?(up|down)_proj(\.weight)?$")
_ONE_EXPERT = re.compile(
    r"^(?P<mixer>backbone\.layers\.\d+\.mixer\.)experts\.(?P<e>\d+)\.(?P<proj>up|down)_proj\.weight$")


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """A mesh, the axis the model is split over, and the axis its replicas lie along (None: a mesh without one);
    hashable: it is static data of a sharded model."""

    mesh: Mesh
    axis: str = TP_AXIS
    dp_axis: str | None = None

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis]

    @property
    def dp(self) -> int:
        """The number of replicas (data-parallel size)."""
        return 1 if self.dp_axis is None else self.mesh.shape[self.dp_axis]

    def batch_spec(self, ndim: int) -> P:
        """A batch-major array [B, ...] with its rows split over the replicas (replicated when dp is 1)."""
        return P(self.dp_axis if self.dp > 1 else None, *(None,) * (ndim - 1))

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)


@dataclasses.dataclass(frozen=True)
class DeviceShare:
    """How one device's view of a sharded model is cut (NemotronH(shard_of=...)): the axis its blocks
    reduce over, the number of devices, whether lm_head is split by vocabulary row, and the global size (in
    channels) of a Mamba gated-norm group when such a group is split over devices (else None)."""

    axis: str
    size: int
    vocab: bool
    norm_group: int | None = None


def make_mesh(tp: int | None = None, devices: Sequence | None = None, axis: str = TP_AXIS, *, dp: int = 1) -> Mesh:
    """A (dp, tp) mesh with axes (DP_AXIS, `axis`): dp replicas of the model, each split over tp devices. devices:
    default jax.devices() (every process's, after jax.distributed.initialize); tp defaults to all of them / dp.
    Replica i takes devices [i*tp, (i+1)*tp), so that with tp dividing each host's device count a replica's
    devices share a host."""
    devices = list(jax.devices() if devices is None else devices)
    if not isinstance(dp, int) or dp < 1:
        raise ConfigError("dp", f"expected an integer >= 1, got {dp!r}")
    tp = len(devices) // dp if tp is None else tp
    if not isinstance(tp, int) or tp < 1 or tp * dp > len(devices):
        raise ConfigError("tp", f"expected tp >= 1 with tp * dp <= {len(devices)} (devices available), got tp "
                                f"{tp}, dp {dp}")
    grid = np.array(devices[:tp * dp], dtype=object).reshape(dp, tp)
    return Mesh(grid, (DP_AXIS, axis), axis_types=(AxisType.Auto,) * 2)


def tensor_parallel(mesh: Mesh, axis: str | None = None) -> TensorParallel:
    """Check a mesh for model splitting: the tensor-parallel axis (`axis`, else the only axis, else 'tp') and the
    data-parallel axis DP_AXIS when the mesh has it; every other axis must have size 1."""
    if not isinstance(mesh, Mesh):
        raise ConfigError("mesh", f"expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    rest = [n for n in names if n != DP_AXIS]
    axis = axis or (names[0] if len(names) == 1 else rest[0] if len(rest) == 1 else TP_AXIS)
    if axis not in names:
        raise ConfigError("mesh", f"has axes {names}; the tensor-parallel axis {axis!r} is not one of them")
    dp_axis = DP_AXIS if DP_AXIS in names and axis != DP_AXIS else None
    others = {n: mesh.shape[n] for n in names if n not in (axis, dp_axis) and mesh.shape[n] != 1}
    if others:
        raise ConfigError("mesh", f"axes {others} have size > 1; a model splits over the tensor-parallel axis "
                                  f"{axis!r} and replicates over {DP_AXIS!r} (data parallelism) only")
    if any(t != AxisType.Auto for t in mesh.axis_types):
        mesh = Mesh(mesh.devices, names, axis_types=(AxisType.Auto,) * len(names))   # shard_map + GSPMD
    return TensorParallel(mesh, axis, dp_axis)


# ---- sizes -------------------------------------------------------------------------------------
def vocab_sharded(config: ModelConfig, tp: int) -> bool:
    """Whether lm_head (and so the logits) is split by vocabulary row."""
    return tp > 1 and not config.tie_word_embeddings and config.vocab_size % tp == 0


def _group_runs(heads: int, groups: int, tp: int) -> list[list[int]]:
    """For each device, the global group of each run of its heads: device d holds heads [d*Hl, (d+1)*Hl)
    (Hl = heads/tp) cut into runs of gcd(Hl, heads/groups) heads, each inside one group (a group smaller than
    tp's share or split over devices is repeated on every device that needs it, as vLLM does)."""
    hl, per = heads // tp, heads // groups
    run = math.gcd(hl, per)
    return [[(d * hl + r * run) // per for r in range(hl // run)] for d in range(tp)]


def mamba_groups(config: ModelConfig, tp: int) -> list[list[int]]:
    """Device d's local Mamba groups (indices of the checkpoint's B/C groups, a group repeated where needed)."""
    return _group_runs(config.mamba_num_heads, config.n_groups, tp)


def kv_groups(config: ModelConfig, tp: int) -> list[list[int]]:
    """Device d's local kv heads (indices of the checkpoint's kv heads, repeated where its query heads need)."""
    return _group_runs(config.num_attention_heads, config.num_key_value_heads, tp)


def norm_spans_devices(config: ModelConfig, tp: int) -> bool:
    """Whether a Mamba gated-norm group (d_inner / n_groups channels) is split over devices, so that its mean
    square is reduced over the axis (blocks.gated_rmsnorm_across_devices)."""
    return "M" in config.hybrid_override_pattern and (config.mamba_num_heads // tp) % (
        config.mamba_num_heads // config.n_groups) != 0


def local_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The config one device's view is built with: heads, intermediate sizes (and the vocabulary when lm_head is
    split) divided by tp for the block kinds the model has; n_groups and num_key_value_heads become the number
    of groups / kv heads a device holds (`mamba_groups`, `kv_groups`: repeated where tp exceeds them or does not
    divide them). Routed experts keep the global count (the router is replicated; the layer holds E/tp of them).
    Raises ConfigError naming the field that tp does not divide."""
    kinds = set(config.hybrid_override_pattern)
    c = config
    need: list[tuple[str, int]] = []
    if "M" in kinds:
        need += [("mamba_num_heads", c.mamba_num_heads)]
    if "*" in kinds:
        need += [("num_attention_heads", c.num_attention_heads)]
    if "-" in kinds:
        need += [("intermediate_size", c.intermediate_size)]
    if "E" in kinds:
        need += [("n_routed_experts", c.n_routed_experts)]
        if c.n_shared_experts:
            need += [("moe_shared_expert_intermediate_size", c.moe_shared_expert_intermediate_size)]
    for field, value in need:
        if value % tp:
            raise ConfigError(field, f"{value} is not divisible by the tensor-parallel size {tp}")
    changes = {f: v // tp for f, v in need if f != "n_routed_experts"}
    if "M" in kinds:
        changes["n_groups"] = len(mamba_groups(c, tp)[0])
    if "*" in kinds:
        changes["num_key_value_heads"] = len(kv_groups(c, tp)[0])
    if vocab_sharded(c, tp):
        changes["vocab_size"] = c.vocab_size // tp
    return dataclasses.replace(c, **changes)


def storage_config(config: ModelConfig, tp: int) -> ModelConfig:
    """The config of a sharded model's global arrays: tp devices' shares side by side, so n_groups and
    num_key_value_heads count every device's (repeated) groups and kv heads. The same as `config` when tp
    divides them."""
    if tp == 1:
        return config
    local, changes = local_config(config, tp), {}
    kinds = set(config.hybrid_override_pattern)
    if "M" in kinds:
        changes["n_groups"] = local.n_groups * tp
    if "*" in kinds:
        changes["num_key_value_heads"] = local.num_key_value_heads * tp
    return dataclasses.replace(config, **changes)


# ---- row permutations (checkpoint order -> device-major order) ---------------------------------
def _group_rows(start: int, size: int, groups: Sequence[int]) -> list[np.ndarray]:
    return [np.arange(start + g * size, start + (g + 1) * size) for g in groups]


def conv_rows(config: ModelConfig, tp: int) -> np.ndarray:
    """conv channel order [x_d | B_d | C_d] for d = 0..tp-1, as indices into the checkpoint's [x | B | C] (a
    group's B / C channels repeated on each device that needs them)."""
    I, N, GN = config.d_inner, config.ssm_state_size, config.n_groups * config.ssm_state_size
    Il, parts = I // tp, []
    for d, groups in enumerate(mamba_groups(config, tp)):
        parts += [np.arange(d * Il, (d + 1) * Il), *_group_rows(I, N, groups), *_group_rows(I + GN, N, groups)]
    return np.concatenate(parts).astype(np.int64)


def in_proj_rows(config: ModelConfig, tp: int) -> np.ndarray:
    """in_proj row order [z_d | x_d | B_d | C_d | dt_d] for d = 0..tp-1, as indices into the checkpoint's
    [z | x | B | C | dt], so that device d's contiguous share is its own heads' and groups' rows (a group's
    B / C rows repeated on each device that needs them)."""
    I, N, H = config.d_inner, config.ssm_state_size, config.mamba_num_heads
    GN, Il, Hl, parts = config.n_groups * N, I // tp, H // tp, []
    for d, groups in enumerate(mamba_groups(config, tp)):
        parts += [np.arange(d * Il, (d + 1) * Il), np.arange(I + d * Il, I + (d + 1) * Il),
                  *_group_rows(2 * I, N, groups), *_group_rows(2 * I + GN, N, groups),
                  np.arange(2 * I + 2 * GN + d * Hl, 2 * I + 2 * GN + (d + 1) * Hl)]
    return np.concatenate(parts).astype(np.int64)


def kv_rows(config: ModelConfig, tp: int) -> np.ndarray | None:
    """k_proj / v_proj row order: each device's (repeated) kv heads' rows, as indices into the checkpoint's
    rows; None when tp divides the kv heads (a plain split)."""
    if config.num_key_value_heads % tp == 0:
        return None
    hd = config.head_dim
    return np.concatenate([r for groups in kv_groups(config, tp) for r in _group_rows(0, hd, groups)]
                          ).astype(np.int64)


def to_checkpoint_rows(arr, rows: np.ndarray | None, axis: int = 0) -> np.ndarray:
    """A stored array (`rows` along `axis`: indices into the checkpoint's rows, a row possibly repeated) back in
    the checkpoint's order (a repeated row's copies are equal: one is kept)."""
    arr = np.asarray(arr)
    if rows is None:
        return arr
    arr = np.moveaxis(arr, axis, 0)
    out = np.empty((int(rows.max()) + 1, *arr.shape[1:]), arr.dtype)
    out[rows] = arr
    return np.moveaxis(out, 0, axis)


def checkpoint_order(name: str, value, config: ModelConfig, tp: TensorParallel) -> np.ndarray:
    """A sharded model's tensor (rows in device-major order) back in the checkpoint's row order."""
    return to_checkpoint_rows(value, tensor_layout(name, config, tp).rows)


def conv_channels_to_checkpoint_order(conv_state, config: ModelConfig, tp: int) -> np.ndarray:
    """A sharded pool's conv_state [..., conv_dim, K-1] (device-major channels) in checkpoint channel order."""
    return to_checkpoint_rows(conv_state, conv_rows(config, tp), axis=-2)


def kv_heads_to_checkpoint_order(kv, config: ModelConfig, tp: int) -> np.ndarray:
    """A sharded KV pool's keys or values [..., kv_heads, head_dim] (each device's kv heads, repeated where
    needed) with the checkpoint's kv heads."""
    rows = None if config.num_key_value_heads % tp == 0 else np.concatenate(kv_groups(config, tp))
    return to_checkpoint_rows(kv, rows, axis=-2)


# ---- where each checkpoint tensor goes -----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Layout:
    """A checkpoint tensor's partition spec, and the row order (indices into the checkpoint's axis 0) of
    its global array, or None when it keeps the checkpoint's order."""

    spec: P
    rows: np.ndarray | None = None


def tensor_layout(name: str, config: ModelConfig, tp: TensorParallel) -> Layout:
    """The layout of an HF-named tensor (a routed expert's, or a layer's stacked experts: split by expert)."""
    a, n = tp.axis, tp.size
    if name in ("backbone.embeddings.weight", "backbone.norm_f.weight") or _BLOCK_NORM.match(name):
        return Layout(P())
    if name == "lm_head.weight":
        return Layout(P(a, None) if vocab_sharded(config, n) else P())
    m = _LAYER.match(name)
    if m is None:
        raise CheckpointError(f"{name}: no sharding rule for this tensor")
    kind, s = config.hybrid_override_pattern[int(m["i"])], m["suffix"]
    rows_by = P(a, None)
    cols_by = P(None, a)
    if kind == "M":
        table = {"in_proj.weight": Layout(rows_by, in_proj_rows(config, n)),
                 "conv1d.weight": Layout(P(a, None, None), conv_rows(config, n)),
                 "conv1d.bias": Layout(P(a), conv_rows(config, n)),
                 "dt_bias": Layout(P(a)), "A_log": Layout(P(a)), "D": Layout(P(a)), "norm.weight": Layout(P(a)),
                 "out_proj.weight": Layout(cols_by)}
    elif kind == "*":
        kv = kv_rows(config, n)
        table = {f"{p}_proj.weight": Layout(rows_by, None if p == "q" else kv) for p in "qkv"}
        table |= {f"{p}_proj.bias": Layout(P(a), None if p == "q" else kv) for p in "qkv"}
        table |= {"o_proj.weight": Layout(cols_by), "o_proj.bias": Layout(P())}
    elif kind == "-":
        table = _mlp_table("", a)
    else:
        if _EXPERT.match(s):
            return Layout(P(a, None, None))
        table = {"gate.weight": Layout(P()), "gate.e_score_correction_bias": Layout(P())}
        table |= _mlp_table("shared_experts.", a)
        table |= {f"fc{k}_latent_proj.{w}": Layout(P()) for k in (1, 2) for w in ("weight", "bias")}
    if s not in table:
        raise CheckpointError(f"{name}: no sharding rule for this tensor")
    return table[s]


def _mlp_table(prefix: str, a: str) -> dict[str, Layout]:
    return {f"{prefix}up_proj.weight": Layout(P(a, None)), f"{prefix}up_proj.bias": Layout(P(a)),
            f"{prefix}down_proj.weight": Layout(P(None, a)), f"{prefix}down_proj.bias": Layout(P())}


def is_routed_expert(name: str) -> bool:
    """Whether an HF name is a routed expert's weight (one expert's, or a layer's stacked experts)."""
    m = _LAYER.match(name)
    return m is not None and _EXPERT.match(m["suffix"]) is not None


def one_expert(name: str) -> tuple[str, int] | None:
    """(the layer's stacked name "<mixer>.experts.<proj>_proj", expert index) of one routed expert's weight."""
    m = _ONE_EXPERT.match(name)
    return None if m is None else (f"{m['mixer']}experts.{m['proj']}_proj", int(m["e"]))


def _fit(spec: P, ndim: int) -> P:
    return P(*(tuple(spec) + (None,) * ndim)[:ndim])


def place(name: str, value, config: ModelConfig, tp: TensorParallel, dtype) -> jax.Array:
    """One HF-named tensor (numpy / memory-mapped view, or jax array) on its shards, rows permuted by its
    layout and cast to dtype. From numpy, a split tensor's shares are read and converted one device at a
    time (never the whole tensor on the host), each share once per process, and only those of this process's
    devices (so in a multi-process run each process reads its own shares of the files)."""
    layout = tensor_layout(name, config, tp)
    if isinstance(value, jax.Array):
        v = value if layout.rows is None else jnp.take(value, jnp.asarray(layout.rows), axis=0)
        return jax.device_put(v.astype(dtype), tp.sharding(_fit(layout.spec, v.ndim)))
    return place_host(value, layout.spec, tp, layout.rows, dtype)


def host_source(a):
    """What shares are read from: a host array or memory-mapped view as it is (indexing it reads the indexed rows /
    columns only), a jax array fetched to the host once."""
    return np.asarray(a) if isinstance(a, jax.Array) else a


def take_rows(a, idx: np.ndarray, axis: int = 0) -> np.ndarray:
    """Entries `idx` of a host source along axis 0 or 1 (a contiguous run read as one slice)."""
    idx = np.asarray(idx)
    run = len(idx) > 0 and np.array_equal(idx, np.arange(idx[0], idx[0] + len(idx)))
    sel = slice(int(idx[0]), int(idx[0]) + len(idx)) if run else idx
    return np.asarray(a[sel] if axis == 0 else a[:, sel])


def place_host(a, spec: P, tp: TensorParallel, rows: np.ndarray | None = None, dtype=None) -> jax.Array:
    """A host source [N, ...] (numpy / memory-mapped view; a jax array is fetched once) on its shards (`spec`;
    rows: the stored row order as checkpoint indices, a row split), cast to dtype when given, through a callback
    that reads each device's share by its index only, once per process (the replicas along dp take the same
    share), and nothing of other processes' devices."""
    a = host_source(a)
    shape = tuple(np.shape(a)) if rows is None else (len(rows), *np.shape(a)[1:])
    dtype = None if dtype is None else jnp.dtype(dtype)

    def part(index):
        share = a[index] if rows is None else take_rows(a, rows[index[0]])[(slice(None), *index[1:])]
        return np.asarray(share, dtype=dtype)
    return jax.make_array_from_callback(shape, tp.sharding(_fit(spec, len(shape))), _read_once(part))


def place_stacked(members: Sequence, spec: P, tp: TensorParallel, dtype=None) -> jax.Array:
    """Host sources of one shape (a layer's routed experts, in order) stacked to [E, ...] and split by `spec`
    (by expert): each device reads only its own members' shares, cast to dtype when given."""
    shape = (len(members), *np.shape(members[0]))
    dtype = None if dtype is None else jnp.dtype(dtype)

    def part(index):
        return np.stack([np.asarray(members[e][index[1:]], dtype=dtype) for e in range(shape[0])[index[0]]])
    return jax.make_array_from_callback(shape, tp.sharding(_fit(spec, len(shape))), _read_once(part))


def _read_once(part):
    """`part` (index -> host array) remembering each index it read: the replicas along the dp axis take the same
    share, which is read from the file once."""
    seen: dict = {}

    def once(index):
        key = tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in index)
        if key not in seen:
            seen[key] = part(index)
        return seen[key]
    return once


def place_experts(name: str, members: Sequence, config: ModelConfig, tp: TensorParallel, dtype) -> jax.Array:
    """A layer's routed experts (one [N, K] view each, in order) stacked to [E, N, K] and split by expert:
    each device reads only its own experts."""
    return place_stacked(members, tensor_layout(name, config, tp).spec, tp, dtype)


class ShardedTensors(dict):
    """HF-named tensors already permuted and placed on a mesh by `shard_tensors` (so that
    NemotronH(..., mesh=...) does not place them again)."""


def shard_tensors(config: ModelConfig, tensors, tp: TensorParallel, dtype) -> ShardedTensors:
    """Place HF-named tensors (a mapping, or (name, array) pairs taken one at a time) on their shards, in
    `dtype` except those the checkpoint table keeps in float32. A layer's routed experts, given one by one,
    are stacked [E, ...] under "<mixer>.experts.up_proj" / ".down_proj" once all E have come."""
    if isinstance(tensors, ShardedTensors):
        return tensors
    local_config(config, tp.size)                  # a size tp does not divide: ConfigError before any placement
    f32 = {n for n, s in expected_tensors(config).items() if s.keep_f32}
    E = config.n_routed_experts
    out = ShardedTensors()
    pending: dict[str, dict[int, object]] = {}
    for name, value in (tensors.items() if isinstance(tensors, Mapping) else tensors):
        m = _ONE_EXPERT.match(name)
        if m is None:
            out[name] = place(name, value, config, tp, jnp.float32 if name in f32 else dtype)
            continue
        key = f"{m['mixer']}experts.{m['proj']}_proj"
        group = pending.setdefault(key, {})
        group[int(m["e"])] = value
        if len(group) == E:
            del pending[key]
            out[key] = place_experts(key, [group[e] for e in range(E)], config, tp, dtype)
    if pending:
        raise CheckpointError([f"{k}: {len(v)} of {E} routed experts given" for k, v in pending.items()])
    return out


# ---- device views ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DeviceView:
    """What shard_map needs to run a step on one device: the view's pytree structure (local sizes, layers
    reducing over the axis) and each weight's partition spec, in the model's leaf order."""

    treedef: object
    leaf_specs: tuple


def _spec_from_shapes(path: str, global_shape, local_shape, tp: TensorParallel) -> P:
    """The spec that cuts global_shape into local_shape: at most one axis, divided by tp."""
    split = [i for i, (g, l) in enumerate(zip(global_shape, local_shape)) if g != l]
    if len(global_shape) != len(local_shape) or len(split) > 1 or \
            any(global_shape[i] != local_shape[i] * tp.size for i in split):
        raise ConfigError("mesh", f"weight {path}: shape {tuple(global_shape)} does not split into the device "
                                  f"view's {tuple(local_shape)} over {tp.size} devices")
    return P(*(tp.axis if i in split else None for i in range(len(global_shape))))


def device_view(model) -> DeviceView:
    """The device view of a sharded NemotronH (built once per model structure)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(model)
    shapes = tuple((jax.tree_util.keystr(p), tuple(x.shape)) for p, x in leaves)
    return _device_view(type(model), model.config, model.dtype, model.levers, model.tp, treedef, shapes,
                        adapter_mesh.overlay_layout(model), getattr(model, "shard_formats", ()))


@functools.lru_cache(maxsize=16)
def _device_view(cls, config, dtype, levers, tp: TensorParallel, treedef, shapes, overlays=(),
                 formats=()) -> DeviceView:
    from metrale_jax import sharding_quant

    lc = local_config(config, tp.size)
    local_shapes = {}
    for name, spec in expected_tensors(storage_config(config, tp.size)).items():
        e = _EXPERT.match(_LAYER.match(name)["suffix"]) if _LAYER.match(name) else None
        name = name if e is None else name.split(".experts.")[0] + f".experts.{e[2]}_proj"
        shape = list(spec.shape if e is None else (config.n_routed_experts, *spec.shape))
        for axis, part in enumerate(tensor_layout(name, config, tp).spec):
            if part is not None:
                shape[axis] //= tp.size
        local_shapes[name] = (tuple(shape), jnp.float32 if spec.keep_f32 else dtype)

    def build():
        tensors = {n: jnp.zeros(s, d) for n, (s, d) in local_shapes.items()}
        tensors |= {n: sharding_quant.local_container(tree, leaves, tp.size) for n, tree, leaves in formats}
        norm = config.gated_norm_group_size if norm_spans_devices(config, tp.size) else None
        share = DeviceShare(tp.axis, tp.size, vocab_sharded(config, tp.size), norm)
        view = cls(lc, tensors, dtype=dtype, levers=levers, shard_of=share)
        adapter_mesh.install_view_overlays(view, overlays)          # LoRA overlays of local shapes
        return view

    local, local_def = jax.tree_util.tree_flatten_with_path(nnx.eval_shape(build))
    local_paths = [jax.tree_util.keystr(p) for p, _ in local]
    if local_paths != [p for p, _ in shapes]:
        missing = sorted(set(local_paths) ^ {p for p, _ in shapes})
        raise ConfigError("mesh", f"the model's weights differ from its device view's ({missing[:4]}): only "
                                  "models as built by NemotronH can be sharded")
    specs = tuple(_spec_from_shapes(p, g, tuple(x.shape), tp) for (p, g), (_, x) in zip(shapes, local))
    return DeviceView(local_def, specs)


def cache_specs(config: ModelConfig, tp: TensorParallel) -> ModelCache:
    """A ModelCache of partition specs: the SSM pool by head, the conv pool by channel, the KV pool by kv
    head, seq_lens replicated (groups and kv heads a device repeats are stored once per device)."""
    g = jax.eval_shape(lambda: ModelCache.for_config(storage_config(config, tp.size), 1, 1))
    l = jax.eval_shape(lambda: ModelCache.for_config(local_config(config, tp.size), 1, 1))
    return jax.tree.map(lambda a, b: _spec_from_shapes("cache", a.shape, b.shape, tp), g, l)


def new_cache(config: ModelConfig, tp: TensorParallel, max_slots: int, max_len: int, dtype) -> ModelCache:
    """A zeroed ModelCache created directly on its shards."""
    shardings = jax.tree.map(tp.sharding, cache_specs(config, tp))
    stored = storage_config(config, tp.size)
    return jax.jit(lambda: ModelCache.for_config(stored, max_slots, max_len, dtype), out_shardings=shardings)()


def logits_spec(model, ndim: int, *, batch: bool = False) -> P:
    """Logits [B, ..., V]: split over the vocabulary when lm_head is; batch: rows split over the replicas (a
    step run with run_sharded(batch=True))."""
    v = model.tp.axis if vocab_sharded(model.config, model.tp.size) else None
    rows = model.tp.batch_spec(1)[0] if batch else None
    return P(rows, *(None,) * (ndim - 2), v)


def run_sharded(step, model, *args, out_specs, batch: bool = False, **kwargs):
    """step(device view, *args, **kwargs) on every device through shard_map. Arguments: the model (each
    weight by its spec), ModelCache / SsmPool / KvPool (by their specs), arrays (replicated; batch=True: split
    by row over the replicas, `TensorParallel.batch_spec`, so each replica runs its rows), None."""
    tp = model.tp
    view = device_view(model)
    specs = cache_specs(model.config, tp)
    arg_specs = {ModelCache: specs, type(specs.ssm): specs.ssm, type(specs.kv): specs.kv}
    live = [i for i, a in enumerate(args) if a is not None]
    def spec(a):
        if type(a) in arg_specs:
            return arg_specs[type(a)]
        return tp.batch_spec(np.ndim(a)) if batch else P()

    table = adapter_mesh.table_argument()    # the LoRA adapter table in scope: a row's entry, split like the rows
    in_specs = (list(view.leaf_specs), tuple(spec(t) for t in table), *(spec(args[i]) for i in live))

    def body(leaves, table, *live_args):
        full = list(args)
        for i, a in zip(live, live_args):
            full[i] = a
        with adapter_mesh.scoped(table):
            return step(jax.tree.unflatten(view.treedef, leaves), *full, **kwargs)

    fn = jax.shard_map(body, mesh=tp.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return fn(jax.tree.leaves(model), table, *(args[i] for i in live))


def check_placement(model) -> None:
    """Every weight of a sharded model lies on the mesh with the spec of its device view (an internal
    consistency check of the tensor table against the layers' weights)."""
    view = device_view(model)
    leaves = jax.tree_util.tree_flatten_with_path(model)[0]
    for (path, x), spec in zip(leaves, view.leaf_specs):
        want = model.tp.sharding(spec)
        if not isinstance(x, jax.Array) or not x.sharding.is_equivalent_to(want, x.ndim):
            raise ConfigError("mesh", f"weight {jax.tree_util.keystr(path)} is placed as "
                                      f"{getattr(x, 'sharding', type(x).__name__)}, expected {spec}")


COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
_HLO_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = .*?\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(", re.M)


def collective_counts(hlo_text: str) -> dict[str, int]:
    """How many of each cross-device collective a compiled module's HLO text holds (async pairs once)."""
    found = _HLO_OP.findall(hlo_text)
    return {op: found.count(op) for op in COLLECTIVES}


# ---- the serving runtime's state on a mesh (runtime/steps.py, runtime/engine.py) ---------------
def slot_specs(config: ModelConfig, tp: TensorParallel):
    """Partition specs of one slot's state (a SlotState and a KvSlotState, as snapshots and captures hold
    it): the cache specs without the slot axis."""
    from metrale_jax.state.kv_pool import KvSlotState
    from metrale_jax.state.ssm_pool import SlotState

    c = cache_specs(config, tp)
    drop = lambda s: P(s[0], *s[2:])
    return SlotState(drop(c.ssm.conv_state), drop(c.ssm.ssm_state)), KvSlotState(drop(c.kv.k), drop(c.kv.v))


def state_specs(tree, config: ModelConfig, tp: TensorParallel):
    """Partition specs for a pytree of runtime values: a ModelCache / SsmPool / KvPool by the cache specs,
    a SlotState / KvSlotState by `slot_specs`, any other array replicated (None stays None)."""
    from metrale_jax.state.kv_pool import KvSlotState
    from metrale_jax.state.ssm_pool import SlotState

    cache = cache_specs(config, tp)
    ssm_slot, kv_slot = slot_specs(config, tp)
    by_type = {ModelCache: cache, type(cache.ssm): cache.ssm, type(cache.kv): cache.kv, SlotState: ssm_slot,
               KvSlotState: kv_slot}
    return jax.tree.map(lambda x: by_type.get(type(x), P()), tree, is_leaf=lambda x: type(x) in by_type)


def run_sharded_state(fn, tp: TensorParallel, config: ModelConfig, *args, **kwargs):
    """fn(*args, **kwargs) on every device's share of the runtime state through shard_map, for functions
    without a model that act on each slot's values alone (zero a slot, copy a snapshot out or in): the
    arguments and results take their `state_specs`, so they stay split as they came and need no collective."""
    out_specs = state_specs(jax.eval_shape(functools.partial(fn, **kwargs), *args), config, tp)
    fn = jax.shard_map(functools.partial(fn, **kwargs), mesh=tp.mesh, in_specs=state_specs(args, config, tp),
                       out_specs=out_specs, check_vma=False)
    return fn(*args)
