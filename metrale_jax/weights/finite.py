"""The finite check of loaded weights (from_pretrained(check_finite=True)): which tensors hold a NaN or an
infinity, tested on the devices that hold them."""

from __future__ import annotations

import collections
import functools
import re
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np

# a layer's routed experts stacked by the loader into one [E, ...] array (HF's in-memory fused names)
_STACKED = re.compile(r"^(?P<mixer>(?:backbone|mtp)\.layers\.\d+\.mixer\.)experts\.(?P<proj>up|down)_proj$")


def nonfinite_tensors(tensors: Mapping[str, object]) -> list[str]:
    """A problem for each tensor holding a NaN or an infinity: every floating array of it (a quantized container's
    weights and scales too), as loaded (a value the cast to the model dtype overflowed counts); a layer's stacked
    routed experts named one by one. Tested where the tensors live, one program per device set (hundreds of
    independent multi-device programs in flight deadlock XLA:CPU's collectives), fetched to the host at once."""
    groups: dict = collections.defaultdict(dict)          # device set -> {name: [floating leaves]}
    for name, value in tensors.items():
        if leaves := [x for x in jax.tree.leaves(value) if jnp.issubdtype(x.dtype, jnp.floating)]:
            on = frozenset(leaves[0].sharding.device_set) if isinstance(leaves[0], jax.Array) else None
            groups[on][name] = leaves
    flags = {}
    for devices, group in groups.items():          # flags replicated on the group's devices: every process reads them
        everywhere = devices and NamedSharding(Mesh(np.array(sorted(devices, key=lambda d: d.id)), ("all",)), P())
        flags.update(jax.block_until_ready(jax.jit(_nonfinite_flags, static_argnums=1, out_shardings=everywhere)(
            group, frozenset(filter(_STACKED.match, group)))))
    problems = []
    for name, bad in jax.device_get(flags).items():
        m = _STACKED.match(name)
        names = [f"{m['mixer']}experts.{e}.{m['proj']}_proj.weight" for e in np.flatnonzero(bad)] if m else \
            [name] if bad else []
        problems.extend(f"{n}: holds NaN or infinite values" for n in names)
    return problems


def _nonfinite_flags(leaves: dict[str, list[jax.Array]], per_expert: frozenset[str]) -> dict[str, jax.Array]:
    """{name: any leaf holds a non-finite value}, [E] (one per expert) for the names in per_expert."""
    return {name: functools.reduce(jnp.logical_or, [jnp.any(~jnp.isfinite(x), axis=tuple(
        range(name in per_expert, x.ndim))) for x in xs]) for name, xs in leaves.items()}
