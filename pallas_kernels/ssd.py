"""Mamba-2 SSD chunked scan for prefill over packed variable-length sequences: jnp reference and Pallas kernel.

Per head h, with dt' = clamp(softplus(dt + dt_bias), limit) and state S [P, N]:
    S_t = exp(dt'_t A_h) S_{t-1} + dt'_t x_t B_t^T,    y_t = S_t C_t + D_h x_t
computed chunk by chunk (no chunk spans two sequences): an intra-chunk quadratic form, chunk-end
states, a sequential pass of states across chunks, and the state-to-output term. Everything after
the input cast is float32; every exp() of a decay sum is clamped to a non-positive exponent.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.errors import ShapeError
from pallas_kernels import registry
from pallas_kernels.triton_util import (check_blocks, check_count, check_floating, check_shape, compiler_params,
                                        dot, dot_dtype, next_pow2, softplus)
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
        raise ShapeError(f"ssd: n_groups {G} does not divide heads {H}")
    Q = check_count("ssd", "chunk_size", chunk_size)
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


# ---- Pallas (Triton backend) ---------------------------------------------------------------------------------
# Sequences are cut into segments of `segment_tokens` (aligned to each sequence's start, so a sequence's result
# does not depend on its neighbours in the batch), segments into chunks of Qk tokens (Qk divides chunk_size).
# Three launches:
#   A  per (P-block, head, segment with a successor): the segment's end state from a zero start, and its decay.
#   B  per (P-block, head, sequence): the state entering each segment (the sequence's initial state, then
#      h_in[k+1] = decay_k h_in[k] + local_k): a handful of [BP, N] tiles per sequence.
#   C  per (P-block, head, segment): walks the segment's chunks from h_in with the state [BP, N] f32 in registers:
#        acs = cumsum(dt' A)                   (f32, inside the chunk)
#        y   = (C B^T * exp(min(acs_i - acs_j, 0)) * dt_j)_causal @ x + (C @ h^T) * exp(min(acs_i, 0)) + D x
#        h   = exp(min(acs_end, 0)) h + (x * exp(min(acs_end - acs_j, 0)) dt_j)^T @ B
#      writing y, the final state (last segment) and the states at chunk_size boundaries.
# The extra program row of C zeroes y past cu_seqlens[-1] and the unused chunk-state rows and writes the final
# state of empty sequences, so every output element is written. Per-chunk states never go through HBM; only
# one [BP, N] tile per segment does. Offsets: Pallas indexes arrays over 4 GiB with 64-bit offsets.


@dataclasses.dataclass(frozen=True)
class SsdBlocks:
    """Tuning knobs of the Pallas scan.  block_q: chunk rows per step (a divisor of chunk_size, else chunk_size);
    block_p: P columns per program (>= 16); segment_tokens: tokens per segment (0: one segment per sequence)."""

    block_q: int = 64
    block_p: int = 64
    num_warps: int = 4
    num_stages: int = 2
    segment_tokens: int = 2048
    cb_precomputed: bool = True    # C B^T once per (chunk step, group) by a separate launch, read by every head
    fast_exp: bool = True          # exp as ex2.approx on the GPU (about 2 ulp) instead of libdevice expf

    def __post_init__(self):
        check_blocks("ssd", self, powers_of_two=("block_p",), counts=("block_q", "num_warps", "num_stages",
                                                                      "segment_tokens"),
                     minimum=dict(block_p=16, segment_tokens=0))


def default_ssd_blocks(P: int, N: int) -> SsdBlocks:
    """Blocks chosen from the head shape only (never the batch), so results do not depend on batch size."""
    return SsdBlocks(block_p=min(64, next_pow2(P, 16)))


def _exp(v: jax.Array, fast: bool) -> jax.Array:
    if not fast:
        return jnp.exp(v)
    [out] = plgpu.elementwise_inline_asm("ex2.approx.ftz.f32 $0, $1;", args=[v * math.log2(math.e)],
                                         constraints="=f,f", pack=1,
                                         result_shape_dtypes=[jax.ShapeDtypeStruct(v.shape, jnp.float32)])
    return out


def _ssd_cb_kernel(start_ref, len_ref, B_ref, C_ref, cb_ref, *, Qp, Np, N):
    """C_c B_c^T for chunk-step row c and group g (grid (G, rows)); zero past the chunk's rows."""
    g, c = pl.program_id(0), pl.program_id(1)
    q, n = jnp.arange(Qp), jnp.arange(Np)
    rows = start_ref[c] + q
    m = (q < len_ref[c])[:, None] & (n < N)[None, :]
    ddt = cb_ref.dtype
    Bm = plgpu.load(B_ref.at[rows[:, None], g, n[None, :]], mask=m, other=0.0).astype(ddt)
    Cm = plgpu.load(C_ref.at[rows[:, None], g, n[None, :]], mask=m, other=0.0).astype(ddt)
    cb_ref[c, g] = dot(Cm, Bm, trans_b=True).astype(ddt)


def _inner_chunk(chunk_size: int, block_q: int) -> int:
    if chunk_size <= block_q:
        return chunk_size
    return block_q if chunk_size % block_q == 0 else chunk_size


def _process_dt_tile(dtc, qm, bias, softplus_dt, clamp_dt, dt_lo, dt_hi):
    dtc = dtc.astype(jnp.float32)
    if bias is not None:
        dtc = dtc + bias
    if softplus_dt:
        dtc = softplus(dtc)
    if clamp_dt:
        dtc = jnp.minimum(jnp.maximum(dtc, dt_lo), dt_hi)
    return jnp.where(qm, dtc, 0.0)


def _segment_local_kernel(seg_start_ref, seg_len_ref, seg_seq_ref, cu_ref, A_ref, dtb_ref, x_ref, dt_ref, B_ref,
                          st_ref, dec_ref, *, P, N, rep, Qk, Qp, BP, Np, ddt, has_bias, dt_args, fast_exp):
    """Launch A: a segment's end state from a zero start [BP, N] and its total decay exp(sum dt' A)."""
    pb, h, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    f32 = jnp.float32
    start0, L_seg = seg_start_ref[k], seg_len_ref[k]
    has_next = (L_seg > 0) & (start0 + L_seg < cu_ref[seg_seq_ref[k] + 1])

    @pl.when(has_next)
    def _():
        q, n = jnp.arange(Qp), jnp.arange(Np)
        pc = pb * BP + jnp.arange(BP)
        pm, nm = pc < P, n < N
        g = h // rep
        a = A_ref[h].astype(f32)
        bias = dtb_ref[h].astype(f32) if has_bias else None

        def chunk(i, carry):
            hs, total = carry
            rows = start0 + i * Qk + q
            qm = q < jnp.minimum(Qk, L_seg - i * Qk)
            dtc = _process_dt_tile(plgpu.load(dt_ref.at[rows, h], mask=qm, other=0.0), qm, bias, *dt_args)
            acs = jnp.cumsum(dtc * a)
            acs_end = jnp.sum(jnp.where(q == Qp - 1, acs, 0.0))
            x = plgpu.load(x_ref.at[rows[:, None], h, pc[None, :]], mask=qm[:, None] & pm[None, :], other=0.0)
            Bm = plgpu.load(B_ref.at[rows[:, None], g, n[None, :]], mask=qm[:, None] & nm[None, :], other=0.0)
            xw = (x.astype(f32) * (_exp(jnp.minimum(acs_end - acs, 0.0), fast_exp) * dtc)[:, None]).astype(ddt)
            hs = jnp.exp(jnp.minimum(acs_end, 0.0)) * hs + dot(xw, Bm.astype(ddt), trans_a=True)
            return hs, total + acs_end

        hs, total = jax.lax.fori_loop(0, (L_seg + Qk - 1) // Qk, chunk, (jnp.zeros((BP, Np), f32), jnp.float32(0)))
        plgpu.store(st_ref.at[k, h, pc[:, None], n[None, :]], hs, mask=pm[:, None] & nm[None, :])

        @pl.when(pb == 0)
        def _():
            dec_ref[k, h] = jnp.exp(jnp.minimum(total, 0.0))


def _segment_pass_kernel(seg_cu_ref, st_ref, dec_ref, h0_ref, hin_ref, *, P, N, BP, Np, has_init):
    """Launch B: the state entering each segment of sequence s."""
    pb, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    first, last = seg_cu_ref[s], seg_cu_ref[s + 1]

    @pl.when(last > first)
    def _():
        n = jnp.arange(Np)
        pc = pb * BP + jnp.arange(BP)
        tile = (pc < P)[:, None] & (n < N)[None, :]
        if has_init:
            hs = plgpu.load(h0_ref.at[s, h, pc[:, None], n[None, :]], mask=tile, other=0.0).astype(jnp.float32)
        else:
            hs = jnp.zeros((BP, Np), jnp.float32)
        plgpu.store(hin_ref.at[first, h, pc[:, None], n[None, :]], hs, mask=tile)

        def step(k, hs):
            hs = dec_ref[k, h] * hs + plgpu.load(st_ref.at[k, h, pc[:, None], n[None, :]], mask=tile, other=0.0)
            plgpu.store(hin_ref.at[k + 1, h, pc[:, None], n[None, :]], hs, mask=tile)
            return hs

        jax.lax.fori_loop(first, last - 1, step, hs)


def _ssd_scan_kernel(cu_ref, uchunk_cu_ref, ichunk_cu_ref, seg_start_ref, seg_len_ref, seg_seq_ref, A_ref, D_ref,
                     dtb_ref, x_ref, dt_ref, B_ref, C_ref, h0_ref, hin_ref, cb_ref, y_ref, final_ref, *chunk_refs, S, T,
                     NSEG, NCU, P, N, rep, Qk, Qp, BP, Np, ddt, chunk_size, has_D, has_bias, has_init, use_hin, dt_args,
                     cb_precomputed, fast_exp):
    """Launch C: y, the final states and the chunk-boundary states (see the comment above)."""
    pb, h, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q = jnp.arange(Qp)
    pc = pb * BP + jnp.arange(BP)
    n = jnp.arange(Np)
    pm, nm = pc < P, n < N
    tile = pm[:, None] & nm[None, :]
    f32 = jnp.float32

    @pl.when(k < NSEG)
    def _segment():
        start0, L_seg, s = seg_start_ref[k], seg_len_ref[k], seg_seq_ref[k]
        seq_start, seq_end = cu_ref[s], cu_ref[s + 1]
        g = h // rep
        a = A_ref[h].astype(f32)
        d = D_ref[h].astype(f32) if has_D else None
        bias = dtb_ref[h].astype(f32) if has_bias else None
        if use_hin:
            hs = plgpu.load(hin_ref.at[k, h, pc[:, None], n[None, :]], mask=tile, other=0.0)
        elif has_init:
            hs = plgpu.load(h0_ref.at[s, h, pc[:, None], n[None, :]], mask=tile, other=0.0).astype(f32)
        else:
            hs = jnp.zeros((BP, Np), f32)
        causal = q[:, None] >= q[None, :]

        def chunk(i, hs):
            rows = start0 + i * Qk + q
            L = jnp.minimum(Qk, L_seg - i * Qk)
            qm = q < L
            dtc = _process_dt_tile(plgpu.load(dt_ref.at[rows, h], mask=qm, other=0.0), qm, bias, *dt_args)
            acs = jnp.cumsum(dtc * a)                                             # [Qp] f32
            acs_end = jnp.sum(jnp.where(q == Qp - 1, acs, 0.0))
            xm = qm[:, None] & pm[None, :]
            bm = qm[:, None] & nm[None, :]
            x = plgpu.load(x_ref.at[rows[:, None], h, pc[None, :]], mask=xm, other=0.0)       # [Qp, BP]
            Bm = plgpu.load(B_ref.at[rows[:, None], g, n[None, :]], mask=bm, other=0.0).astype(ddt)
            Cm = plgpu.load(C_ref.at[rows[:, None], g, n[None, :]], mask=bm, other=0.0).astype(ddt)
            if cb_precomputed:
                cb = cb_ref[ichunk_cu_ref[s] + (start0 - seq_start) // Qk + i, g].astype(f32)
            else:
                cb = dot(Cm, Bm, trans_b=True)                                    # [Qp, Qp]
            decay = _exp(jnp.minimum(acs[:, None] - acs[None, :], 0.0), fast_exp)
            w = jnp.where(causal, cb * decay * dtc[None, :], 0.0)
            y = dot(w.astype(ddt), x.astype(ddt))                                # [Qp, BP]
            y = y + dot(Cm, hs.astype(ddt), trans_b=True) * _exp(jnp.minimum(acs, 0.0), fast_exp)[:, None]
            xf = x.astype(f32)
            if has_D:
                y = y + d * xf
            plgpu.store(y_ref.at[rows[:, None], h, pc[None, :]], y.astype(y_ref.dtype), mask=xm)
            xw = (xf * (_exp(jnp.minimum(acs_end - acs, 0.0), fast_exp) * dtc)[:, None]).astype(ddt)
            hs = jnp.exp(jnp.minimum(acs_end, 0.0)) * hs + dot(xw, Bm, trans_a=True)   # [BP, Np]
            if chunk_refs:
                end = start0 + i * Qk + L                                         # packed token after the chunk
                boundary = ((end - seq_start) % chunk_size == 0) | (end == seq_end)
                row = uchunk_cu_ref[s] + (end - seq_start - 1) // chunk_size
                plgpu.store(chunk_refs[0].at[row, h, pc[:, None], n[None, :]], hs, mask=tile & boundary)
            return hs

        hs = jax.lax.fori_loop(0, (L_seg + Qk - 1) // Qk, chunk, hs)

        @pl.when((L_seg > 0) & (start0 + L_seg == seq_end))
        def _():
            plgpu.store(final_ref.at[s, h, pc[:, None], n[None, :]], hs, mask=tile)

    @pl.when(k == NSEG)
    def _tail():
        first = cu_ref[S]

        def zero_rows(i, carry):
            rows = first + i * Qp + q
            plgpu.store(y_ref.at[rows[:, None], h, pc[None, :]], jnp.zeros((Qp, BP), y_ref.dtype),
                        mask=(rows < T)[:, None] & pm[None, :])
            return carry

        jax.lax.fori_loop(0, (T - first + Qp - 1) // Qp, zero_rows, 0)

        def empty_sequence(s, carry):
            if has_init:
                h0 = plgpu.load(h0_ref.at[s, h, pc[:, None], n[None, :]], mask=tile, other=0.0).astype(f32)
            else:
                h0 = jnp.zeros((BP, Np), f32)
            plgpu.store(final_ref.at[s, h, pc[:, None], n[None, :]], h0, mask=tile & (cu_ref[s + 1] == cu_ref[s]))
            return carry

        jax.lax.fori_loop(0, S, empty_sequence, 0)
        if chunk_refs:
            def zero_chunk(c, carry):
                plgpu.store(chunk_refs[0].at[c, h, pc[:, None], n[None, :]], jnp.zeros((BP, Np), f32), mask=tile)
                return carry

            jax.lax.fori_loop(uchunk_cu_ref[S], NCU, zero_chunk, 0)


def check_ssd_args(x, dt, A, B, C, D, dt_bias) -> tuple[int, int, int, int, int]:
    """Shapes and dtypes of a scan's arguments (ShapeError naming the argument); returns (T, H, P, G, N)."""
    check_shape("ssd_scan", "x", x, (None, None, None))
    T, H, P = x.shape
    check_shape("ssd_scan", "B", B, (T, None, None))
    G, N = B.shape[1], B.shape[2]
    check_shape("ssd_scan", "dt", dt, (T, H))
    check_shape("ssd_scan", "A", A, (H,))
    check_shape("ssd_scan", "C", C, (T, G, N))
    for name, v in (("x", x), ("dt", dt), ("B", B), ("C", C)):
        check_floating("ssd_scan", name, v)
    if H % G:
        raise ShapeError(f"ssd_scan: B has {G} groups, which does not divide the {H} heads of x")
    if D is not None:
        check_shape("ssd_scan", "D", D, (H,))
    if dt_bias is not None:
        check_shape("ssd_scan", "dt_bias", dt_bias, (H,))
    return T, H, P, G, N


def sequences(x, B, cu_seqlens, initial_states):
    """(T, H, P, G, N, cu_seqlens [S + 1], S) of a scan call (inside its jit); checks initial_states [S, H, P, N]."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    cu = as_cu_seqlens(T, cu_seqlens)
    S = cu.shape[0] - 1
    if initial_states is not None:
        check_shape("ssd_scan", "initial_states", initial_states, (S, H, P, N))
    return T, H, P, G, N, cu, S


def ssd_scan_pallas(x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array, *, chunk_size: int,
                    D: jax.Array | None = None, dt_bias: jax.Array | None = None, dt_softplus: bool = True,
                    dt_limit: tuple[float, float] = (0.0, math.inf), initial_states: jax.Array | None = None,
                    cu_seqlens: jax.Array | None = None, return_chunk_states: bool = False, precision=HIGHEST,
                    interpret: bool = False, blocks: SsdBlocks | None = None) -> SsdOutput:
    """The Pallas scan; same call and results as `ssd_scan_reference`.  `precision` is accepted for that call's
    sake: f32 inputs multiply in IEEE f32, 16-bit inputs in 16-bit operands with f32 accumulation."""
    del precision
    T, H, P, G, N = check_ssd_args(x, dt, A, B, C, D, dt_bias)
    chunk_size = check_count("ssd", "chunk_size", chunk_size)
    blk = blocks or default_ssd_blocks(P, N)
    if not isinstance(blk, SsdBlocks):
        raise ShapeError(f"ssd: blocks expected an SsdBlocks, got {type(blk).__name__}")
    return _ssd_scan_pallas(x, dt, A, B, C, D, dt_bias, initial_states, cu_seqlens, chunk_size=chunk_size,
                            dt_softplus=dt_softplus, dt_limit=tuple(float(v) for v in dt_limit),
                            return_chunk_states=return_chunk_states, interpret=interpret, blk=blk)


@functools.partial(jax.jit, static_argnames=("chunk_size", "dt_softplus", "dt_limit", "return_chunk_states",
                                             "interpret", "blk"))
def _ssd_scan_pallas(x, dt, A, B, C, D, dt_bias, initial_states, cu_seqlens, *, chunk_size, dt_softplus, dt_limit,
                     return_chunk_states, interpret, blk):
    T, H, P, G, N, cu, S = sequences(x, B, cu_seqlens, initial_states)
    Qk = _inner_chunk(chunk_size, blk.block_q)
    Qp, Np, BP = next_pow2(Qk, 16), next_pow2(N, 16), blk.block_p
    seg_tokens = -(-blk.segment_tokens // Qk) * Qk if blk.segment_tokens else T
    seg_tokens = max(min(seg_tokens, -(-T // Qk) * Qk), Qk)
    seg = chunk_table(T, cu, seg_tokens)
    NSEG = seg.start.shape[0]
    use_hin = seg_tokens < T                      # some sequence may span several segments
    utab = chunk_table(T, cu, chunk_size)
    NCU = utab.start.shape[0]
    ddt = dot_dtype(x.dtype)
    f32 = jnp.float32
    one = jnp.zeros((1,), f32)
    lo, hi = dt_limit
    dt_args = (dt_softplus, lo > 0.0 or not math.isinf(hi), lo, hi)
    params = compiler_params(blk.num_warps, blk.num_stages)
    nPb = pl.cdiv(P, BP)
    h0 = jnp.zeros((1, 1, 1, 1), f32) if initial_states is None else initial_states
    bias = one if dt_bias is None else dt_bias
    common = dict(P=P, N=N, BP=BP, Np=Np)
    fast_exp = blk.fast_exp and not interpret

    if use_hin:
        st, dec = pl.pallas_call(
            functools.partial(_segment_local_kernel, rep=H // G, Qk=Qk, Qp=Qp, ddt=ddt, has_bias=dt_bias is not None,
                              dt_args=dt_args, fast_exp=fast_exp, **common),
            out_shape=[jax.ShapeDtypeStruct((NSEG, H, P, N), f32), jax.ShapeDtypeStruct((NSEG, H), f32)],
            grid=(nPb, H, NSEG), compiler_params=params, interpret=interpret, name="ssd_segment_local",
        )(seg.start, seg.length, seg.seq, cu, A, bias, x, dt, B)
        hin = pl.pallas_call(
            functools.partial(_segment_pass_kernel, has_init=initial_states is not None, **common),
            out_shape=jax.ShapeDtypeStruct((NSEG, H, P, N), f32), grid=(nPb, H, S),
            compiler_params=compiler_params(4, 1), interpret=interpret, name="ssd_segment_pass",
        )(seg.chunk_cu, st, dec, h0)
    else:
        hin = jnp.zeros((1, 1, 1, 1), f32)

    itab = chunk_table(T, cu, Qk)                  # the chunk steps (Qk tokens)
    if blk.cb_precomputed:
        cb = pl.pallas_call(
            functools.partial(_ssd_cb_kernel, Qp=Qp, Np=Np, N=N),
            out_shape=jax.ShapeDtypeStruct((itab.start.shape[0], G, Qp, Qp), ddt), grid=(G, itab.start.shape[0]),
            compiler_params=compiler_params(4, 1), interpret=interpret, name="ssd_cb",
        )(itab.start, itab.length, B, C)
    else:
        cb = jnp.zeros((1, 1, 1, 1), ddt)

    out_shape = [jax.ShapeDtypeStruct((T, H, P), x.dtype), jax.ShapeDtypeStruct((S, H, P, N), f32)]
    if return_chunk_states:
        out_shape.append(jax.ShapeDtypeStruct((NCU, H, P, N), f32))
    kernel = functools.partial(
        _ssd_scan_kernel, S=S, T=T, NSEG=NSEG, NCU=NCU, rep=H // G, Qk=Qk, Qp=Qp, ddt=ddt, chunk_size=chunk_size,
        has_D=D is not None, has_bias=dt_bias is not None, has_init=initial_states is not None, use_hin=use_hin,
        dt_args=dt_args, cb_precomputed=blk.cb_precomputed, fast_exp=fast_exp, **common)
    outs = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(nPb, H, NSEG + 1), compiler_params=params, interpret=interpret,
        name="ssd_scan",
    )(cu, utab.chunk_cu, itab.chunk_cu, seg.start, seg.length, seg.seq, A, one if D is None else D, bias, x, dt, B,
      C, h0, hin, cb)
    chunks = None
    if return_chunk_states:
        chunks = ChunkStates(states=outs[2], seq=utab.seq, end_pos=utab.end_pos, valid=utab.length > 0)
    return SsdOutput(y=outs[0], final_states=outs[1], chunk_states=chunks)


registry.register("ssd_scan", reference=ssd_scan_reference, pallas=ssd_scan_pallas)
