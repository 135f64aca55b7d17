"""Quantized weights under tensor parallelism: FP8 (block-scaled, or ModelOpt per-tensor expanded to the block grid)
and NVFP4 containers placed on a mesh so that every device's share holds exactly the checkpoint's numbers, and
taken back to the checkpoint's layout for save_pretrained.

  row split (in_proj, q/k/v, up_proj, vocabulary-split lm_head): the codes go with their rows (in the row order
      sharding.tensor_layout gives: the Mamba device-major permutation, repeated groups / kv heads). FP8: where
      N_local is a multiple of 128 and each device 128-row block's rows come from checkpoint blocks of one scale,
      the device's grid has N_local/128 rows of those scales (the global grid [tp*N_local/128, K/128]). Else (a
      block cut by the split, or rows of differently scaled blocks brought together) the share is padded
      (containers.Fp8Share: each 128-row block holds rows of one checkpoint block and carries its scale, so a
      cut block keeps its scale on both sides; zero rows between; the projection gathers its output rows).
  column split (out_proj, o_proj, down_proj): the same along K (Fp8Share gathers its input columns). The FP8
      prefill arm that quantizes its activations per 128 columns (fp8_activations 'e4m3') needs whole blocks
      (K_local % 128 == 0, no padding), else a ConfigError names the tensor (fp8_activations 'bf16' serves any).
  NVFP4: codes and group scales (16 along K) go with their rows; a column split needs K_local % 16 == 0
      (ConfigError naming the tensor); the global scale (and input_scale) is replicated.
  routed experts (StackedExperts): split by expert, every array of the stack.
A device's view (sharding.device_view) is built with containers of each leaf's local shape (`local_container`).

Reading: every placed array is made by jax.make_array_from_callback, whose callback reads the device's share from
the container's host source by its index (`sharding.place_host` / `place_stacked`, `place_parts`): from a mesh
checkpoint (`read_on_mesh`) the containers hold the reader's memory-mapped views, so each device's codes / NVFP4
group scales / routed experts are read from the file by its rows (columns, experts) only, each share once per
process (replicas along dp take the same share), and a process reads nothing of other processes' devices. The
FP8 block-scale grid (1/16384 of the codes) is read whole by each process: which layout a split takes (plain grid
or padded share) depends on its values, and every process must choose the same. A jax array given (an unsharded
model's container) is fetched to the host once and cut the same way.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from metrale_jax import sharding
from metrale_jax.config import ModelConfig, ModelLevers
from metrale_jax.errors import CheckpointError, ConfigError
from metrale_jax.weights.containers import (DenseWeight, Fp8Share, Fp8Weight, Nvfp4Weight, StackedExperts,
                                            W4a4Weight, WeightQuantFormat, check_expert_members, fp8_to_block_scaled)
from metrale_jax.weights.quant_formats import FP8_BLOCK, NVFP4_GROUP, block_grid


# ---- shares of one axis ------------------------------------------------------------------------
def row_shards(n: int, rows: np.ndarray | None, tp: int) -> list[np.ndarray]:
    """Device d's checkpoint rows (indices along the split axis of length n), in its order."""
    idx = np.arange(n) if rows is None else np.asarray(rows)
    return list(idx.reshape(tp, -1))


def fp8_grid(scale: np.ndarray, share: np.ndarray, block: int = FP8_BLOCK) -> np.ndarray | None:
    """The scale grid rows of a share (checkpoint rows `share`, in order) cut in 128-row blocks: block j takes the
    scale row of the checkpoint blocks its rows come from when those agree, else None (no exact plain grid)."""
    out = []
    for j in range(0, len(share), block):
        blocks = np.unique(share[j:j + block] // block)
        if any(not np.array_equal(scale[b], scale[blocks[0]]) for b in blocks[1:]):
            return None
        out.append(scale[blocks[0]])
    return np.stack(out)


def padded_layout(share: np.ndarray, block: int = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(pos [n]: the padded row of each share row, blocks [nb]: the checkpoint block of each padded block): a new
    padded block starts where the checkpoint block changes or the current one is full."""
    pos, blocks, cur = [], [], 0
    for r in share:
        b = int(r) // block
        if cur % block == 0 or blocks[-1] != b:
            cur = -(-cur // block) * block
            blocks.append(b)
        pos.append(cur)
        cur += 1
    return np.asarray(pos, np.int32), np.asarray(blocks, np.int64)


# ---- reading shares ----------------------------------------------------------------------------
def place_parts(shape: tuple[int, ...], spec: P, tp: sharding.TensorParallel, part_of) -> jax.Array:
    """An array of `shape` split once along `spec`'s tp axis, device d's block built by part_of(d) (read once per
    process)."""
    axis = _split_axis(spec, tp.axis)
    n_local = shape[axis] // tp.size
    return jax.make_array_from_callback(shape, tp.sharding(spec), sharding._read_once(
        lambda index: part_of((index[axis].start or 0) // n_local)))


# ---- FP8 ---------------------------------------------------------------------------------------
def _split_axis(spec: P, axis: str) -> int | None:
    return next((i for i, p in enumerate(spec) if p == axis), None)


def place_fp8(name: str, w: Fp8Weight, config: ModelConfig, tp: sharding.TensorParallel,
              levers: ModelLevers) -> Fp8Weight | Fp8Share:
    """A block-scaled (or per-tensor) FP8 linear weight [N, K] on its shards (see the module docstring): each device's
    codes read from `w.weight` by its rows (columns) only; the scale grid read whole (which layout the split takes
    depends on its values)."""
    if w.format is WeightQuantFormat.FP8_PER_ROW:
        raise ConfigError("mesh", f"{name}: FP8 weights with a per-row scale are not split over a mesh (block-scaled "
                                  "and per-tensor FP8 are)")
    w = fp8_to_block_scaled(w)
    layout = sharding.tensor_layout(name, config, tp)
    split = _split_axis(layout.spec, tp.axis)
    inp = None if w.input_scale is None else sharding.place_host(w.input_scale, P(), tp)
    q, s = sharding.host_source(w.weight), np.asarray(w.scale, np.float32)
    if split is None:
        return Fp8Weight(sharding.place_host(q, P(), tp), sharding.place_host(s, P(), tp), inp, w.format)
    if split == 1:                                   # work on [K, N]: columns become rows
        s = s.T
    n, k = q.shape[split], q.shape[1 - split]
    shares = row_shards(n, layout.rows if split == 0 else None, tp.size)
    grids = [fp8_grid(s, sh) for sh in shares]
    spec = P(tp.axis, None) if split == 0 else P(None, tp.axis)
    flip = lambda a: a.T if split else a
    aligned = len(shares[0]) % FP8_BLOCK == 0       # else the global grid would not be the [N, K] grid of its shape
    if aligned and all(g is not None for g in grids):
        codes = sharding.place_host(q, spec, tp, layout.rows if split == 0 else None)
        return Fp8Weight(codes, sharding.place_host(flip(np.concatenate(grids)), spec, tp), inp, w.format)
    if split == 1 and levers.fp8_activations == "e4m3":
        raise _e4m3_refusal(name, len(shares[0]))
    layouts = [padded_layout(sh) for sh in shares]
    n_pad = max(-(-(int(pos[-1]) + 1) // FP8_BLOCK) * FP8_BLOCK for pos, _ in layouts)
    grid = np.ones((tp.size * n_pad // FP8_BLOCK, s.shape[1]), np.float32)
    index = []
    for d, (sh, (pos, blocks)) in enumerate(zip(shares, layouts)):
        grid[d * n_pad // FP8_BLOCK + np.arange(len(blocks))] = s[blocks]
        if split == 0:
            index.append(pos)
        else:                                        # padded column -> share column (len(sh): a zero column)
            src = np.full(n_pad, len(sh), np.int32)
            src[pos] = np.arange(len(sh))
            index.append(src)

    def padded(d: int) -> np.ndarray:                # device d's codes [n_pad, k] (split 1: transposed)
        out = np.zeros((n_pad, k), q.dtype)
        out[layouts[d][0]] = flip(sharding.take_rows(q, shares[d], split))
        return flip(out)

    codes = place_parts((tp.size * n_pad, k) if split == 0 else (k, tp.size * n_pad), spec, tp, padded)
    inner = Fp8Weight(codes, sharding.place_host(flip(grid), spec, tp), inp, WeightQuantFormat.FP8_BLOCK_SCALED)
    idx = sharding.place_host(np.concatenate(index).astype(np.int32), P(tp.axis), tp)
    if split == 0 and all(np.array_equal(pos, np.arange(len(pos))) for pos, _ in layouts):
        idx = None                                   # padding after the share's rows only: its output is a slice
    logical = (tp.size * len(shares[0]), k)          # the global model's shape: every device's share
    logical = logical if split == 0 else logical[::-1]
    return Fp8Share(inner, idx if split == 0 else None, idx if split == 1 else None, logical)


def _e4m3_refusal(name: str, k_local: int) -> ConfigError:
    return ConfigError("fp8_activations", f"{name}: its column split gives each device {k_local} input columns, "
                                          f"which cut the {FP8_BLOCK}-column blocks that FP8 prefill with E4M3 "
                                          "activations quantizes per device; use fp8_activations='bf16' on this mesh "
                                          "(weight-only FP8 prefill) or a tp whose split lands on a 128-column "
                                          "boundary")


# ---- NVFP4 -------------------------------------------------------------------------------------
def place_nvfp4(name: str, w: Nvfp4Weight, config: ModelConfig, tp: sharding.TensorParallel) -> Nvfp4Weight:
    """An NVFP4 linear weight on its shards: packed codes and group scales with their rows (columns), each device's
    read by its rows (columns) only."""
    layout = sharding.tensor_layout(name, config, tp)
    split = _split_axis(layout.spec, tp.axis)
    rep = lambda a: None if a is None else sharding.place_host(a, P(), tp)
    if split == 1:
        k_local = w.shape[1] // tp.size
        if w.shape[1] % tp.size or k_local % NVFP4_GROUP:
            raise ConfigError("mesh", f"{name}: K = {w.shape[1]} split over {tp.size} devices is not a multiple of "
                                      f"{NVFP4_GROUP} per device, so NVFP4 group scales cannot follow their elements")
    spec = P() if split is None else P(tp.axis, None) if split == 0 else P(None, tp.axis)
    rows = layout.rows if split == 0 else None
    return Nvfp4Weight(sharding.place_host(w.packed, spec, tp, rows), sharding.place_host(w.scale, spec, tp, rows),
                       rep(w.global_scale), rep(w.input_scale))


# ---- the model's tensors --------------------------------------------------------------------------
def _w4a4_refusal(name: str) -> ConfigError:
    return ConfigError("nvfp4_activations", f"{name}: the W4A4 arm (nvfp4_activations='nvfp4') quantizes activations "
                                            "with a scale of the whole row, which a split model does not have on "
                                            "one device; it is not supported on a mesh")


def place_container(name: str, w, config: ModelConfig, tp: sharding.TensorParallel, levers: ModelLevers):
    """A quantized container (HF name of its weight, or a layer's stacked experts) on its shards."""
    if isinstance(w, W4a4Weight):
        raise _w4a4_refusal(name)
    if isinstance(w, StackedExperts):
        return StackedExperts(jax.tree.map(lambda a: sharding.place_host(a, P(tp.axis), tp), w.member))
    if isinstance(w, ExpertMembers):
        return place_members(w, tp)
    if isinstance(w, Fp8Weight):
        return place_fp8(name, w, config, tp, levers)
    if isinstance(w, Nvfp4Weight):
        return place_nvfp4(name, w, config, tp)
    raise ConfigError("mesh", f"{name}: a {type(w).__name__} cannot be split over a mesh")


class ExpertMembers(tuple):
    """A layer's routed experts as per-expert containers (unread host sources), stacked [E, ...] as they are placed."""


def place_members(members: ExpertMembers, tp: sharding.TensorParallel) -> StackedExperts:
    """Routed experts (checked as stack_experts checks them) stacked and split by expert: every array of the stack
    [E, ...] read by each device for its own experts only."""
    flat = [jax.tree.flatten(m) for m in members]
    out = [sharding.place_stacked([sharding.host_source(leaves[j]) for leaves, _ in flat], P(tp.axis), tp)
           for j in range(len(flat[0][0]))]
    return StackedExperts(jax.tree.unflatten(flat[0][1], out))


def check_levers(config: ModelConfig, tensors: Mapping[str, object], levers: ModelLevers, tp: int) -> None:
    """Levers a quantized model cannot use on a mesh (ConfigError): the native FP8 SSM modes that build per-device
    copies ('decode': an E4M3 prefill copy; 'off': requantized to NVFP4), and E4M3 activations quantized by the
    gated norm ('group' / 'arm') where a norm group is split over devices (no device sees the group's scale)."""
    nvfp4 = next((n for n, v in tensors.items() if isinstance(v, Nvfp4Weight)), None)
    if nvfp4 is not None and levers.nvfp4_activations == "nvfp4":
        raise _w4a4_refusal(nvfp4)
    fp8_mamba = [n for n, v in tensors.items() if isinstance(v, Fp8Weight) and n.endswith(("in_proj.weight",
                                                                                           "out_proj.weight"))]
    if fp8_mamba and levers.native_fp8_ssm != "full":
        raise ConfigError("native_fp8_ssm", f"{levers.native_fp8_ssm!r} builds another copy of the Mamba FP8 "
                                            f"weights ({fp8_mamba[0]}, ...), which is not supported on a mesh; use "
                                            "'full' (native FP8 for decode and prefill)")
    if fp8_mamba and levers.fp8_activations == "e4m3" and levers.gated_norm_quant != "off" and \
            sharding.norm_spans_devices(config, tp):
        raise ConfigError("gated_norm_quant", f"{levers.gated_norm_quant!r} quantizes the Mamba gated norm's output "
                                              f"per norm group, but over {tp} devices a group of "
                                              f"{config.gated_norm_group_size} channels is split between devices; "
                                              "use gated_norm_quant='off' (out_proj's arm quantizes per 128 columns) "
                                              "or fp8_activations='bf16'")


def shard_quantized(config: ModelConfig, tensors: Mapping[str, object], tp: sharding.TensorParallel, dtype,
                    levers: ModelLevers) -> tuple[sharding.ShardedTensors, tuple]:
    """Place a model's tensors, some of them quantized containers, on the mesh: (placed tensors, the formats the
    device view is built with: (name, container structure, each leaf's (local shape, dtype)) per container)."""
    from metrale_jax.weights.checkpoint import is_quantized

    check_levers(config, tensors, levers, tp.size)
    dense = {n: v for n, v in tensors.items() if not is_quantized(v)}
    quantized = _stack_experts(config, {n: v for n, v in tensors.items() if n not in dense})
    out = sharding.shard_tensors(config, dense, tp, dtype)
    for name, w in quantized.items():
        out[name] = place_container(name, w, config, tp, levers)
    return out, container_formats(out)


def container_formats(placed: Mapping[str, object]) -> tuple:
    """The formats a sharded model's device view is built with: (name, container structure, each leaf's (local
    shape, dtype)) per placed quantized container."""
    from metrale_jax.weights.checkpoint import is_quantized

    formats = []
    for name, w in placed.items():
        if is_quantized(w):
            leaves, treedef = jax.tree.flatten(w)
            formats.append((name, treedef, tuple((tuple(a.sharding.shard_shape(a.shape)), jnp.dtype(a.dtype).name)
                                                 for a in leaves)))
    return tuple(formats)


def read_on_mesh(reader, config: ModelConfig, expected, qcfg, dtype, tp: sharding.TensorParallel,
                 levers: ModelLevers, problems: list[str], dequantized) -> sharding.ShardedTensors:
    """A quantized checkpoint's tensors (`expected`: (name, TensorSpec) pairs) placed on the mesh, each device's
    share read from the memory-mapped files by its rows (columns, experts) only, once per process: dense tensors by
    sharding.place, quantized containers by place_container (the FP8 block scale grids, 1/16384 of the codes, are
    read whole). A layer's routed experts that mix formats are stacked dense and read whole (as on one device,
    counted in `dequantized`). Problems (a module's format, dtype, shape) are appended to `problems`; with any,
    nothing is placed (an empty result)."""
    from metrale_jax.weights.checkpoint import linear_module, stack_layer_experts
    from metrale_jax.weights.quant_config import load_linear

    host: dict[str, object] = {}
    members: dict[str, dict[str, object]] = {}          # a layer's experts by HF name, until all E are read
    for name, spec in expected:
        module = linear_module(name)
        if module is None:
            host[name] = reader.get(name)               # a memory-mapped view: read by its shares
            continue
        try:
            w = load_linear(reader, module, spec.shape, qcfg, fp8_to_block=True, host=True)
        except CheckpointError as e:
            problems.extend(e.problems)
            continue
        expert = sharding.one_expert(name)
        if expert is None and isinstance(w, Fp8Weight) and w.format is not WeightQuantFormat.FP8_BLOCK_SCALED:
            problems.append(f"{module}.weight_scale: a per-row FP8 scale [N]; the FP8 arms take one scale per "
                            f"tensor or per 128x128 block")
            continue
        w = w.weight if isinstance(w, DenseWeight) else w
        if expert is None:
            host[name] = w
            continue
        group = members.setdefault(expert[0], {})
        group[name] = w
        if len(group) == config.n_routed_experts:
            host |= _expert_group(expert[0], members.pop(expert[0]), dtype, dequantized, stack_layer_experts)
    if problems:
        return sharding.ShardedTensors()
    placed, _ = shard_quantized(config, host, tp, dtype, levers)
    return placed


def _expert_group(key: str, group: dict[str, object], dtype, dequantized, stack_dense) -> dict[str, object]:
    """One layer's routed experts as read: kept one by one (placed by expert) when all are dense or all one stackable
    quantized format; else stacked dense under `key`, read whole (quantized ones dequantized)."""
    from metrale_jax.weights.checkpoint import is_quantized

    kinds = {(type(v), getattr(v, "format", None)) for v in group.values()}
    if len(kinds) == 1 and next(iter(kinds)) in ((Nvfp4Weight, WeightQuantFormat.NVFP4),
                                                  (Fp8Weight, WeightQuantFormat.FP8_BLOCK_SCALED)):
        return group
    if not any(is_quantized(v) for v in group.values()):
        return group
    order = sorted(group, key=lambda n: sharding.one_expert(n)[1])
    return {key: stack_dense(key, [group[n] for n in order], dtype, dequantized)}


def _stack_experts(config: ModelConfig, quantized: dict[str, object]) -> dict[str, object]:
    """Routed experts given one by one as containers stacked per layer (a StackedExperts under
    "<mixer>.experts.up_proj" / ".down_proj", split by expert), as the loader stacks them."""
    groups: dict[str, dict[int, object]] = {}
    out = {}
    for name, w in quantized.items():
        m = sharding.one_expert(name)
        if m is None:
            out[name] = w
        else:
            groups.setdefault(m[0], {})[m[1]] = w
    for key, members in groups.items():
        if len(members) != config.n_routed_experts:
            raise CheckpointError(f"{key}: {len(members)} of {config.n_routed_experts} routed experts given")
        out[key] = ExpertMembers(check_expert_members(key, [members[e] for e in range(config.n_routed_experts)]))
    return out


def local_container(treedef, leaves, tp: int):
    """A zero container of one device's shapes (the device view's stand-in for a placed container)."""
    w = jax.tree.unflatten(treedef, [jnp.zeros(shape, dtype) for shape, dtype in leaves])
    if isinstance(w, Fp8Share):                      # the global model's share counts every device's rows
        n, k = w.logical
        w = Fp8Share(w.weight, w.rows, w.cols, (n // tp, k) if w.cols is None else (n, k // tp))
    return w


# ---- back to the checkpoint --------------------------------------------------------------------
def unshard(name: str, w, config: ModelConfig, tp: sharding.TensorParallel):
    """A placed tensor or container back in the checkpoint's layout (host numpy; containers stay containers), so
    that save_pretrained writes what the unsharded model writes."""
    if isinstance(w, StackedExperts) or sharding.is_routed_expert(name):     # split by expert: whole experts
        return jax.tree.map(np.asarray, w)
    layout = sharding.tensor_layout(name, config, tp)
    if isinstance(w, Fp8Share):
        return _unshard_fp8_share(w, name, config, tp)
    if isinstance(w, Fp8Weight):
        return _unshard_fp8(w, layout, tp)
    if isinstance(w, Nvfp4Weight):
        rows = layout.rows if _split_axis(layout.spec, tp.axis) == 0 else None
        return Nvfp4Weight(sharding.to_checkpoint_rows(w.packed, rows), sharding.to_checkpoint_rows(w.scale, rows),
                           np.asarray(w.global_scale), _host(w.input_scale))
    return sharding.to_checkpoint_rows(w, layout.rows)


def _unshard_fp8(w: Fp8Weight, layout: sharding.Layout, tp: sharding.TensorParallel) -> Fp8Weight:
    """A plainly split FP8 weight: codes back to checkpoint rows (columns), each checkpoint block's scale read from
    the first device block holding one of its rows."""
    split = _split_axis(layout.spec, tp.axis)
    q, s = np.asarray(w.weight), np.asarray(w.scale)
    if split is None:
        return Fp8Weight(q, s, _host(w.input_scale), w.format)
    if split == 1:
        q, s = q.T, s.T
    n_local = q.shape[0] // tp.size
    shares = row_shards(q.shape[0], layout.rows if split == 0 else None, tp.size)
    n = int(np.concatenate(shares).max()) + 1
    local_blocks = -(-n_local // FP8_BLOCK)
    src_block = {}
    for d, sh in enumerate(shares):
        for i, r in enumerate(sh):
            src_block.setdefault(int(r) // FP8_BLOCK, d * local_blocks + i // FP8_BLOCK)
    grid = np.stack([s[src_block[b]] for b in range(block_grid(n, 1)[0])])
    codes = sharding.to_checkpoint_rows(q, np.concatenate(shares))
    return _fp8_out(codes, grid, split, w)


def _unshard_fp8_share(w: Fp8Share, name: str, config: ModelConfig, tp: sharding.TensorParallel) -> Fp8Weight:
    """A padded FP8 share back to the checkpoint: each checkpoint row (column) from the first device holding it,
    each checkpoint block's scale from the padded block holding one of its rows."""
    split = 0 if w.cols is None else 1
    layout = sharding.tensor_layout(name, config, tp)
    q, s = np.asarray(w.weight.weight), np.asarray(w.weight.scale)
    if split == 1:
        q, s = q.T, s.T
    n_pad, n_local = q.shape[0] // tp.size, w.logical[split] // tp.size
    index = np.tile(np.arange(n_local), tp.size) if split == 0 and w.rows is None else \
        np.asarray(w.rows if split == 0 else w.cols)
    index = index.reshape(tp.size, -1)
    codes, src_block = {}, {}
    for d, sh in enumerate(row_shards(tp.size * n_local, layout.rows if split == 0 else None, tp.size)):
        if split == 0:
            pos = index[d]
        else:                                        # padded column j takes share column index[d, j]
            pos = np.empty(n_local, np.int64)
            live = index[d] < n_local
            pos[index[d][live]] = np.nonzero(live)[0]
        for r, p in zip(sh, pos):
            codes.setdefault(int(r), q[d * n_pad + p])
            src_block.setdefault(int(r) // FP8_BLOCK, (d * n_pad + int(p)) // FP8_BLOCK)
    n = max(codes) + 1
    grid = np.stack([s[src_block[b]] for b in range(block_grid(n, 1)[0])])
    return _fp8_out(np.stack([codes[r] for r in range(n)]), grid, split, w.weight)


def _fp8_out(codes: np.ndarray, grid: np.ndarray, split: int, w: Fp8Weight) -> Fp8Weight:
    if split == 1:
        codes, grid = codes.T, grid.T
    return Fp8Weight(codes, grid, _host(w.input_scale), WeightQuantFormat.FP8_BLOCK_SCALED)


def _host(a):
    return None if a is None else np.asarray(a)
