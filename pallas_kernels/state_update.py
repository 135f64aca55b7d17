"""Mamba-2 recurrent state update for decode: jnp references and Pallas kernels.

The state pool is passed whole, flattened to rows: state [R, H, P, N] (R = layers * slots), and each
batch row names its pool row. Rows are gathered, advanced one token (or K tokens, keeping the state
after every token for verify and rollback), and scattered back; no other row is touched.
    S = exp(dt' A) S + dt' x B^T,   y = S C + D x      (state math in float32)
Every entry point takes the decay rates A [H] or, with A=None, A_log [H] (A = -exp(A_log) computed in the kernel:
a model's decode step then launches no separate kernel for it). skip_row names a pool row (the padding slot's)
that is neither read nor written: batch rows naming it run from a zero state (their outputs are padding) and cost
no state traffic, so a lone sequence padded to two rows or a part-filled batch bucket moves only its live rows.
row_offset (static) is added to every batch row's pool row: a model layer passes its slots and its block of the
flattened [layers * slots] pool, so a decode step computes no row indices per layer.
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
from pallas_kernels.ssd import process_dt
from pallas_kernels.triton_util import (check_blocks, check_columns, check_floating, check_row_offset, check_shape,
                                       columns, compiler_params, next_pow2, softplus)


def _step(h, x, dt, A, B, C, D):
    """One token for a batch.  h [Bt, H, P, N] f32, x [Bt, H, P], dt [Bt, H] f32, B/C [Bt, G, N]."""
    H = x.shape[1]
    rep = H // B.shape[1]
    Bh = jnp.repeat(B.astype(jnp.float32), rep, axis=1)                  # [Bt, H, N]
    Ch = jnp.repeat(C.astype(jnp.float32), rep, axis=1)
    xf = x.astype(jnp.float32)
    dA = jnp.exp(jnp.minimum(dt * A.astype(jnp.float32), 0.0))           # [Bt, H]
    h = h * dA[:, :, None, None] + (dt[:, :, None] * xf)[..., None] * Bh[:, :, None, :]
    y = jnp.sum(h * Ch[:, :, None, :], axis=-1)
    if D is not None:
        y = y + D.astype(jnp.float32)[None, :, None] * xf
    return h, y


def _rates(A, A_log):
    """(the operand the kernel reads as A, whether it holds A_log); exactly one of the two."""
    if (A is None) == (A_log is None):
        raise ShapeError(f"state_update: expected exactly one of A and A_log, got "
                         f"{'both' if A is not None else 'neither'}")
    return (A, False) if A_log is None else (A_log, True)


def decay_rates(A: jax.Array | None, A_log: jax.Array | None) -> jax.Array:
    """A [H] as given, or -exp(A_log) in float32; exactly one of the two."""
    a, is_log = _rates(A, A_log)
    return -jnp.exp(a.astype(jnp.float32)) if is_log else a


def _live_rows(state, rows, skip_row):
    """(the named rows' states in float32, zero where a row is skip_row; a function that keeps skip_row's state
    in a scatter of new values)."""
    old = state[rows]
    if skip_row is None:
        return old.astype(jnp.float32), lambda new: new
    live = (rows != skip_row).reshape(-1, *(1,) * (state.ndim - 1))
    return jnp.where(live, old.astype(jnp.float32), 0.0), lambda new: jnp.where(live, new, old)


def state_update_reference(state: jax.Array, rows: jax.Array, x: jax.Array, dt: jax.Array, A: jax.Array | None,
                           B: jax.Array, C: jax.Array, *, D: jax.Array | None = None,
                           dt_bias: jax.Array | None = None, dt_softplus: bool = True,
                           dt_limit: tuple[float, float] = (0.0, math.inf),
                           A_log: jax.Array | None = None, skip_row: int | None = None,
                           row_offset: int = 0) -> tuple[jax.Array, jax.Array]:
    """One token per batch row.  state [R, H, P, N], rows [Bt], x [Bt, H, P], dt [Bt, H], B/C [Bt, G, N].
    Returns (y [Bt, H, P] in x.dtype, new state)."""
    rows = rows + check_row_offset("state_update", state, row_offset, rows)
    dtp = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    h0, keep = _live_rows(state, rows, skip_row)
    h, y = _step(h0, x, dtp, decay_rates(A, A_log), B, C, D)
    return y.astype(x.dtype), state.at[rows].set(keep(h.astype(state.dtype)))


def state_update_multi_reference(state: jax.Array, rows: jax.Array, x: jax.Array, dt: jax.Array,
                                 A: jax.Array | None, B: jax.Array, C: jax.Array, *, D: jax.Array | None = None,
                                 dt_bias: jax.Array | None = None, dt_softplus: bool = True,
                                 dt_limit: tuple[float, float] = (0.0, math.inf), A_log: jax.Array | None = None,
                                 skip_row: int | None = None, row_offset: int = 0):
    """K tokens per batch row.  x [Bt, K, H, P], dt [Bt, K, H], B/C [Bt, K, G, N].
    Returns (y [Bt, K, H, P], step_states [Bt, K, H, P, N] (state after each token), new state)."""
    rows = rows + check_row_offset("state_update_multi", state, row_offset, rows)
    dtp = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    A = decay_rates(A, A_log)
    h0, keep = _live_rows(state, rows, skip_row)

    def body(h, inp):
        xk, dtk, Bk, Ck = inp
        h, y = _step(h, xk, dtk, A, B=Bk, C=Ck, D=D)
        h = h.astype(state.dtype).astype(jnp.float32)   # the state is stored between tokens
        return h, (y, h)

    swap = lambda a: jnp.swapaxes(a, 0, 1)
    h, (y, hs) = jax.lax.scan(body, h0, (swap(x), swap(dtp), swap(B), swap(C)))
    return swap(y).astype(x.dtype), swap(hs).astype(state.dtype), state.at[rows].set(keep(h.astype(state.dtype)))


def unpack_xbc(xbc: jax.Array, dt: jax.Array, dt_col: int | None, H: int, P: int, N: int):
    """The Mamba-2 packed operands cut apart: xbc [..., H*P + 2*G*N] (x | B | C) -> x [..., H, P],
    B, C [..., G, N]; dt [..., H], or its columns [dt_col, dt_col + H) when dt_col is given."""
    lead, HP = xbc.shape[:-1], H * P
    GN = (xbc.shape[-1] - HP) // 2
    x = xbc[..., :HP].reshape(*lead, H, P)
    B = xbc[..., HP:HP + GN].reshape(*lead, GN // N, N)
    C = xbc[..., HP + GN:].reshape(*lead, GN // N, N)
    return x, columns(dt, dt_col, H), B, C


def state_update_xbc_reference(state: jax.Array, rows: jax.Array, xbc: jax.Array, dt: jax.Array,
                               A: jax.Array | None = None, *,
                               dt_col: int | None = None, **kw) -> tuple[jax.Array, jax.Array]:
    """`state_update_reference` on the packed operands (the conv output xbc [Bt, H*P + 2*G*N] and dt, or the
    in_proj output holding dt at dt_col), which the Pallas kernel reads in place."""
    x, dt, B, C = unpack_xbc(xbc, dt, dt_col, *state.shape[1:])
    return state_update_reference(state, rows, x, dt, A, B, C, **kw)


def state_update_multi_xbc_reference(state: jax.Array, rows: jax.Array, xbc: jax.Array, dt: jax.Array,
                                     A: jax.Array | None = None, *, dt_col: int | None = None, **kw):
    """`state_update_multi_reference` on the packed operands: xbc [Bt, K, H*P + 2*G*N], dt [Bt, K, ...]."""
    x, dt, B, C = unpack_xbc(xbc, dt, dt_col, *state.shape[1:])
    return state_update_multi_reference(state, rows, x, dt, A, B, C, **kw)


# ---- Pallas (Triton backend) ---------------------------------------------------------------------------------
# Grid (P-blocks, heads, batch rows): each program gathers the [BP, N] tile of its pool row, advances it (K tokens
# in registers for the multi form) and scatters it back into the same buffer: the pool is an input aliased to
# an output (input_output_aliases), so under jit with the pool donated nothing else of the pool is read,
# written or copied. Batch rows naming the same (padding) row race only on that row; with skip_row (that row) they
# neither read nor write it. x, B, C and dt reach the
# kernel as [*lead, columns] arrays with a static column offset each, so the packed forms (`*_xbc`) read the
# conv output and the in_proj output in place: no slice kernels between the custom calls.


@dataclasses.dataclass(frozen=True)
class UpdateBlocks:
    """Tuning knobs: P rows of the state per program, warps per program."""

    block_p: int = 16
    num_warps: int = 4

    def __post_init__(self):
        check_blocks("state_update", self, powers_of_two=("block_p", "num_warps"))


def default_update_blocks(P: int, N: int) -> UpdateBlocks:
    """From the head shape only (never the batch), so a row's result does not depend on the batch."""
    return UpdateBlocks(block_p=min(next_pow2(P), max(1, 2048 // next_pow2(N))), num_warps=4)


def _update_kernel(rows_ref, A_ref, D_ref, dtb_ref, x_ref, dt_ref, B_ref, C_ref, state_in_ref, y_ref, state_ref,
                   *steps_ref, K, P, N, rep, BP, Np, cols, has_D, has_bias, softplus_dt, dt_lo, dt_hi, clamp_dt,
                   multi, a_is_log, skip_row, row_offset):
    del state_in_ref  # aliased to state_ref
    pb, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    f32 = jnp.float32
    pc = pb * BP + jnp.arange(BP)
    n = jnp.arange(Np)
    pm, nm = pc < P, n < N
    tile = pm[:, None] & nm[None, :]
    r, g = rows_ref[b] + row_offset, h // rep
    pool_tile = tile if skip_row is None else tile & (r != skip_row)     # skip_row: no state traffic
    x_col, b_col, c_col, dt_col = cols
    a = A_ref[h].astype(f32)
    if a_is_log:
        a = -jnp.exp(a)
    state = plgpu.load(state_ref.at[r, h, pc[:, None], n[None, :]], mask=pool_tile, other=0.0).astype(f32)

    def token(k, state):
        at = (b, k) if multi else (b,)
        dt = dt_ref[(*at, dt_col + h)].astype(f32)
        if has_bias:
            dt = dt + dtb_ref[h].astype(f32)
        if softplus_dt:
            dt = softplus(dt)
        if clamp_dt:
            dt = jnp.minimum(jnp.maximum(dt, dt_lo), dt_hi)
        x = plgpu.load(x_ref.at[(*at, x_col + h * P + pc)], mask=pm, other=0.0).astype(f32)       # [BP]
        Bv = plgpu.load(B_ref.at[(*at, b_col + g * N + n)], mask=nm, other=0.0).astype(f32)       # [Np]
        Cv = plgpu.load(C_ref.at[(*at, c_col + g * N + n)], mask=nm, other=0.0).astype(f32)
        dA = jnp.exp(jnp.minimum(dt * a, 0.0))
        state = state * dA + (dt * x)[:, None] * Bv[None, :]
        y = jnp.sum(state * Cv[None, :], axis=1)
        state = state.astype(state_ref.dtype).astype(f32)          # the state is stored between tokens
        if has_D:
            y = y + D_ref[h].astype(f32) * x
        plgpu.store(y_ref.at[(*at, h, pc)], y.astype(y_ref.dtype), mask=pm)
        if multi:
            plgpu.store(steps_ref[0].at[b, k, h, pc[:, None], n[None, :]], state.astype(state_ref.dtype), mask=tile)
        return state

    state = jax.lax.fori_loop(0, K, token, state) if multi else token(0, state)
    plgpu.store(state_ref.at[r, h, pc[:, None], n[None, :]], state.astype(state_ref.dtype), mask=pool_tile)


def _check_update(state, rows, x, dt, A, B, C, D, dt_bias, lead):
    """Shapes of the update's arguments; lead = (Bt,) or (Bt, K); A is A or A_log."""
    name = "state_update"
    check_shape(name, "state", state, (None, None, None, None))
    _, H, P, N = state.shape
    check_shape(name, "rows", rows, lead[:1])
    if not jnp.issubdtype(rows.dtype, jnp.integer):
        raise ShapeError(f"{name}: rows expected an integer dtype, got {rows.dtype}")
    check_shape(name, "x", x, (*lead, H, P))
    check_shape(name, "dt", dt, (*lead, H))
    check_shape(name, "A", A, (H,))
    check_shape(name, "B", B, (*lead, None, N))
    check_shape(name, "C", C, B.shape)
    for arg, v in (("x", x), ("dt", dt), ("B", B), ("C", C), ("state", state)):
        check_floating(name, arg, v)
    if H % B.shape[-2]:
        raise ShapeError(f"{name}: n_groups {B.shape[-2]} does not divide heads {H}")
    if D is not None:
        check_shape(name, "D", D, (H,))
    if dt_bias is not None:
        check_shape(name, "dt_bias", dt_bias, (H,))


def _check_packed(state, rows, xbc, dt, A, D, dt_bias, dt_col, lead):
    """The packed operands: xbc [*lead, H*P + 2*G*N] with G dividing H, dt [*lead, H] or holding H columns
    at dt_col; then the rest as `_check_update` on the shapes they unpack to."""
    name = "state_update_xbc"
    check_shape(name, "state", state, (None, None, None, None))
    _, H, P, N = state.shape
    check_shape(name, "xbc", xbc, (*lead, None))
    GN2 = xbc.shape[-1] - H * P
    if GN2 <= 0 or GN2 % (2 * N) or H % (GN2 // (2 * N)):
        raise ShapeError(f"{name}: xbc expected {H}*{P} x columns then B and C of G*{N} each (G dividing {H}), "
                         f"got {xbc.shape[-1]} columns")
    check_columns(name, "dt", dt, lead, dt_col, H)
    x, dt, B, C = jax.eval_shape(functools.partial(unpack_xbc, dt_col=dt_col, H=H, P=P, N=N), xbc, dt)
    _check_update(state, rows, x, dt, A, B, C, D, dt_bias, lead)


@functools.partial(jax.jit, static_argnames=("G", "cols", "dt_softplus", "dt_limit", "interpret", "blocks",
                                             "multi", "a_is_log", "skip_row", "row_offset"))
def _update_pallas(state, rows, x, dt, A, B, C, D, dt_bias, *, G, cols, dt_softplus, dt_limit, interpret, blocks,
                   multi, a_is_log, skip_row, row_offset):
    """x, B, C, dt: [*lead, columns], read from the static column offsets cols = (x, B, C, dt); A holds A_log
    when a_is_log."""
    _, H, P, N = state.shape
    lead = x.shape[:-1]
    Bt = lead[0]
    K = lead[1] if multi else 1
    blk = blocks or default_update_blocks(P, N)
    BP, Np = blk.block_p, next_pow2(N)
    lo, hi = dt_limit
    one = jnp.zeros((1,), jnp.float32)
    out_shape = [jax.ShapeDtypeStruct((*lead, H, P), x.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype)]
    if multi:
        out_shape.append(jax.ShapeDtypeStruct((Bt, K, H, P, N), state.dtype))
    kernel = functools.partial(
        _update_kernel, K=K, P=P, N=N, rep=H // G, BP=BP, Np=Np, cols=cols, has_D=D is not None,
        has_bias=dt_bias is not None, softplus_dt=dt_softplus, dt_lo=lo, dt_hi=hi,
        clamp_dt=lo > 0.0 or not math.isinf(hi), multi=multi, a_is_log=a_is_log, skip_row=skip_row,
        row_offset=row_offset)
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(pl.cdiv(P, BP), H, Bt), input_output_aliases={8: 1},
        compiler_params=compiler_params(blk.num_warps, 1), interpret=interpret, name="ssm_state_update",
    )(rows.astype(jnp.int32), A, one if D is None else D, one if dt_bias is None else dt_bias, x, dt, B, C, state)


def _flat_operands(x, B, C, lead):
    """The unpacked operands as the kernel reads them: [*lead, columns], all from column 0."""
    n = len(lead)
    return (x.reshape(*x.shape[:n], -1), B.reshape(*B.shape[:n], -1), C.reshape(*C.shape[:n], -1),
            B.shape[-2], (0, 0, 0, 0))


def _packed_operands(state, xbc, dt_col):
    """The packed operands as the kernel reads them: xbc three times, at the x, B and C column offsets."""
    _, H, P, N = state.shape
    GN = (xbc.shape[-1] - H * P) // 2
    return xbc, xbc, xbc, GN // N, (0, H * P, H * P + GN, dt_col or 0)


def _skip(skip_row):
    return None if skip_row is None else int(skip_row)


def _limit(dt_limit):
    return tuple(float(v) for v in dt_limit)


def state_update_pallas(state: jax.Array, rows: jax.Array, x: jax.Array, dt: jax.Array, A: jax.Array | None,
                        B: jax.Array, C: jax.Array, *, D: jax.Array | None = None, dt_bias: jax.Array | None = None,
                        dt_softplus: bool = True, dt_limit: tuple[float, float] = (0.0, math.inf),
                        A_log: jax.Array | None = None, skip_row: int | None = None, row_offset: int = 0,
                        interpret: bool = False, blocks: UpdateBlocks | None = None) -> tuple[jax.Array, jax.Array]:
    """The Pallas one-token update; same call and results as `state_update_reference`, the pool updated in
    place when the caller donates it."""
    a, is_log = _rates(A, A_log)
    _check_update(state, rows, x, dt, a, B, C, D, dt_bias, (x.shape[0],))
    x, B, C, G, cols = _flat_operands(x, B, C, (x.shape[0],))
    return _update_pallas(state, rows, x, dt, a, B, C, D, dt_bias, G=G, cols=cols, dt_softplus=dt_softplus,
                          dt_limit=_limit(dt_limit), interpret=interpret, blocks=blocks, multi=False,
                          a_is_log=is_log, skip_row=_skip(skip_row),
                          row_offset=check_row_offset("state_update", state, row_offset, rows))


def state_update_multi_pallas(state: jax.Array, rows: jax.Array, x: jax.Array, dt: jax.Array, A: jax.Array | None,
                              B: jax.Array, C: jax.Array, *, D: jax.Array | None = None,
                              dt_bias: jax.Array | None = None, dt_softplus: bool = True,
                              dt_limit: tuple[float, float] = (0.0, math.inf), A_log: jax.Array | None = None,
                              skip_row: int | None = None, row_offset: int = 0, interpret: bool = False,
                              blocks: UpdateBlocks | None = None):
    """The Pallas K-token update; same call and results as `state_update_multi_reference`."""
    a, is_log = _rates(A, A_log)
    _check_update(state, rows, x, dt, a, B, C, D, dt_bias, x.shape[:2])
    x, B, C, G, cols = _flat_operands(x, B, C, x.shape[:2])
    y, state, steps = _update_pallas(state, rows, x, dt, a, B, C, D, dt_bias, G=G, cols=cols,
                                     dt_softplus=dt_softplus, dt_limit=_limit(dt_limit), interpret=interpret,
                                     blocks=blocks, multi=True, a_is_log=is_log, skip_row=_skip(skip_row),
                                     row_offset=check_row_offset("state_update", state, row_offset, rows))
    return y, steps, state


def state_update_xbc_pallas(state: jax.Array, rows: jax.Array, xbc: jax.Array, dt: jax.Array,
                            A: jax.Array | None = None, *, dt_col: int | None = None, D: jax.Array | None = None,
                            dt_bias: jax.Array | None = None, dt_softplus: bool = True,
                            dt_limit: tuple[float, float] = (0.0, math.inf), A_log: jax.Array | None = None,
                            skip_row: int | None = None, row_offset: int = 0, interpret: bool = False,
                            blocks: UpdateBlocks | None = None):
    """The one-token update reading x, B, C (and dt at dt_col) in place; same call and results as
    `state_update_xbc_reference`."""
    a, is_log = _rates(A, A_log)
    _check_packed(state, rows, xbc, dt, a, D, dt_bias, dt_col, (xbc.shape[0],))
    x, B, C, G, cols = _packed_operands(state, xbc, dt_col)
    return _update_pallas(state, rows, x, dt, a, B, C, D, dt_bias, G=G, cols=cols, dt_softplus=dt_softplus,
                          dt_limit=_limit(dt_limit), interpret=interpret, blocks=blocks, multi=False,
                          a_is_log=is_log, skip_row=_skip(skip_row),
                          row_offset=check_row_offset("state_update", state, row_offset, rows))


def state_update_multi_xbc_pallas(state: jax.Array, rows: jax.Array, xbc: jax.Array, dt: jax.Array,
                                  A: jax.Array | None = None, *, dt_col: int | None = None,
                                  D: jax.Array | None = None, dt_bias: jax.Array | None = None,
                                  dt_softplus: bool = True, dt_limit: tuple[float, float] = (0.0, math.inf),
                                  A_log: jax.Array | None = None, skip_row: int | None = None,
                                  row_offset: int = 0, interpret: bool = False,
                                  blocks: UpdateBlocks | None = None):
    """The K-token update reading its operands in place; same call and results as
    `state_update_multi_xbc_reference`."""
    a, is_log = _rates(A, A_log)
    _check_packed(state, rows, xbc, dt, a, D, dt_bias, dt_col, xbc.shape[:2])
    x, B, C, G, cols = _packed_operands(state, xbc, dt_col)
    y, state, steps = _update_pallas(state, rows, x, dt, a, B, C, D, dt_bias, G=G, cols=cols,
                                     dt_softplus=dt_softplus, dt_limit=_limit(dt_limit), interpret=interpret,
                                     blocks=blocks, multi=True, a_is_log=is_log, skip_row=_skip(skip_row),
                                     row_offset=check_row_offset("state_update", state, row_offset, rows))
    return y, steps, state


registry.register("state_update", reference=state_update_reference, pallas=state_update_pallas)
registry.register("state_update_multi", reference=state_update_multi_reference, pallas=state_update_multi_pallas)
registry.register("state_update_xbc", reference=state_update_xbc_reference, pallas=state_update_xbc_pallas)
registry.register("state_update_multi_xbc", reference=state_update_multi_xbc_reference,
                  pallas=state_update_multi_xbc_pallas)
