"""Mamba-2 SSD chunked scan for prefill: jnp reference over packed variable-length sequences.

Per head h, with dt' = clamp(softplus(dt + dt_bias), limit) and state S [P, N]:
    S_t = exp(dt'_t A_h) S_{t-1} + dt'_t x_t B_t^T,    y_t = S_t C_t + D_h x_t
computed chunk by chunk (no chunk spans two sequences): an intra-chunk quadratic form, chunk-end
states, a sequential pass of states across chunks, and the state-to-output term. Everything after
the input cast is float32; every exp() of a decay sum is clamped to a non-positive exponent.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pallas_kernels import registry
from pallas_kernels.varlen import as_cu_seqlens, chunk_table

HIGHEST = jax.lax.Precision.HIGHEST


def process_dt(dt: jax.Array, dt_bias: jax.Array | None, dt_softplus: bool,
               dt_limit: tuple[float, float]) -> jax.Array:
    """dt' = clamp(softplus(dt + dt_bias), lo, hi) in float32."""
    dt = dt.astype(jnp.float32)
    if dt_bias is not None:
        dt = dt + dt_bias.astype(jnp.float32)
    if dt_softplus:
        dt = jax.nn.softplus(dt)
    lo, hi = dt_limit
    if lo > 0.0 or not math.isinf(hi):
        dt = jnp.clip(dt, lo, hi)
    return dt


@dataclasses.dataclass(frozen=True)
class ChunkStates:
    """States at the end of every chunk (the prefix cache's cut points).  NC rows each.

    states [NC, H, P, N] f32; seq [NC] its sequence; end_pos [NC] tokens of that sequence covered;
    valid [NC] whether the row is a real chunk.
    """

    states: jax.Array
    seq: jax.Array
    end_pos: jax.Array
    valid: jax.Array


jax.tree_util.register_dataclass(ChunkStates, data_fields=["states", "seq", "end_pos", "valid"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class SsdOutput:
    y: jax.Array                 # [T, H, P] in x.dtype
    final_states: jax.Array      # [S, H, P, N] f32
    chunk_states: ChunkStates | None = None


jax.tree_util.register_dataclass(SsdOutput, data_fields=["y", "final_states", "chunk_states"], meta_fields=[])


def ssd_scan_reference(x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array, *,
                       chunk_size: int, D: jax.Array | None = None, dt_bias: jax.Array | None = None,
                       dt_softplus: bool = True, dt_limit: tuple[float, float] = (0.0, math.inf),
                       initial_states: jax.Array | None = None, cu_seqlens: jax.Array | None = None,
                       return_chunk_states: bool = False, precision=HIGHEST) -> SsdOutput:
    """x [T, H, P], dt [T, H] (raw), A [H], B/C [T, G, N], cu_seqlens [S+1] (None: one sequence),
    initial_states [S, H, P, N] (None: zeros).  Rows past cu_seqlens[-1] come out zero."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    if H % G:
        raise ValueError(f"ssd: n_groups {G} does not divide heads {H}")
    Q = chunk_size
    cu = as_cu_seqlens(T, cu_seqlens)
    S = cu.shape[0] - 1
    tab = chunk_table(T, cu, Q)
    q = jnp.arange(Q, dtype=jnp.int32)
    mask = q[None, :] < tab.length[:, None]                              # [NC, Q]
    tok = jnp.where(mask, tab.start[:, None] + q[None, :], 0)            # [NC, Q]

    dtc = jnp.where(mask[..., None], process_dt(dt, dt_bias, dt_softplus, dt_limit)[tok], 0.0)  # [NC, Q, H]
    xc = jnp.where(mask[..., None, None], x[tok].astype(jnp.float32), 0.0)                      # [NC, Q, H, P]
    Bc = jnp.where(mask[..., None, None], B[tok].astype(jnp.float32), 0.0)                      # [NC, Q, G, N]
    Cc = C[tok].astype(jnp.float32)
    rep = H // G
    Bh = jnp.repeat(Bc, rep, axis=2)                                     # [NC, Q, H, N]
    Ch = jnp.repeat(Cc, rep, axis=2)

    acs = jnp.cumsum(dtc * A.astype(jnp.float32), axis=1)               # [NC, Q, H]
    # intra-chunk: y_i = sum_{j<=i} (C_i . B_j) exp(acs_i - acs_j) dt_j x_j
    seg = acs[:, :, None, :] - acs[:, None, :, :]                        # [NC, Qi, Qj, H]
    causal = (q[:, None] >= q[None, :])[None, :, :, None]
    decay = jnp.where(causal, jnp.exp(jnp.minimum(seg, 0.0)), 0.0)
    cb = jnp.repeat(jnp.einsum("cign,cjgn->cijg", Cc, Bc, precision=precision), rep, axis=3)
    w = cb * decay * dtc[:, None, :, :]
    y = jnp.einsum("cijh,cjhp->cihp", w, xc, precision=precision)

    # chunk-end states from a zero start, then the pass across chunks
    to_end = jnp.exp(jnp.minimum(acs[:, -1:, :] - acs, 0.0)) * dtc       # [NC, Q, H]
    local = jnp.einsum("cjhn,cjh,cjhp->chpn", Bh, to_end, xc, precision=precision)
    chunk_decay = jnp.exp(jnp.minimum(acs[:, -1, :], 0.0))               # [NC, H]
    init = (jnp.zeros((S, H, P, N), jnp.float32) if initial_states is None
            else initial_states.astype(jnp.float32))

    def step(carry, inp):
        st, dec, first, seq = inp
        h_in = jnp.where(first, init[seq], carry)
        h_out = dec[:, None, None] * h_in + st
        return h_out, (h_in, h_out)

    _, (h_in, h_out) = jax.lax.scan(step, jnp.zeros((H, P, N), jnp.float32),
                                    (local, chunk_decay, tab.first, tab.seq))
    y = y + jnp.einsum("cihn,chpn->cihp", Ch, h_in, precision=precision) * jnp.exp(
        jnp.minimum(acs, 0.0))[..., None]
    if D is not None:
        y = y + D.astype(jnp.float32)[None, None, :, None] * xc

    dest = jnp.where(mask, tok, T)                                       # masked rows drop
    y_tok = jnp.zeros((T, H, P), jnp.float32).at[dest].set(y, mode="drop").astype(x.dtype)
    final = jnp.where((tab.last_chunk >= 0)[:, None, None, None], h_out[jnp.maximum(tab.last_chunk, 0)], init)
    chunks = None
    if return_chunk_states:
        chunks = ChunkStates(states=h_out, seq=tab.seq, end_pos=tab.end_pos, valid=tab.length > 0)
    return SsdOutput(y=y_tok, final_states=final, chunk_states=chunks)


def ssd_scan_batched(scan, x, dt, A, B, C, *, initial_states=None, **kwargs) -> SsdOutput:
    """Equal-length batch through a packed scan: x [Bt, L, H, P], dt [Bt, L, H], B/C [Bt, L, G, N]."""
    Bt, L = x.shape[:2]
    cu = jnp.arange(Bt + 1, dtype=jnp.int32) * L
    flat = lambda a: a.reshape(Bt * L, *a.shape[2:])
    out = scan(flat(x), flat(dt), A, flat(B), flat(C), initial_states=initial_states, cu_seqlens=cu, **kwargs)
    return dataclasses.replace(out, y=out.y.reshape(Bt, L, *out.y.shape[1:]))


registry.register("ssd_scan", reference=ssd_scan_reference)
