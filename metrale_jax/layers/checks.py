"""Boundary checks for entry points: chex assertions re-raised as ShapeError naming the argument."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from metrale_jax.config import BLOCK_KINDS
from metrale_jax.errors import ConfigError, ShapeError


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


def check_slots(name: str, slots, n: int) -> jax.Array:
    """Slot indices as int32 [n]."""
    slots = jnp.asarray(slots)
    check_array(name, slots, (n,), integer=True)
    return slots.astype(jnp.int32)


def check_layer_index(config, layer_idx: int, kind: str) -> None:
    """layer_idx names a block of pattern character `kind` in config.hybrid_override_pattern (ConfigError)."""
    pattern = config.hybrid_override_pattern
    if not 0 <= layer_idx < len(pattern):
        raise ConfigError("layer_idx", f"{layer_idx} out of range for the pattern {pattern!r}")
    if pattern[layer_idx] != kind:
        raise ConfigError("layer_idx", f"layer {layer_idx} is {BLOCK_KINDS[pattern[layer_idx]]!r}, not "
                                       f"{BLOCK_KINDS[kind]!r} (pattern {pattern!r})")
