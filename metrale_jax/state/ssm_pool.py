"""SsmPool: the Mamba-2 layers' conv and SSM states, slot-indexed, as one pytree.

conv_state [L, S, conv_dim, K-1] (model dtype), ssm_state [L, S, H, P, N] (f32 by default); L counts
Mamba layers only, S slots (the last is the padding slot when made by `for_config`). The slot operations
(zero, snapshot, restore, copy) are state/slot_pool.py's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from metrale_jax.state.slot_pool import SlotPool, pool_size


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotState:
    """Mamba-2 state: the conv window conv [..., C, K-1] and the SSM state ssm [..., H, P, N]. The leading axes
    say whose: [L] one slot in every Mamba layer (a snapshot of the pool), none one slot in one layer (a layer's
    replay-tail capture), [B] one per request (a batch's captures), [n, k] after every verified token."""

    conv: jax.Array
    ssm: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SsmPool(SlotPool):
    conv_state: jax.Array   # [L, S, C, K-1]
    ssm_state: jax.Array    # [L, S, H, P, N]
    snapshot_type = SlotState

    @classmethod
    def create(cls, num_layers: int, num_slots: int, *, conv_dim: int, conv_kernel: int, num_heads: int,
               head_dim: int, state_size: int, conv_dtype=jnp.bfloat16, ssm_dtype=jnp.float32) -> SsmPool:
        num_layers, num_slots = pool_size("num_layers", num_layers, 0), pool_size("num_slots", num_slots)
        conv_dim, conv_kernel = pool_size("conv_dim", conv_dim), pool_size("conv_kernel", conv_kernel)
        num_heads, head_dim = pool_size("num_heads", num_heads), pool_size("head_dim", head_dim)
        state_size = pool_size("state_size", state_size)
        return cls(
            conv_state=jnp.zeros((num_layers, num_slots, conv_dim, conv_kernel - 1), conv_dtype),
            ssm_state=jnp.zeros((num_layers, num_slots, num_heads, head_dim, state_size), ssm_dtype),
        )

    @classmethod
    def for_config(cls, config, max_slots: int, dtype=jnp.bfloat16) -> SsmPool:
        """A pool for every Mamba layer of `config`: max_slots live slots plus one padding slot."""
        return cls.create(
            len(config.mamba_layer_ids), pool_size("max_slots", max_slots) + 1, conv_dim=config.conv_dim,
            conv_kernel=config.conv_kernel, num_heads=config.mamba_num_heads, head_dim=config.mamba_head_dim,
            state_size=config.ssm_state_size, conv_dtype=dtype, ssm_dtype=jnp.dtype(config.mamba_ssm_cache_dtype))
