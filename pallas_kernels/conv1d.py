"""Causal depthwise conv1d of the Mamba-2 mixer (forward over packed sequences, and the decode update).

Layout: tokens first. x [T, C]; weight [C, K] (tap K-1 multiplies the current token); conv state
[.., C, K-1] holds the previous K-1 inputs, oldest first. Accumulation is float32, tap by tap in
order 0..K-1, in both the forward and the update, so a prefill and token-by-token decodes agree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import registry
from pallas_kernels.varlen import token_positions


def _activate(acc: jax.Array, activation: str | None) -> jax.Array:
    if activation in ("silu", "swish"):
        return jax.nn.silu(acc)
    if activation is None:
        return acc
    raise ValueError(f"conv1d: unsupported activation {activation!r}")


def causal_conv1d_reference(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, *,
                            initial_states: jax.Array | None = None, cu_seqlens: jax.Array | None = None,
                            activation: str | None = "silu") -> tuple[jax.Array, jax.Array]:
    """Conv over packed sequences.  x [T, C], cu_seqlens [S+1] (None: one sequence of T tokens),
    initial_states [S, C, K-1] (None: zeros).  Returns (y [T, C] in x.dtype, final_states [S, C, K-1]).
    Rows past cu_seqlens[-1] are zero.
    """
    T, C = x.shape
    K = weight.shape[1]
    seq, pos, valid, cu = token_positions(T, cu_seqlens)
    S = cu.shape[0] - 1
    state_dtype = x.dtype if initial_states is None else initial_states.dtype
    init = jnp.zeros((S, C, K - 1), state_dtype) if initial_states is None else initial_states
    tok = jnp.arange(T)
    chan = jnp.arange(C)
    acc = jnp.zeros((T, C), jnp.float32)
    if bias is not None:
        acc = acc + bias.astype(jnp.float32)
    for k in range(K):
        lag = K - 1 - k
        if lag == 0:
            src = x.astype(jnp.float32)
        else:
            from_x = x[jnp.maximum(tok - lag, 0)].astype(jnp.float32)
            hist = jnp.clip(K - 1 + pos - lag, 0, K - 2)
            from_state = init[seq[:, None], chan[None, :], hist[:, None]].astype(jnp.float32)
            src = jnp.where((pos >= lag)[:, None], from_x, from_state)
        acc = acc + weight[:, k].astype(jnp.float32) * src
    y = jnp.where(valid[:, None], _activate(acc, activation), 0.0).astype(x.dtype)

    # final state: the last K-1 entries of (initial state ++ the sequence's tokens)
    lengths = cu[1:] - cu[:-1]                                  # [S]
    ext = lengths[:, None] + jnp.arange(K - 1)[None, :]         # [S, K-1] index into ext
    from_init = init[jnp.arange(S)[:, None, None], chan[None, :, None], jnp.clip(ext, 0, K - 2)[:, None, :]]
    src_tok = jnp.clip(cu[:-1, None] + ext - (K - 1), 0, T - 1)  # [S, K-1]
    from_tok = jnp.transpose(x[src_tok], (0, 2, 1))            # [S, C, K-1]
    final = jnp.where((ext < K - 1)[:, None, :], from_init, from_tok.astype(init.dtype))
    return y, final.astype(init.dtype)


def causal_conv1d_update_reference(x: jax.Array, conv_state: jax.Array, weight: jax.Array,
                                   bias: jax.Array | None = None, *,
                                   activation: str | None = "silu") -> tuple[jax.Array, jax.Array]:
    """One decode step per row.  x [B, C], conv_state [B, C, K-1] -> (y [B, C], new conv_state)."""
    K = weight.shape[1]
    window = jnp.concatenate([conv_state, x[:, :, None].astype(conv_state.dtype)], axis=-1)  # [B, C, K]
    acc = jnp.zeros(x.shape, jnp.float32)
    if bias is not None:
        acc = acc + bias.astype(jnp.float32)
    for k in range(K):
        src = x.astype(jnp.float32) if k == K - 1 else window[:, :, k].astype(jnp.float32)
        acc = acc + weight[:, k].astype(jnp.float32) * src
    return _activate(acc, activation).astype(x.dtype), window[:, :, 1:]


registry.register("causal_conv1d", reference=causal_conv1d_reference)
registry.register("causal_conv1d_update", reference=causal_conv1d_update_reference)
