"""Boundary checks for entry points: chex assertions re-raised as ShapeError naming the argument."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.arguments import integer
from metrale_jax.config import BLOCK_KINDS
from metrale_jax.errors import ConfigError, ShapeError, SlotError


def check_array(name: str, value, shape: tuple[int | None, ...], *, floating: bool = False,
                integer: bool = False) -> None:
    """Rank and sizes (None = any size) at trace time; optionally a floating or integer dtype."""
    try:
        chex.assert_shape(value, shape)
    except AssertionError:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        got = list(getattr(value, "shape", ()))
        raise ShapeError(f"{name}: expected shape {want}, got {got}") from None
    if floating and not jnp.issubdtype(value.dtype, jnp.floating):
        raise ShapeError(f"{name}: expected a floating dtype, got {value.dtype}")
    if integer and not jnp.issubdtype(value.dtype, jnp.integer):
        raise ShapeError(f"{name}: expected an integer dtype, got {value.dtype}")


def host_integers(name: str, value) -> np.ndarray | None:
    """value's integers when they are known on the host at call time: a Python int or list, a numpy array or scalar,
    or a jax array that is not traced (an eager call, or a constant a jitted function closes over: read once, at
    trace time). None for a traced value, whose values are never read (no device sync in a compiled step). A bool,
    float or ragged value is a ShapeError naming `name`."""
    if isinstance(value, jax.core.Tracer) or (isinstance(value, jax.Array) and not value.is_fully_addressable):
        return None
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError):
        raise ShapeError(f"{name}: expected an integer dtype, got {value!r:.60}") from None
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ShapeError(f"{name}: expected an integer dtype, got {arr.dtype} ({value!r:.60})")
    return arr


def check_slot_values(name: str, slots, num_slots: int) -> None:
    """Host slot indices lie in [0, num_slots) and name each live slot once (the padding slot, num_slots - 1, may
    repeat: padded rows); a scatter would drop or a gather clamp an index past the pool, a negative one would wrap,
    and two rows of one slot would race for its state. SlotError naming `name`; traced values are not read."""
    ints = host_integers(name, slots)
    if ints is None:
        return
    ints = ints.reshape(-1)
    bad = ints[(ints < 0) | (ints >= num_slots)]
    if bad.size:
        raise SlotError(f"{name}: slot {int(bad[0])} out of range [0, {num_slots})")
    live, counts = np.unique(ints[ints != num_slots - 1], return_counts=True)
    if (counts > 1).any():
        raise SlotError(f"{name}: slot {int(live[counts > 1][0])} appears more than once; each row of a batch "
                        "needs a slot of its own")


def check_slots(name: str, slots, n: int, num_slots: int | None = None) -> jax.Array:
    """Slot indices as int32 [n]; with num_slots, host values are checked against the pool (check_slot_values)."""
    if num_slots is not None:
        check_slot_values(name, slots, num_slots)
    slots = jnp.asarray(slots)
    check_array(name, slots, (n,), integer=True)
    return slots.astype(jnp.int32)


def check_one_slot(name: str, slot, num_slots: int) -> jax.Array:
    """One sequence's slot (a scalar or a [1] vector) as int32 [1]; host values checked as check_slot_values."""
    if tuple(np.shape(slot)) not in ((), (1,)):
        raise ShapeError(f"{name}: expected one slot index, got shape {list(np.shape(slot))}")
    check_slot_values(name, slot, num_slots)
    if isinstance(slot, jax.Array) and not jnp.issubdtype(slot.dtype, jnp.integer):
        raise ShapeError(f"{name}: expected an integer dtype, got {slot.dtype}")
    return jnp.reshape(jnp.asarray(slot, jnp.int32), (1,))


def static_int(name: str, value, lo: int, hi: int | None = None) -> int:
    """A static integer argument (k, chunk_len, cut) in [lo, hi] (hi None: no upper bound): arguments.integer's
    check, a ShapeError here as every entry-point argument's."""
    try:
        return integer(name, value, lo, hi)
    except ConfigError as e:
        raise ShapeError(str(e)) from None


def positive_int(name: str, value) -> int:
    """A static count (k, chunk_len): a Python or numpy integer >= 1, never a bool or a float (ShapeError)."""
    return static_int(name, value, 1)


def start_positions(name: str, value, n: int) -> jax.Array:
    """Start positions as int32 [n] (a scalar is every row's): an integer dtype, and values known on the host
    (host_integers) >= 0; a traced value's dtype is checked, its values are not read."""
    known = host_integers(name, value)
    if known is not None and (known < 0).any():
        raise ShapeError(f"{name}: expected positions >= 0, got {known.tolist()!s:.80}")
    starts = jnp.asarray(value)
    if not jnp.issubdtype(starts.dtype, jnp.integer):
        raise ShapeError(f"{name}: expected an integer dtype, got {starts.dtype}")
    if starts.ndim == 0:
        starts = jnp.full((n,), starts)
    if starts.shape != (n,):
        raise ShapeError(f"{name}: expected a scalar or [{n}], got {list(starts.shape)}")
    return starts.astype(jnp.int32)


def check_layer_index(config, layer_idx: int, kind: str) -> None:
    """layer_idx names a block of pattern character `kind` in config.hybrid_override_pattern (ConfigError)."""
    pattern = config.hybrid_override_pattern
    if not 0 <= layer_idx < len(pattern):
        raise ConfigError("layer_idx", f"{layer_idx} out of range for the pattern {pattern!r}")
    if pattern[layer_idx] != kind:
        raise ConfigError("layer_idx", f"layer {layer_idx} is {BLOCK_KINDS[pattern[layer_idx]]!r}, not "
                                       f"{BLOCK_KINDS[kind]!r} (pattern {pattern!r})")
