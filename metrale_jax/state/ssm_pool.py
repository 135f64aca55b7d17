"""SsmPool: the Mamba-2 layers' conv and SSM states, slot-indexed, as one pytree.

conv_state [L, S, conv_dim, K-1] (model dtype), ssm_state [L, S, H, P, N] (f32 by default); L counts
Mamba layers only, S slots (the last is the padding slot when made by `for_config`). Every function
takes the pool and returns a new one; the jitted helpers donate it so XLA updates in place.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from metrale_jax.errors import SlotError


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotState:
    """One slot's state across all Mamba layers: conv [L, C, K-1], ssm [L, H, P, N]."""

    conv: jax.Array
    ssm: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SsmPool:
    conv_state: jax.Array   # [L, S, C, K-1]
    ssm_state: jax.Array    # [L, S, H, P, N]

    @classmethod
    def create(cls, num_layers: int, num_slots: int, *, conv_dim: int, conv_kernel: int, num_heads: int,
               head_dim: int, state_size: int, conv_dtype=jnp.bfloat16, ssm_dtype=jnp.float32) -> SsmPool:
        return cls(
            conv_state=jnp.zeros((num_layers, num_slots, conv_dim, conv_kernel - 1), conv_dtype),
            ssm_state=jnp.zeros((num_layers, num_slots, num_heads, head_dim, state_size), ssm_dtype),
        )

    @classmethod
    def for_config(cls, config, max_slots: int, dtype=jnp.bfloat16) -> SsmPool:
        """A pool for every Mamba layer of `config`: max_slots live slots plus one padding slot."""
        return cls.create(
            len(config.mamba_layer_ids), max_slots + 1, conv_dim=config.conv_dim,
            conv_kernel=config.conv_kernel, num_heads=config.mamba_num_heads, head_dim=config.mamba_head_dim,
            state_size=config.ssm_state_size, conv_dtype=dtype, ssm_dtype=jnp.dtype(config.mamba_ssm_cache_dtype))

    @property
    def num_layers(self) -> int:
        return self.ssm_state.shape[0]

    @property
    def num_slots(self) -> int:
        return self.ssm_state.shape[1]

    @property
    def padding_slot(self) -> int:
        return self.num_slots - 1

    @property
    def nbytes(self) -> int:
        return self.conv_state.nbytes + self.ssm_state.nbytes

    def check_slot(self, slot: int) -> int:
        if not 0 <= int(slot) < self.num_slots:
            raise SlotError(f"slot {slot} out of range [0, {self.num_slots})")
        return int(slot)

    # pure updates (eager callers get them jitted with the pool donated)
    def zero_slot(self, slot) -> SsmPool:
        return _zero_slot(self, jnp.int32(self.check_slot(slot)))

    def snapshot(self, slot) -> SlotState:
        """A copy of one slot's state in every layer."""
        return _snapshot(self, jnp.int32(self.check_slot(slot)))

    def restore(self, slot, snap: SlotState) -> SsmPool:
        want = (self.num_layers, *self.conv_state.shape[2:]), (self.num_layers, *self.ssm_state.shape[2:])
        if (tuple(snap.conv.shape), tuple(snap.ssm.shape)) != want:
            raise SlotError(f"snapshot shapes {snap.conv.shape}, {snap.ssm.shape} do not fit this pool ({want})")
        return _restore(self, jnp.int32(self.check_slot(slot)), snap)

    def copy_slot(self, src, dst) -> SsmPool:
        return _copy_slot(self, jnp.int32(self.check_slot(src)), jnp.int32(self.check_slot(dst)))


@functools.partial(jax.jit, donate_argnums=0)
def _zero_slot(pool: SsmPool, slot) -> SsmPool:
    return SsmPool(pool.conv_state.at[:, slot].set(0), pool.ssm_state.at[:, slot].set(0))


@jax.jit
def _snapshot(pool: SsmPool, slot) -> SlotState:
    return SlotState(pool.conv_state[:, slot], pool.ssm_state[:, slot])


@functools.partial(jax.jit, donate_argnums=0)
def _restore(pool: SsmPool, slot, snap: SlotState) -> SsmPool:
    return SsmPool(pool.conv_state.at[:, slot].set(snap.conv.astype(pool.conv_state.dtype)),
                   pool.ssm_state.at[:, slot].set(snap.ssm.astype(pool.ssm_state.dtype)))


@functools.partial(jax.jit, donate_argnums=0)
def _copy_slot(pool: SsmPool, src, dst) -> SsmPool:
    return SsmPool(pool.conv_state.at[:, dst].set(pool.conv_state[:, src]),
                   pool.ssm_state.at[:, dst].set(pool.ssm_state[:, src]))
