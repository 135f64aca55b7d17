"""KvPool: the attention layers' keys and values, slot-indexed, as one pytree.

k, v [L, S, max_len, KVH, hd] in the model dtype; L counts attention layers only, S slots (the last
is the padding slot when made by `for_config`), max_len positions per slot. The slot operations (zero,
snapshot, restore, copy) are state/slot_pool.py's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from metrale_jax.state.slot_pool import SlotPool, pool_size


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KvSlotState:
    """One slot's keys and values across all attention layers: k, v [L, max_len, KVH, hd]."""

    k: jax.Array
    v: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KvPool(SlotPool):
    k: jax.Array   # [L, S, max_len, KVH, hd]
    v: jax.Array   # [L, S, max_len, KVH, hd]
    snapshot_type = KvSlotState

    @classmethod
    def create(cls, num_layers: int, num_slots: int, max_len: int, *, num_kv_heads: int, head_dim: int,
               dtype=jnp.bfloat16) -> KvPool:
        shape = (pool_size("num_layers", num_layers, 0), pool_size("num_slots", num_slots),
                 pool_size("max_len", max_len), pool_size("num_kv_heads", num_kv_heads), pool_size("head_dim", head_dim))
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @classmethod
    def for_config(cls, config, max_slots: int, max_len: int, dtype=jnp.bfloat16) -> KvPool:
        """A pool for every attention layer of `config`: max_slots live slots plus one padding slot."""
        return cls.create(len(config.attention_layer_ids), pool_size("max_slots", max_slots) + 1, max_len,
                          num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, dtype=dtype)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]
