"""Mamba-2 decode, the mixer's recurrent part in one kernel: causal conv update + SiLU + SSM state update.

A decode step's Mamba layer otherwise runs two kernels between in_proj and the gated norm: the conv update
(`causal_conv1d_update`, which writes the conv output xbc) and the state update (`state_update_xbc`, which reads
it). Here one program per (P-block, head, batch row) reads the in_proj output in place, convolves its own head's
x channels and its group's B and C channels, advances its [BP, N] state tile and writes y: one launch, and no xbc
round trip through memory. The arithmetic is the two kernels' own (`conv1d.conv_token`, `state_update.advance`),
with the conv output rounded to the in_proj dtype as xbc is stored, so the results are bitwise theirs.

The conv windows: each x channel belongs to one program, which writes its new window. A group's B and C channels
are read by every program of the group (heads of the group x P-blocks), so none of them may overwrite the window
before all have read it: each program counts itself in on a per-(row, group) counter (an atomic add after a CTA
barrier) once it has read the windows, and the last one in writes the new B and C windows. The counters are a
zeroed [batch, groups] int32 operand per call.

Shapes: conv pool [R, C, K-1] with C = H*P + 2*G*N, SSM pool [R, H, P, N] (R = layers * slots, flattened), slots
[Bt] (pool row = slot + row_offset), zxbcdt [Bt, W] holding the conv input at columns [x_col, x_col + C) and dt at
[dt_col, dt_col + H). skip_row: a pool row (the padding slot's) neither read nor written, its batch rows run from
zeros (as in the two kernels). The multi-token (verify) step keeps the two kernels.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import registry
from pallas_kernels.conv1d import _check_update as _check_conv, _checked, causal_conv1d_update_reference
from pallas_kernels.conv1d import conv_token, load_conv_taps
from pallas_kernels.errors import ShapeError
from pallas_kernels.state_update import (UpdateBlocks, _check_packed, _limit, _rates, _skip, advance,
                                         default_update_blocks, head_dt, state_update_xbc_reference)
from pallas_kernels.triton_util import check_row_offset, compiler_params, next_pow2


def mixer_update_reference(conv_pool: jax.Array, ssm_pool: jax.Array, slots: jax.Array, zxbcdt: jax.Array,
                           conv_weight: jax.Array, conv_bias: jax.Array | None = None, *, x_col: int, dt_col: int,
                           A: jax.Array | None = None, A_log: jax.Array | None = None, D: jax.Array | None = None,
                           dt_bias: jax.Array | None = None, dt_softplus: bool = True,
                           dt_limit: tuple[float, float] = (0.0, math.inf), activation: str | None = "silu",
                           skip_row: int | None = None, row_offset: int = 0):
    """The two kernels' references in turn.  Returns (y [Bt, H, P] in zxbcdt.dtype, conv pool, SSM pool)."""
    at = dict(skip_row=skip_row, row_offset=row_offset)
    xbc, conv_pool = causal_conv1d_update_reference(conv_pool, slots, zxbcdt, conv_weight, conv_bias,
                                                    activation=activation, x_col=x_col, **at)
    y, ssm_pool = state_update_xbc_reference(ssm_pool, slots, xbc, zxbcdt, A, dt_col=dt_col, D=D, dt_bias=dt_bias,
                                             dt_softplus=dt_softplus, dt_limit=dt_limit, A_log=A_log, **at)
    return y, conv_pool, ssm_pool


def _mixer_kernel(slots_ref, A_ref, D_ref, dtb_ref, zx_ref, w_ref, cb_ref, conv_in_ref, ssm_in_ref, count_in_ref,
                  y_ref, conv_ref, ssm_ref, count_ref, *, P, N, K, rep, BP, Np, HP, GN, x_col, dt_col, has_D,
                  has_dt_bias, has_conv_bias, softplus_dt, clamp, activation, a_is_log, skip_row, row_offset, last,
                  barrier):
    del conv_in_ref, ssm_in_ref, count_in_ref  # aliased to the outputs
    pb, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    f32 = jnp.float32
    r, g = slots_ref[b] + row_offset, h // rep
    live = True if skip_row is None else r != skip_row                  # skip_row: no pool traffic
    pc = pb * BP + jnp.arange(BP)
    n = jnp.arange(Np)
    pm, nm = pc < P, n < N
    taps = functools.partial(load_conv_taps, conv_ref, w_ref, cb_ref, r, K=K, has_bias=has_conv_bias)

    def conv(ch, mask):
        """(the conv output of channels ch as xbc holds it, in float32; their new windows)."""
        window, w, bias = taps(ch, mask, mask & live)
        x = plgpu.load(zx_ref.at[b, x_col + ch], mask=mask, other=0.0)
        out, window = conv_token(window, w, bias, x, activation, conv_ref.dtype)
        return out.astype(zx_ref.dtype).astype(f32), window

    x_ch = h * P + pc                                                   # this program's own x channels
    x, x_window = conv(x_ch, pm)
    for k in range(K - 1):
        plgpu.store(conv_ref.at[r, x_ch, k], x_window[k], mask=pm & live)
    b_ch, c_ch = HP + g * N + n, HP + GN + g * N + n                    # the group's B and C channels
    Bv, b_window = conv(b_ch, nm)
    Cv, c_window = conv(c_ch, nm)

    a = A_ref[h].astype(f32)
    if a_is_log:
        a = -jnp.exp(a)
    tile = (pm[:, None] & nm[None, :]) & live
    state = plgpu.load(ssm_ref.at[r, h, pc[:, None], n[None, :]], mask=tile, other=0.0).astype(f32)
    dt = head_dt(zx_ref[b, dt_col + h], dtb_ref[h] if has_dt_bias else None, softplus_dt, clamp)
    state, y = advance(state, x, dt, a, Bv, Cv, D_ref[h] if has_D else None, ssm_ref.dtype)
    plgpu.store(y_ref.at[b, h, pc], y.astype(y_ref.dtype), mask=pm)
    plgpu.store(ssm_ref.at[r, h, pc[:, None], n[None, :]], state.astype(ssm_ref.dtype), mask=tile)

    if barrier:                                          # every thread of the CTA is past its window loads
        plgpu.debug_barrier()                            # (interpret mode runs programs one after another)
    arrived = plgpu.atomic_add(count_ref, (b, g), jnp.int32(1))

    @pl.when(arrived == last)                            # the group's last reader writes its B / C windows
    def _():
        for k in range(K - 1):
            plgpu.store(conv_ref.at[r, b_ch, k], b_window[k], mask=nm & live)
            plgpu.store(conv_ref.at[r, c_ch, k], c_window[k], mask=nm & live)


@functools.partial(jax.jit, static_argnames=("x_col", "dt_col", "dt_softplus", "dt_limit", "activation", "a_is_log",
                                             "skip_row", "row_offset", "interpret", "blocks"))
def _mixer_pallas(conv_pool, ssm_pool, slots, zxbcdt, conv_weight, conv_bias, A, D, dt_bias, *, x_col, dt_col,
                  dt_softplus, dt_limit, activation, a_is_log, skip_row, row_offset, interpret, blocks):
    _, H, P, N = ssm_pool.shape
    C, K = conv_weight.shape
    GN = (C - H * P) // 2
    G = GN // N
    Bt = zxbcdt.shape[0]
    blk = blocks or default_update_blocks(P, N)
    BP = blk.block_p
    lo, hi = dt_limit
    one = jnp.zeros((1,), jnp.float32)
    kernel = functools.partial(
        _mixer_kernel, P=P, N=N, K=K, rep=H // G, BP=BP, Np=next_pow2(N), HP=H * P, GN=GN, x_col=x_col,
        dt_col=dt_col, has_D=D is not None, has_dt_bias=dt_bias is not None, has_conv_bias=conv_bias is not None,
        softplus_dt=dt_softplus, clamp=(lo, hi) if lo > 0.0 or not math.isinf(hi) else None, activation=activation,
        a_is_log=a_is_log, skip_row=skip_row, row_offset=row_offset, last=H // G * pl.cdiv(P, BP) - 1,
        barrier=not interpret)
    out_shape = [jax.ShapeDtypeStruct((Bt, H, P), zxbcdt.dtype),
                 jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype),
                 jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype),
                 jax.ShapeDtypeStruct((Bt, G), jnp.int32)]
    y, conv_pool, ssm_pool, _ = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(pl.cdiv(P, BP), H, Bt), input_output_aliases={7: 1, 8: 2, 9: 3},
        compiler_params=compiler_params(blk.num_warps, 1), interpret=interpret, name="mamba_mixer_update",
    )(slots.astype(jnp.int32), A, one if D is None else D, one if dt_bias is None else dt_bias, zxbcdt, conv_weight,
      jnp.zeros((1,), conv_weight.dtype) if conv_bias is None else conv_bias, conv_pool, ssm_pool,
      jnp.zeros((Bt, G), jnp.int32))
    return y, conv_pool, ssm_pool


def mixer_update_pallas(conv_pool: jax.Array, ssm_pool: jax.Array, slots: jax.Array, zxbcdt: jax.Array,
                        conv_weight: jax.Array, conv_bias: jax.Array | None = None, *, x_col: int, dt_col: int,
                        A: jax.Array | None = None, A_log: jax.Array | None = None, D: jax.Array | None = None,
                        dt_bias: jax.Array | None = None, dt_softplus: bool = True,
                        dt_limit: tuple[float, float] = (0.0, math.inf), activation: str | None = "silu",
                        skip_row: int | None = None, row_offset: int = 0, interpret: bool = False,
                        blocks: UpdateBlocks | None = None):
    """The fused decode step; same call and results as `mixer_update_reference` (both pools updated in place when
    the caller donates them)."""
    a, is_log = _rates(A, A_log)
    _check_conv("mixer_update", conv_pool, slots, zxbcdt, conv_weight, conv_bias, (None,), x_col, row_offset)
    xbc = jax.ShapeDtypeStruct((zxbcdt.shape[0], conv_weight.shape[0]), zxbcdt.dtype)
    _check_packed(ssm_pool, slots, xbc, zxbcdt, a, D, dt_bias, dt_col, (zxbcdt.shape[0],))
    if conv_pool.shape[0] != ssm_pool.shape[0]:
        raise ShapeError(f"mixer_update: conv pool and SSM pool expected the same rows, got {conv_pool.shape[0]} "
                           f"and {ssm_pool.shape[0]}")
    return _mixer_pallas(conv_pool, ssm_pool, slots, zxbcdt, conv_weight, conv_bias, a, D, dt_bias, x_col=int(x_col),
                         dt_col=int(dt_col), dt_softplus=dt_softplus, dt_limit=_limit(dt_limit),
                         activation=_checked(activation), a_is_log=is_log, skip_row=_skip(skip_row),
                         row_offset=check_row_offset("mixer_update", conv_pool, row_offset), interpret=interpret,
                         blocks=blocks)


registry.register("mixer_update", reference=mixer_update_reference, pallas=mixer_update_pallas)
