"""The one loop over a stack of blocks.

Every step of the model (forward, prefill, decode, verify) and of its MTP head walks its blocks through
`run_blocks`: each block kind answers `prefill_rows` / `decode_rows` on its own pool (the Mamba-2 block on
the cache's SsmPool, attention on its KvPool, MLP and MoE on none: the class attribute `pool_field` names
it) and returns what it captured (the Mamba state at a replay-tail cut, or after every verified row), so
the loop knows no block kind by name.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from metrale_jax.layers import lora
from metrale_jax.layers.blocks import settled


@dataclasses.dataclass(frozen=True)
class PrefillRows:
    """Right-padded rows [B, T] of one prefill chunk, as every block reads them (built inside a step).

    Row b holds lengths[b] real tokens at positions starts[b] + t (starts None: new sequences at 0 that
    attend only to their own tokens) for slot slots[b]; a padding row (length 0) writes nothing. cuts [B]:
    replay-tail capture, row b split after cuts[b] of its tokens; None: no capture. The Mamba blocks see the
    real rows packed back to back: valid [B, T], cu [B+1], src [B*T] (packed row -> flat padded row) and
    dst [B, T] (padded row -> packed row) map between the two orders."""

    slots: jax.Array
    lengths: jax.Array
    starts: jax.Array | None
    padding_slot: int
    cuts: jax.Array | None = None
    valid: jax.Array = None
    cu: jax.Array = None
    src: jax.Array = None
    dst: jax.Array = None

    @classmethod
    def make(cls, slots, lengths, T: int, starts=None, *, padding_slot: int, cuts=None) -> PrefillRows:
        valid, cu, src, dst = pack_rows(lengths, T)
        return cls(slots, lengths, starts, padding_slot, cuts, valid, cu, src, dst)


@dataclasses.dataclass(frozen=True)
class DecodeRows:
    """k consecutive tokens for each of n sequences, rows sequence-major (r = i*k + j): sequence i in slot
    slots[i], its first row at positions[i]. verify: the Mamba blocks return the state after every row."""

    slots: jax.Array
    positions: jax.Array
    k: int = 1
    verify: bool = False


def pack_rows(lengths: jax.Array, T: int):
    """Index maps between right-padded rows [B, T] and the packed (varlen) order the Mamba layers take.
    Returns (valid [B, T], cu_seqlens [B+1], src [B*T]: packed row -> flat padded row,
    dst [B, T]: padded row -> packed row)."""
    B = lengths.shape[0]
    t = jnp.arange(T, dtype=jnp.int32)
    valid = t[None, :] < lengths[:, None]
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths).astype(jnp.int32)])
    p = jnp.arange(B * T, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu, p, side="right").astype(jnp.int32) - 1, 0, B - 1)
    src = jnp.where(p < cu[B], seq * T + p - cu[seq], 0)
    dst = jnp.clip(cu[:B, None] + t[None, :], 0, B * T - 1)
    return valid, cu, src, dst


def run_blocks(layers, rows: PrefillRows | DecodeRows, cache, h: jax.Array, *, pending_out: bool = False):
    """Every block of `layers` in order over h ([B, T, D] for PrefillRows, [n*k, D] for DecodeRows).
    cache: a dataclass holding the pools the blocks name (a ModelCache: ssm, kv; an MtpCache: kv).
    Returns (h, cache, captured): captured[i] is what block i returned beside its rows (None for most).
    Each block runs with its rows' LoRA adapter indices in scope (layers/lora.py), in its own row order.
    In decode a block may hand the stream to the next as a PendingResidual, whose input norm adds the pending
    partials (layers/blocks.py); the h returned is settled to an array unless pending_out (the caller's final
    norm opens it: blocks.open_block)."""
    prefill = isinstance(rows, PrefillRows)
    captured = []
    for layer in layers:
        packed = prefill and getattr(layer, "is_ssm_layer", False)      # the Mamba prefill packs its rows
        with jax.named_scope(layer.block_name), lora.block_rows(rows, packed=packed):
            field = layer.pool_field
            pool = None if field is None else getattr(cache, field)
            step = layer.prefill_rows if prefill else layer.decode_rows
            h, pool, extra = step(pool, rows, h)
            if field is not None:
                cache = dataclasses.replace(cache, **{field: pool})
            captured.append(extra)
    return (h if pending_out else settled(h)), cache, captured
