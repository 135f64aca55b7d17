"""ModelCache: everything a NemotronH keeps per sequence, as one pytree of slot-indexed arrays.

ssm (SsmPool over the Mamba layers), kv (KvPool over the attention layers) and seq_lens [S] int32,
the number of tokens each slot holds. S = max_slots + 1: the last slot is the padding slot, which
absorbs padded batch rows. `SlotAllocator(cache.num_slots).alloc(cache)` hands out a zeroed slot.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.errors import SlotError
from metrale_jax.state import slot_pool
from metrale_jax.state.kv_pool import KvPool, KvSlotState
from metrale_jax.state.slots import SlotAllocator
from metrale_jax.state.ssm_pool import SlotState, SsmPool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheSlotState:
    """One slot's whole state: Mamba states, keys/values and its length."""

    ssm: SlotState
    kv: KvSlotState
    seq_len: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelCache:
    ssm: SsmPool
    kv: KvPool
    seq_lens: jax.Array   # [S] int32

    @classmethod
    def for_config(cls, config, max_slots: int, max_len: int, dtype=jnp.bfloat16) -> ModelCache:
        """max_slots live slots (plus the padding slot), each up to max_len tokens of keys and values."""
        max_slots = slot_pool.pool_size("max_slots", max_slots)
        return cls(ssm=SsmPool.for_config(config, max_slots, dtype),
                   kv=KvPool.for_config(config, max_slots, max_len, dtype),
                   seq_lens=jnp.zeros((max_slots + 1,), jnp.int32))

    @property
    def num_slots(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def max_slots(self) -> int:
        return self.num_slots - 1

    @property
    def padding_slot(self) -> int:
        return self.num_slots - 1

    @property
    def max_len(self) -> int:
        return self.kv.max_len

    @property
    def nbytes(self) -> int:
        return self.ssm.nbytes + self.kv.nbytes + self.seq_lens.nbytes

    def allocator(self) -> SlotAllocator:
        """A fresh allocator over this cache's slots (the padding slot is never handed out)."""
        return SlotAllocator(self.num_slots)

    def check_slot(self, slot, name: str = "slot") -> int:
        return slot_pool.slot_index(name, slot, self.num_slots)

    def zero_slot(self, slot) -> ModelCache:
        return _zero_jit(self, jnp.int32(self.check_slot(slot)))

    def snapshot(self, slot) -> CacheSlotState:
        return _take_jit(self, jnp.int32(self.check_slot(slot)))

    def restore(self, slot, snap: CacheSlotState) -> ModelCache:
        if not isinstance(snap, CacheSlotState):
            raise SlotError(f"snapshot: expected a CacheSlotState, got {type(snap).__name__}")
        self.ssm.check_snapshot(snap.ssm)
        self.kv.check_snapshot(snap.kv)
        _check_seq_len(snap.seq_len, self.max_len)
        return _put_jit(self, jnp.int32(self.check_slot(slot)), snap)

    def copy_slot(self, src, dst) -> ModelCache:
        return _copy_jit(self, jnp.int32(self.check_slot(src, "src")), jnp.int32(self.check_slot(dst, "dst")))


def _check_seq_len(seq_len, max_len: int) -> None:
    """A snapshot's length: an integer scalar, and where its value is known (not traced) in [0, max_len]; a longer
    one would let the next decode write past the slot's keys (the scatter drops them)."""
    dtype = seq_len.dtype if hasattr(seq_len, "dtype") else np.asarray(seq_len).dtype
    if np.shape(seq_len) != () or dtype == np.bool_ or not np.issubdtype(dtype, np.integer):
        raise SlotError(f"snapshot.seq_len: expected an integer scalar, got {seq_len!r:.60}")
    if not isinstance(seq_len, jax.core.Tracer) and not 0 <= int(seq_len) <= max_len:
        raise SlotError(f"snapshot.seq_len: {int(seq_len)} is not in [0, {max_len}] (the cache's max_len)")


# ---- the slot operations over the whole cache (pure; the methods above run them jitted, the cache donated) ----
def zero_slot(cache: ModelCache, slot) -> ModelCache:
    """A fresh slot: Mamba states, keys/values and length all zero."""
    return ModelCache(slot_pool.zero_slot(cache.ssm, slot), slot_pool.zero_slot(cache.kv, slot),
                      cache.seq_lens.at[slot].set(0))


def take_slot(cache: ModelCache, slot) -> CacheSlotState:
    return CacheSlotState(slot_pool.take_slot(cache.ssm, slot), slot_pool.take_slot(cache.kv, slot),
                          cache.seq_lens[slot])


def put_slot(cache: ModelCache, slot, snap: CacheSlotState) -> ModelCache:
    return ModelCache(slot_pool.put_slot(cache.ssm, slot, snap.ssm), slot_pool.put_slot(cache.kv, slot, snap.kv),
                      cache.seq_lens.at[slot].set(snap.seq_len))


def copy_slot(cache: ModelCache, src, dst) -> ModelCache:
    return ModelCache(slot_pool.copy_slot(cache.ssm, src, dst), slot_pool.copy_slot(cache.kv, src, dst),
                      cache.seq_lens.at[dst].set(cache.seq_lens[src]))


_zero_jit = jax.jit(zero_slot, donate_argnums=0)
_take_jit = jax.jit(take_slot)
_put_jit = jax.jit(put_slot, donate_argnums=0)
_copy_jit = jax.jit(copy_slot, donate_argnums=0)
