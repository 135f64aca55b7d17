"""Index helpers for packed variable-length sequences (cu_seqlens) and their chunk tables."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def as_cu_seqlens(T: int, cu_seqlens: jax.Array | None) -> jax.Array:
    """cu_seqlens as int32 [S+1]; None means one sequence covering all T tokens."""
    if cu_seqlens is None:
        return jnp.array([0, T], jnp.int32)
    return jnp.asarray(cu_seqlens, jnp.int32)


def token_positions(T: int, cu_seqlens: jax.Array | None):
    """Per packed token: (sequence index [T], position in its sequence [T], valid [T], cu [S+1])."""
    cu = as_cu_seqlens(T, cu_seqlens)
    S = cu.shape[0] - 1
    tok = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu, tok, side="right").astype(jnp.int32) - 1, 0, S - 1)
    pos = tok - cu[seq]
    valid = tok < cu[S]
    return seq, pos, valid, cu


@dataclasses.dataclass(frozen=True)
class ChunkTable:
    """Chunks of packed sequences, none spanning two sequences.  Every field has NC = T // Q + S rows.

    seq: sequence of the chunk; start: its first packed token; length: valid tokens (0 = unused row);
    first: it starts its sequence; end_pos: position in the sequence after its last token.
    """

    seq: jax.Array
    start: jax.Array
    length: jax.Array
    first: jax.Array
    end_pos: jax.Array
    last_chunk: jax.Array  # [S] index of each sequence's last chunk (-1 for an empty sequence)
    chunk_cu: jax.Array    # [S+1] sequence s owns chunk rows chunk_cu[s] .. chunk_cu[s+1]-1


def chunk_table(T: int, cu: jax.Array, chunk_size: int) -> ChunkTable:
    """Split each sequence of cu [S+1] into chunks of chunk_size tokens, starting at its first token."""
    S = cu.shape[0] - 1
    nc = T // chunk_size + S
    lengths = cu[1:] - cu[:-1]
    n_chunks = (lengths + chunk_size - 1) // chunk_size                 # [S]
    chunk_cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(n_chunks).astype(jnp.int32)])
    c = jnp.arange(nc, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(chunk_cu, c, side="right").astype(jnp.int32) - 1, 0, S - 1)
    j = c - chunk_cu[seq]
    used = c < chunk_cu[S]
    start = cu[seq] + j * chunk_size
    length = jnp.where(used, jnp.minimum(chunk_size, lengths[seq] - j * chunk_size), 0)
    return ChunkTable(
        seq=seq, start=jnp.where(used, start, 0), length=length, first=used & (j == 0),
        end_pos=jnp.where(used, j * chunk_size + length, 0),
        last_chunk=jnp.where(n_chunks > 0, chunk_cu[1:] - 1, -1), chunk_cu=chunk_cu,
    )
