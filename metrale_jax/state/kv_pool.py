"""KvPool: the attention layers' keys and values, slot-indexed, as one pytree.

k, v [L, S, max_len, KVH, hd] in the model dtype; L counts attention layers only, S slots (the last
is the padding slot when made by `for_config`), max_len positions per slot. Like SsmPool, every
function takes the pool and returns a new one; the jitted helpers donate it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from metrale_jax.errors import SlotError


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KvSlotState:
    """One slot's keys and values across all attention layers: k, v [L, max_len, KVH, hd]."""

    k: jax.Array
    v: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KvPool:
    k: jax.Array   # [L, S, max_len, KVH, hd]
    v: jax.Array   # [L, S, max_len, KVH, hd]

    @classmethod
    def create(cls, num_layers: int, num_slots: int, max_len: int, *, num_kv_heads: int, head_dim: int,
               dtype=jnp.bfloat16) -> KvPool:
        if max_len < 1:
            raise SlotError(f"max_len must be >= 1, got {max_len}")
        shape = (num_layers, num_slots, max_len, num_kv_heads, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    @classmethod
    def for_config(cls, config, max_slots: int, max_len: int, dtype=jnp.bfloat16) -> KvPool:
        """A pool for every attention layer of `config`: max_slots live slots plus one padding slot."""
        return cls.create(len(config.attention_layer_ids), max_slots + 1, max_len,
                          num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim, dtype=dtype)

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def padding_slot(self) -> int:
        return self.num_slots - 1

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def check_slot(self, slot: int) -> int:
        if not 0 <= int(slot) < self.num_slots:
            raise SlotError(f"slot {slot} out of range [0, {self.num_slots})")
        return int(slot)

    # pure updates (eager callers get them jitted with the pool donated)
    def zero_slot(self, slot) -> KvPool:
        return _zero_slot(self, jnp.int32(self.check_slot(slot)))

    def snapshot(self, slot) -> KvSlotState:
        """A copy of one slot's keys and values in every layer."""
        return _snapshot(self, jnp.int32(self.check_slot(slot)))

    def restore(self, slot, snap: KvSlotState) -> KvPool:
        want = (self.num_layers, *self.k.shape[2:])
        if tuple(snap.k.shape) != want or tuple(snap.v.shape) != want:
            raise SlotError(f"snapshot shapes {snap.k.shape}, {snap.v.shape} do not fit this pool ({want})")
        return _restore(self, jnp.int32(self.check_slot(slot)), snap)

    def copy_slot(self, src, dst) -> KvPool:
        return _copy_slot(self, jnp.int32(self.check_slot(src)), jnp.int32(self.check_slot(dst)))


@functools.partial(jax.jit, donate_argnums=0)
def _zero_slot(pool: KvPool, slot) -> KvPool:
    return KvPool(pool.k.at[:, slot].set(0), pool.v.at[:, slot].set(0))


@jax.jit
def _snapshot(pool: KvPool, slot) -> KvSlotState:
    return KvSlotState(pool.k[:, slot], pool.v[:, slot])


@functools.partial(jax.jit, donate_argnums=0)
def _restore(pool: KvPool, slot, snap: KvSlotState) -> KvPool:
    return KvPool(pool.k.at[:, slot].set(snap.k.astype(pool.k.dtype)),
                  pool.v.at[:, slot].set(snap.v.astype(pool.v.dtype)))


@functools.partial(jax.jit, donate_argnums=0)
def _copy_slot(pool: KvPool, src, dst) -> KvPool:
    return KvPool(pool.k.at[:, dst].set(pool.k[:, src]), pool.v.at[:, dst].set(pool.v[:, src]))
