"""What every slot-indexed pool shares: each array is [L, S, ...] (layers of one kind, slots on axis 1), and one slot
can be zeroed, copied out as a snapshot (the same arrays without the slot axis), put back, or copied to another.

The operations are pure functions of (pool, slot indices) here, for the compiled steps of the runtime; the pools'
methods (`SlotPool.zero_slot`, ...) check the slot on the host and run them jitted with the pool donated.
"""

from __future__ import annotations

import dataclasses
import operator

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.arguments import is_int
from metrale_jax.errors import SlotError


def _arrays(x) -> tuple:
    return tuple(getattr(x, f.name) for f in dataclasses.fields(x))


def slot_index(name: str, slot, num_slots: int) -> int:
    """slot as an int in [0, num_slots): a Python or numpy integer (or a 0-d integer array); a bool, a float or
    anything else is a SlotError naming `name`, never truncated or wrapped."""
    if isinstance(slot, (bool, np.bool_)) or getattr(slot, "dtype", None) == np.bool_:
        raise SlotError(f"{name}: expected an integer slot index, got {slot!r:.60}")
    try:
        index = operator.index(slot)
    except TypeError:
        raise SlotError(f"{name}: expected an integer slot index, got {slot!r:.60}") from None
    if not 0 <= index < num_slots:
        raise SlotError(f"{name}: slot {index} out of range [0, {num_slots})")
    return index


def pool_size(name: str, value, minimum: int = 1) -> int:
    """A pool dimension (layers, slots, positions, heads, ...) as an int >= minimum; a bool, float or smaller value
    is a SlotError naming it, not a TypeError from jnp.zeros or an empty pool."""
    if not is_int(value) or value < minimum:
        raise SlotError(f"{name} must be an integer >= {minimum}, got {value!r:.60}")
    return int(value)


def zero_slot(pool, slot):
    """The pool with every array's `slot` zeroed (a fresh sequence)."""
    return type(pool)(*(a.at[:, slot].set(0) for a in _arrays(pool)))


def take_slot(pool, slot):
    """A copy of one slot's arrays in every layer, as the pool's snapshot type."""
    return pool.snapshot_type(*(a[:, slot] for a in _arrays(pool)))


def put_slot(pool, slot, snap):
    """The pool with `slot` set from a snapshot (cast to the pool's dtypes)."""
    return type(pool)(*(a.at[:, slot].set(s.astype(a.dtype)) for a, s in zip(_arrays(pool), _arrays(snap))))


def copy_slot(pool, src, dst):
    """The pool with slot `dst` set to slot `src`."""
    return type(pool)(*(a.at[:, dst].set(a[:, src]) for a in _arrays(pool)))


_zero_jit = jax.jit(zero_slot, donate_argnums=0)
_take_jit = jax.jit(take_slot)
_put_jit = jax.jit(put_slot, donate_argnums=0)
_copy_jit = jax.jit(copy_slot, donate_argnums=0)


class SlotPool:
    """Shared members of the pool dataclasses (SsmPool, KvPool): each field an array [L, S, ...]; `snapshot_type`
    the dataclass of one slot's arrays, field for field."""

    snapshot_type: type

    @property
    def num_layers(self) -> int:
        return _arrays(self)[0].shape[0]

    @property
    def num_slots(self) -> int:
        return _arrays(self)[0].shape[1]

    @property
    def padding_slot(self) -> int:
        return self.num_slots - 1

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in _arrays(self))

    def check_slot(self, slot, name: str = "slot") -> int:
        return slot_index(name, slot, self.num_slots)

    def zero_slot(self, slot):
        return _zero_jit(self, jnp.int32(self.check_slot(slot)))

    def snapshot(self, slot):
        """A copy of one slot's arrays in every layer (`snapshot_type`)."""
        return _take_jit(self, jnp.int32(self.check_slot(slot)))

    def check_snapshot(self, snap) -> None:
        """A snapshot fits this pool: its type is the pool's snapshot type, its arrays the pool's without the slot
        axis."""
        if not isinstance(snap, self.snapshot_type):
            raise SlotError(f"snapshot: expected a {self.snapshot_type.__name__}, got {type(snap).__name__}")
        want = tuple((self.num_layers, *a.shape[2:]) for a in _arrays(self))
        got = tuple(tuple(s.shape) for s in _arrays(snap))
        if got != want:
            raise SlotError(f"snapshot shapes {got} do not fit this pool ({want})")

    def restore(self, slot, snap):
        self.check_snapshot(snap)
        return _put_jit(self, jnp.int32(self.check_slot(slot)), snap)

    def copy_slot(self, src, dst):
        return _copy_jit(self, jnp.int32(self.check_slot(src, "src")), jnp.int32(self.check_slot(dst, "dst")))
