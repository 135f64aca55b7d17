"""Causal depthwise conv1d of the Mamba-2 mixer (forward over packed sequences, and the decode update):
jnp references and Pallas kernels.

Layout: tokens first. x [T, C]; weight [C, K] (tap K-1 multiplies the current token); conv state
[.., C, K-1] holds the previous K-1 inputs, oldest first. Accumulation is float32, tap by tap in
order 0..K-1, in both the forward and the update, so a prefill and token-by-token decodes agree.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import registry
from pallas_kernels.errors import KernelUnavailableError
from pallas_kernels.triton_util import (check_blocks, check_columns, check_floating, check_row_offset, check_shape,
                                       columns, compiler_params, next_pow2)
from pallas_kernels.varlen import as_cu_seqlens, token_positions


def _checked(activation: str | None) -> str | None:
    """The activations the kernels and references apply: SiLU (alias swish) or none."""
    if activation not in ("silu", "swish", None):
        raise KernelUnavailableError(f"conv1d: no kernel for activation {activation!r:.40}; expected 'silu', "
                                     "'swish' or None")
    return activation


def _activate(acc: jax.Array, activation: str | None) -> jax.Array:
    return acc if _checked(activation) is None else jax.nn.silu(acc)


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
    return y, _final_states(x, init, cu, K)


def _final_states(x: jax.Array, init: jax.Array, cu: jax.Array, K: int) -> jax.Array:
    """The last K-1 entries of (initial state ++ the sequence's tokens), per sequence: [S, C, K-1]."""
    T, C = x.shape
    S = cu.shape[0] - 1
    chan = jnp.arange(C)
    lengths = cu[1:] - cu[:-1]                                  # [S]
    ext = lengths[:, None] + jnp.arange(K - 1)[None, :]         # [S, K-1] index into ext
    from_init = init[jnp.arange(S)[:, None, None], chan[None, :, None], jnp.clip(ext, 0, K - 2)[:, None, :]]
    src_tok = jnp.clip(cu[:-1, None] + ext - (K - 1), 0, T - 1)  # [S, K-1]
    from_tok = jnp.transpose(x[src_tok], (0, 2, 1))            # [S, C, K-1]
    final = jnp.where((ext < K - 1)[:, None, :], from_init, from_tok.astype(init.dtype))
    return final.astype(init.dtype)


def _update_step(window: jax.Array, x: jax.Array, weight: jax.Array, bias: jax.Array | None,
                 activation: str | None) -> tuple[jax.Array, jax.Array]:
    """One token per row.  window [B, C, K-1] (previous inputs), x [B, C] -> (y [B, C] f32, next window)."""
    K = weight.shape[1]
    acc = jnp.zeros(x.shape, jnp.float32)
    if bias is not None:
        acc = acc + bias.astype(jnp.float32)
    for k in range(K):
        src = x.astype(jnp.float32) if k == K - 1 else window[:, :, k].astype(jnp.float32)
        acc = acc + weight[:, k].astype(jnp.float32) * src
    nxt = jnp.concatenate([window[:, :, 1:], x[:, :, None].astype(window.dtype)], axis=-1)
    return _activate(acc, activation), nxt


def _live_windows(pool, rows, skip_row):
    """(the named rows' windows, zero where a row is skip_row; a function that keeps skip_row's window in a
    scatter of new windows). rows: pool rows (row_offset added)."""
    old = pool[rows]
    if skip_row is None:
        return old, lambda new: new
    live = (rows != skip_row)[:, None, None]
    return jnp.where(live, old, jnp.zeros_like(old)), lambda new: jnp.where(live, new, old)


def causal_conv1d_update_reference(pool: jax.Array, rows: jax.Array, x: jax.Array, weight: jax.Array,
                                   bias: jax.Array | None = None, *, activation: str | None = "silu",
                                   x_col: int | None = None, skip_row: int | None = None,
                                   row_offset: int = 0) -> tuple[jax.Array, jax.Array]:
    """One decode step per batch row, slot-indexed.  pool [R, C, K-1] (conv states, oldest first), rows [B],
    x [B, C] -> (y [B, C] in x.dtype, pool with the named rows advanced; no other row touched).
    With x_col, x [B, W] holds the conv input in its columns [x_col, x_col + C) (the Mamba-2 in_proj output).
    row_offset: batch row b reads and writes pool row rows[b] + row_offset (a layer's block of a flattened
    [layers * slots] pool: the kernels add it, so a decode step computes no row indices per layer).
    skip_row: a pool row (the padding slot's) neither read nor written; batch rows naming it start from zeros."""
    x = columns(x, x_col, weight.shape[0])
    rows = rows + check_row_offset("causal_conv1d_update", pool, row_offset, rows)
    window, keep = _live_windows(pool, rows, skip_row)
    y, nxt = _update_step(window, x, weight, bias, activation)
    return y.astype(x.dtype), pool.at[rows].set(keep(nxt))


def causal_conv1d_update_multi_reference(pool: jax.Array, rows: jax.Array, x: jax.Array, weight: jax.Array,
                                         bias: jax.Array | None = None, *, activation: str | None = "silu",
                                         x_col: int | None = None, skip_row: int | None = None,
                                         row_offset: int = 0):
    """k consecutive tokens per batch row (speculative verify).  x [B, k, C] -> (y [B, k, C],
    step_states [B, k, C, K-1] (the conv state after each token), pool with the rows at their last token)."""
    x = columns(x, x_col, weight.shape[0])
    rows = rows + check_row_offset("causal_conv1d_update_multi", pool, row_offset, rows)
    window, keep = _live_windows(pool, rows, skip_row)

    def body(window, xk):
        yk, window = _update_step(window, xk, weight, bias, activation)
        return window, (yk, window)

    last, (y, steps) = jax.lax.scan(body, window, jnp.swapaxes(x, 0, 1))
    swap = lambda a: jnp.swapaxes(a, 0, 1)
    return swap(y).astype(x.dtype), swap(steps), pool.at[rows].set(keep(last))


# ---- Pallas (Triton backend) ---------------------------------------------------------------------------------
# Forward: grid (channel blocks, token blocks); a token's tap at lag l reads x[t - l] when it lies in the same
# sequence (position >= l), else entry K-1+pos-l of the sequence's initial state. Taps accumulate in f32 in the
# reference's order. The final states (S x C x (K-1) values) are gathered by the same jnp code as the reference.
# Update: grid (channel blocks, batch rows): each program reads its row's [BC, K-1] window from the pool (as one
# [BC, KW] tile), runs its k tokens (y = silu(sum_k w_k window_k), the window shifts by one) and writes the window
# back into the same buffer: the pool is an input aliased to an output, so with the pool donated nothing else of
# it is read, written or copied (no gather / scatter around the kernel). Rows naming the padding row race only
# there, and with skip_row (the padding row) they neither read nor write it.


@dataclasses.dataclass(frozen=True)
class ConvBlocks:
    block_t: int = 32
    block_c: int = 256
    num_warps: int = 4

    def __post_init__(self):
        check_blocks("causal_conv1d", self, powers_of_two=("block_t", "block_c", "num_warps"))


def _act(acc, activation):
    return acc * jax.nn.sigmoid(acc) if activation in ("silu", "swish") else acc


def _conv_fwd_kernel(seq_ref, pos_ref, x_ref, w_ref, b_ref, init_ref, y_ref, *, T, C, K, BT, BC, has_bias, has_init,
                     activation):
    cb, tb = pl.program_id(0), pl.program_id(1)
    f32 = jnp.float32
    tok = tb * BT + jnp.arange(BT)
    ch = cb * BC + jnp.arange(BC)
    tm, cm = tok < T, ch < C
    m = tm[:, None] & cm[None, :]
    seq = plgpu.load(seq_ref.at[tok], mask=tm, other=0)
    pos = plgpu.load(pos_ref.at[tok], mask=tm, other=-1)         # -1: a row past the packed tokens
    acc = jnp.zeros((BT, BC), f32)
    if has_bias:
        acc = acc + plgpu.load(b_ref.at[ch], mask=cm, other=0.0).astype(f32)[None, :]
    for k in range(K):
        lag = K - 1 - k
        if lag == 0:
            src = plgpu.load(x_ref.at[tok[:, None], ch[None, :]], mask=m, other=0.0).astype(f32)
        else:
            inside = (pos >= lag)[:, None]
            src = plgpu.load(x_ref.at[tok[:, None] - lag, ch[None, :]], mask=m & inside, other=0.0).astype(f32)
            if has_init:
                hist = (K - 1 + pos - lag)[:, None]
                from_state = plgpu.load(init_ref.at[seq[:, None], ch[None, :], hist], mask=m & ~inside & (hist >= 0),
                                        other=0.0).astype(f32)
                src = jnp.where(inside, src, from_state)
        wk = plgpu.load(w_ref.at[ch, k], mask=cm, other=0.0).astype(f32)
        acc = acc + wk[None, :] * src
    y = jnp.where((pos >= 0)[:, None], _act(acc, activation), 0.0)
    plgpu.store(y_ref.at[tok[:, None], ch[None, :]], y.astype(y_ref.dtype), mask=m)


def causal_conv1d_pallas(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, *,
                         initial_states: jax.Array | None = None, cu_seqlens: jax.Array | None = None,
                         activation: str | None = "silu", interpret: bool = False,
                         blocks: ConvBlocks | None = None) -> tuple[jax.Array, jax.Array]:
    """The Pallas conv forward; same call and results as `causal_conv1d_reference`."""
    check_shape("causal_conv1d", "x", x, (None, None))
    check_floating("causal_conv1d", "x", x)
    T, C = x.shape
    check_shape("causal_conv1d", "weight", weight, (C, None))
    if bias is not None:
        check_shape("causal_conv1d", "bias", bias, (C,))
    _checked(activation)
    return _conv_fwd(x, weight, bias, initial_states, cu_seqlens, activation=activation, interpret=interpret,
                     blocks=blocks)


@functools.partial(jax.jit, static_argnames=("activation", "interpret", "blocks"))
def _conv_fwd(x, weight, bias, initial_states, cu_seqlens, *, activation, interpret, blocks):
    T, C = x.shape
    K = weight.shape[1]
    cu = as_cu_seqlens(T, cu_seqlens)
    S = cu.shape[0] - 1
    if initial_states is not None:
        check_shape("causal_conv1d", "initial_states", initial_states, (S, C, K - 1))
    seq, pos, valid, _ = token_positions(T, cu)
    pos = jnp.where(valid, pos, -1)
    blk = blocks or ConvBlocks()
    BT, BC = min(blk.block_t, next_pow2(T)), min(blk.block_c, next_pow2(C))
    one = jnp.zeros((1,), x.dtype)
    kernel = functools.partial(_conv_fwd_kernel, T=T, C=C, K=K, BT=BT, BC=BC,
                               has_bias=bias is not None, has_init=initial_states is not None and K > 1,
                               activation=activation)
    y = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((T, C), x.dtype), grid=(pl.cdiv(C, BC), pl.cdiv(T, BT)),
        compiler_params=compiler_params(blk.num_warps), interpret=interpret, name="causal_conv1d_fwd",
    )(seq, pos, x, weight, one if bias is None else bias,
      jnp.zeros((1, 1, 1), x.dtype) if initial_states is None else initial_states)
    state_dtype = x.dtype if initial_states is None else initial_states.dtype
    init = jnp.zeros((S, C, K - 1), state_dtype) if initial_states is None else initial_states
    return y, _final_states(x, init, cu, K)


def _column(tile: jax.Array, k: int) -> jax.Array:
    """Column k of a [BC, KW] float32 tile, exactly: the other entries become -0.0, the identity of addition."""
    kk = jnp.arange(tile.shape[1])
    return jnp.sum(jnp.where(kk[None, :] == k, tile, -0.0), axis=1)


def _tile(columns: list, KW: int) -> jax.Array:
    """[BC, KW] with the given [BC] columns first (the rest zero): the inverse of `_column`."""
    kk = jnp.arange(KW)[None, :]
    out = jnp.zeros((columns[0].shape[0], KW), columns[0].dtype)
    for k, col in enumerate(columns):
        out = jnp.where(kk == k, col[:, None], out)
    return out


def _conv_update_kernel(rows_ref, x_ref, w_ref, b_ref, pool_in_ref, y_ref, pool_ref, *steps_ref, C, K, KW, KT, BC,
                        x_col, has_bias, activation, multi, skip_row, row_offset):
    """The window and the weights move as [BC, KW] tiles (a channel's K-1 window entries and K taps side by side,
    as they lie in memory), so a warp's access covers consecutive bytes, where one load per tap would touch a
    sector per channel; columns are taken out exactly (`_column`)."""
    del pool_in_ref  # aliased to pool_ref
    cb, b = pl.program_id(0), pl.program_id(1)
    f32 = jnp.float32
    ch = cb * BC + jnp.arange(BC)
    kk = jnp.arange(KW)
    cm = ch < C
    r = rows_ref[b] + row_offset
    pm = cm if skip_row is None else cm & (r != skip_row)               # skip_row: no pool traffic
    wm = pm[:, None] & (kk < K - 1)[None, :]                            # [BC, KW]: the window's entries
    at = (ch[:, None], kk[None, :])
    win = plgpu.load(pool_ref.at[(r, *at)], mask=wm, other=0.0).astype(f32)
    window = [_column(win, k) for k in range(K - 1)]                    # oldest first, [BC] each
    taps = plgpu.load(w_ref.at[at], mask=cm[:, None] & (kk < K)[None, :], other=0.0).astype(f32)
    w = [_column(taps, k) for k in range(K)]
    bias = plgpu.load(b_ref.at[ch], mask=cm, other=0.0).astype(f32) if has_bias else None
    for t in range(KT):
        step = (b, t) if multi else (b,)
        x = plgpu.load(x_ref.at[(*step, x_col + ch)], mask=cm, other=0.0)
        acc = jnp.zeros((BC,), f32) if bias is None else bias
        for k in range(K):
            acc = acc + w[k] * (x.astype(f32) if k == K - 1 else window[k])
        plgpu.store(y_ref.at[(*step, ch)], _act(acc, activation).astype(y_ref.dtype), mask=cm)
        window = window[1:] + [x.astype(pool_ref.dtype).astype(f32)] if K > 1 else window
        if multi and K > 1:
            plgpu.store(steps_ref[0].at[(b, t, *at)], _tile(window, KW).astype(pool_ref.dtype),
                        mask=cm[:, None] & (kk < K - 1)[None, :])
    if K > 1:
        plgpu.store(pool_ref.at[(r, *at)], _tile(window, KW).astype(pool_ref.dtype), mask=wm)


def _check_update(kernel, pool, rows, x, weight, bias, lead, x_col, row_offset) -> int:
    """The update's arguments; returns row_offset as the int the kernel adds."""
    check_shape(kernel, "x", x, (*lead, None))
    check_floating(kernel, "x", x)
    check_shape(kernel, "weight", weight, (None, None))
    C = x.shape[-1] if x_col is None else weight.shape[0]
    check_columns(kernel, "x", x, lead, x_col, C)
    check_shape(kernel, "weight", weight, (C, None))
    check_shape(kernel, "pool", pool, (None, C, weight.shape[1] - 1))
    check_shape(kernel, "rows", rows, (x.shape[0],))
    offset = check_row_offset(kernel, pool, row_offset, rows)
    if bias is not None:
        check_shape(kernel, "bias", bias, (C,))
    return offset


def causal_conv1d_update_pallas(pool: jax.Array, rows: jax.Array, x: jax.Array, weight: jax.Array,
                                bias: jax.Array | None = None, *, activation: str | None = "silu",
                                x_col: int | None = None, skip_row: int | None = None, row_offset: int = 0,
                                interpret: bool = False, blocks: ConvBlocks | None = None):
    """The Pallas conv decode step; same call and results as `causal_conv1d_update_reference`, the pool
    updated in place when the caller donates it; with x_col the input columns are read in place."""
    offset = _check_update("causal_conv1d_update", pool, rows, x, weight, bias, (None,), x_col, row_offset)
    return _conv_update(pool, rows, x, weight, bias, activation=_checked(activation), interpret=interpret,
                        blocks=blocks, multi=False, x_col=x_col, skip_row=_skip(skip_row), row_offset=offset)


def causal_conv1d_update_multi_pallas(pool: jax.Array, rows: jax.Array, x: jax.Array, weight: jax.Array,
                                      bias: jax.Array | None = None, *, activation: str | None = "silu",
                                      x_col: int | None = None, skip_row: int | None = None,
                                      row_offset: int = 0, interpret: bool = False,
                                      blocks: ConvBlocks | None = None):
    """The Pallas k-token conv update; same call and results as `causal_conv1d_update_multi_reference`."""
    offset = _check_update("causal_conv1d_update_multi", pool, rows, x, weight, bias, (None, None), x_col,
                           row_offset)
    y, pool, steps = _conv_update(pool, rows, x, weight, bias, activation=_checked(activation),
                                  interpret=interpret, blocks=blocks, multi=True, x_col=x_col,
                                  skip_row=_skip(skip_row), row_offset=offset)
    return y, steps, pool


def _skip(skip_row):
    return None if skip_row is None else int(skip_row)


@functools.partial(jax.jit, static_argnames=("activation", "interpret", "blocks", "multi", "x_col", "skip_row",
                                             "row_offset"))
def _conv_update(pool, rows, x, weight, bias, *, activation, interpret, blocks, multi, x_col, skip_row, row_offset):
    Bt, (C, K) = x.shape[0], weight.shape
    KT = x.shape[1] if multi else 1
    blk = blocks or ConvBlocks()
    BC = min(blk.block_c * 4, next_pow2(C))
    out_shape = [jax.ShapeDtypeStruct((*x.shape[:-1], C), x.dtype), jax.ShapeDtypeStruct(pool.shape, pool.dtype)]
    if multi:
        out_shape.append(jax.ShapeDtypeStruct((Bt, KT, C, K - 1), pool.dtype))
    kernel = functools.partial(_conv_update_kernel, C=C, K=K, KW=next_pow2(K), KT=KT, BC=BC, x_col=x_col or 0,
                               has_bias=bias is not None, activation=activation, multi=multi, skip_row=skip_row,
                               row_offset=row_offset)
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(pl.cdiv(C, BC), Bt), input_output_aliases={4: 1},
        compiler_params=compiler_params(blk.num_warps), interpret=interpret, name="causal_conv1d_update",
    )(rows.astype(jnp.int32), x, weight, jnp.zeros((1,), x.dtype) if bias is None else bias, pool)


registry.register("causal_conv1d", reference=causal_conv1d_reference, pallas=causal_conv1d_pallas)
registry.register("causal_conv1d_update", reference=causal_conv1d_update_reference, pallas=causal_conv1d_update_pallas)
registry.register("causal_conv1d_update_multi", reference=causal_conv1d_update_multi_reference,
                  pallas=causal_conv1d_update_multi_pallas)
