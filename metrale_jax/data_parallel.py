"""Data parallelism and multi-process runs: replicas of a (tensor-parallel) model along a mesh's dp axis, and
joining a jax.distributed run.

A model built on make_mesh(tp=..., dp=...) holds its weights once per replica (each dp row of the mesh holds the
tensor-parallel split). `replica(model, i)` is replica i as a model of its own, on its row of devices only (no
copy: the same device buffers); the serving engine runs one per replica (runtime/engine_dp.py).
Several processes (hosts) run one program through JAX's multi-controller runtime: `initialize` joins the run
(jax.distributed.initialize, the CPU collectives over gloo), after which jax.devices() lists every process's devices
and a mesh over them spans the processes. Every process then makes the same calls (load, score) in the same order:
each reads only its own devices' shares of the checkpoint, and each replica computes its share of a batch.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

from metrale_jax import sharding
from metrale_jax.errors import ConfigError

ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
_JOINED: tuple | None = None                    # (coordinator, num_processes, process_id) once joined


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> bool:
    """Join a multi-process run: coordinator 'host:port' (process 0's address), the number of processes and this
    one's id, each defaulting to the environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID).
    Returns False (nothing done) when neither gives a coordinator or the run has one process; True once joined.
    Call it before anything touches a device. The CPU backend's collectives go over gloo. A second call with the
    same arguments does nothing more."""
    global _JOINED
    coordinator = coordinator or os.environ.get(ENV[0]) or None
    num_processes = _env_int(num_processes, ENV[1])
    process_id = _env_int(process_id, ENV[2])
    if coordinator is None or num_processes in (None, 1):
        if num_processes not in (None, 1) or (coordinator is not None and num_processes is None):
            raise ConfigError("coordinator", f"a multi-process run needs the coordinator address and the number of "
                                             f"processes, got coordinator {coordinator!r}, num_processes "
                                             f"{num_processes!r}")
        return False
    if process_id is None or not 0 <= process_id < num_processes:
        raise ConfigError("process_id", f"expected an integer in [0, {num_processes}), got {process_id!r}")
    if _JOINED:                                   # jax.distributed.initialize may run once per process
        if _JOINED != (coordinator, num_processes, process_id):
            raise ConfigError("coordinator", f"this process joined the run {_JOINED} already")
        return True
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes, process_id)
    _JOINED = (coordinator, num_processes, process_id)
    return True


def _env_int(value: int | None, name: str) -> int | None:
    if value is not None:
        return int(value)
    text = os.environ.get(name)
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(name, f"expected an integer, got {text!r}") from None


def num_replicas(model) -> int:
    """The model's data-parallel size (1 without a mesh or without a dp axis; also 1 for a `.tp` that is no
    sharding.TensorParallel, which the Engine then refuses with a ConfigError naming it)."""
    tp = getattr(model, "tp", None)
    return tp.dp if isinstance(tp, sharding.TensorParallel) else 1


def replica_devices(model, index: int) -> np.ndarray:
    """The devices of replica `index` [tp], in the tensor-parallel axis's order."""
    tp = model.tp
    n = num_replicas(model)
    if not 0 <= index < n:
        raise ConfigError("index", f"expected a replica in [0, {n}), got {index}")
    devices = tp.mesh.devices
    if tp.dp_axis is None:
        return devices.reshape(-1)
    row = np.take(devices, index, axis=tp.mesh.axis_names.index(tp.dp_axis))
    return row.reshape(-1)


def local_replicas(model) -> list[int]:
    """The replicas whose devices all belong to this process (every one in a single-process run)."""
    me = jax.process_index()
    return [i for i in range(num_replicas(model))
            if all(d.process_index == me for d in replica_devices(model, i))]


def replica(model, index: int):
    """Replica `index` of a model on a (dp, tp) mesh as a model of its own: the same weights (the device buffers of
    its row of the mesh, not copied) on a tp-only mesh of those devices. Its steps run on those devices alone, so
    the replicas run side by side. ConfigError when the replica's devices are not all this process's."""
    tp = model.tp
    if tp is None:
        raise ConfigError("model", "a model without a mesh has no replicas (build it with mesh=make_mesh(tp=, dp=))")
    row = replica_devices(model, index)
    if index not in local_replicas(model):
        raise ConfigError("index", f"replica {index} lies on devices of other processes "
                                   f"({[d.id for d in row]}); only this process's replicas can be served here")
    sub = Mesh(row, (tp.axis,), axis_types=(AxisType.Auto,))
    leaves, treedef = jax.tree_util.tree_flatten(model)
    out = jax.tree_util.tree_unflatten(treedef, [_on_row(x, sub) for x in leaves])
    out.tp = sharding.TensorParallel(sub, tp.axis)
    sharding.check_placement(out)
    return out


def _on_row(x, sub: Mesh):
    """An array placed on the full mesh (replicated over dp) as the same array on the devices of `sub`."""
    if not isinstance(x, jax.Array) or not isinstance(x.sharding, NamedSharding):
        return x
    spec = x.sharding.spec
    if sharding.DP_AXIS in jax.tree.leaves(tuple(spec)):
        raise ConfigError("model", f"a weight split over {sharding.DP_AXIS!r} ({spec}); weights are replicated over it")
    by_device = {s.device: s.data for s in x.addressable_shards}
    return jax.make_array_from_single_device_arrays(x.shape, NamedSharding(sub, spec),
                                                    [by_device[d] for d in sub.devices.flat])
