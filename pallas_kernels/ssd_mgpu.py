"""Mamba-2 SSD chunked scan for prefill, Pallas Mosaic GPU arm (Hopper: wgmma, TMA).

Same call and results as `ssd.ssd_scan_reference` / `ssd.ssd_scan_pallas` (registered as the `mosaic` arm of
`ssd_scan`). One CTA (one warpgroup) per (sequence, head, 64 P-columns) walks the sequence in steps of Q=64
tokens with the state S [64, N] f32 in registers; TMA double-buffers the next step's x, B, C while the current
one computes. Per step (acs = chunk-local cumsum of dt' A, in log2 units, precomputed by XLA with dt'):
    y   = ((C B^T) * exp2(min(acs_i - acs_j, 0)) dt_j)_causal @ x + exp2(min(acs_i, 0)) (C S^T) + D x
    S   = exp2(min(acs_end, 0)) S + (x * exp2(min(acs_end - acs_j, 0)) dt_j)^T @ B
with bf16/f16 operands and f32 accumulation (S goes to the C S^T product in the input dtype, as in the Triton
arm); the two products of each pair are issued together, one wait each; W and (x dt decay)^T are register
operands on the GPU (staged through SMEM in interpret mode, which needs ref operands).

Steps (`step_table`): TMA into tiled SMEM needs 8-aligned GMEM rows, so each step lies in a 64-row box starting
on a multiple of 8; a chunk starting at row r has a first step [r, 8 floor(r/8) + 64), then 64-token steps
(aligned sequences: plain 64-token steps). Box rows outside the step get dt' = 0 (they add nothing) and are not
stored: a partial step stores its y rows with a ladder of power-of-two TMA row stores from an untiled tile. No
step spans two sequences or a chunk_size boundary, so the states at chunk ends are step-end states. The extra CTA
row s == S zeroes y past cu_seqlens[-1] and the unused chunk-state rows. TMA addresses are 64-bit, so offsets
past 2**31 elements are safe. T is padded to a multiple of 8 (a copy) when it is not one.

Calls outside what this kernel covers (inputs not 16-bit, chunk_size not a multiple of 64, P not a multiple of
64, N not 64 or 128) run the Triton arm, which has the same semantics.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import registry
from pallas_kernels.ssd import (HIGHEST, ChunkStates, SsdOutput, check_ssd_args, process_dt, sequences,
                                ssd_scan_pallas)
from pallas_kernels.varlen import chunk_table

Q = 64            # tokens per step (the wgmma M tile of one warpgroup)
BP = 64           # P columns per CTA
STAGES = 2
LOG2E = math.log2(math.e)
WGMMA = plgpu.Layout.WGMMA
ROWS = plgpu.Layout.WGMMA.reduce(1)   # one value per row of a WGMMA tile
COLS = plgpu.Layout.WGMMA.reduce(0)   # one value per column
F32 = jnp.float32
MOSAIC_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def mosaic_supports(x_dtype, B_dtype, C_dtype, P: int, N: int, chunk_size: int) -> bool:
    """Whether the Mosaic kernel takes this call (else the Triton arm runs it)."""
    dts = {jnp.dtype(x_dtype), jnp.dtype(B_dtype), jnp.dtype(C_dtype)}
    return len(dts) == 1 and dts.pop() in MOSAIC_DTYPES and P % BP == 0 and N in (64, 128) and chunk_size % Q == 0


def _smem(shape, dtype):
    """SMEM tile tiled and swizzled for TMA and wgmma (minor dim = last dim)."""
    dtype = jnp.dtype(dtype)
    swizzle = plgpu.find_swizzle(shape[-1] * dtype.itemsize * 8)
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // dtype.itemsize)),
                                                plgpu.SwizzleTransform(swizzle)))


def _mm2(a1, b1, shape1, a2, b2, shape2, inits=None):
    """(init1 +) a1 @ b1 and (init2 +) a2 @ b2 on the tensor cores, issued back to back with one wait.

    inits: accumulate into the initial values in the accumulators (GPU), or None. Interpret mode takes no
    initialised accumulators (run_state), so there the caller adds them. The optimization barrier keeps users
    of the results after the wgmma wait.
    """
    if inits is None:
        def scoped(acc1, acc2):
            plgpu.wgmma(acc1, a1, b1)
            plgpu.wgmma(acc2, a2, b2)
            return acc1[...], acc2[...]
        out = pl.run_scoped(scoped, plgpu.ACC(shape1, F32), plgpu.ACC(shape2, F32))
    else:
        def body(refs):
            plgpu.wgmma(refs[0], a1, b1)
            plgpu.wgmma(refs[1], a2, b2)
        out = pl.run_state(body)((plgpu.ACC.init(inits[0]), plgpu.ACC.init(inits[1])))
    return lax.optimization_barrier(tuple(out))


def _bcast_rows(v, shape):
    return lax.broadcast_in_dim(v, shape, [0])


def _bcast_cols(v, shape):
    return lax.broadcast_in_dim(v, shape, [1])


def _store_rows(src, dst, lo, hi):
    """TMA-store rows [lo, hi) (0 <= lo <= hi <= Q, dynamic) of the untiled [Q, BP] tile src to dst(row0, rows),
    as a ladder of power-of-two row blocks: nothing outside the range is written."""
    off = lo
    size = Q
    while size:
        @pl.when((hi - lo) & size != 0)
        def _(off=off, size=size):
            plgpu.copy_smem_to_gmem(src.at[pl.ds(off, size)], dst(off, size))
        off = off + ((hi - lo) & size)
        size //= 2


def _kernel(meta_ref, steps_ref, d_ref, acs_ref, dtc_ref, x_ref, b_ref, c_ref, *rest, S, T, NCU, rep, N,
            chunk_size, has_D, has_init, want_chunks, dtype, a_regs):
    rest = list(rest)
    h0_ref = rest.pop(0) if has_init else None
    y_ref, final_ref = rest.pop(0), rest.pop(0)
    cs_ref = rest.pop(0) if want_chunks else None
    (x_s, b_s, c_s, a_s, ar_s, d_s, s16, y_st, y_rag, st32, in_bar, st_bar, *a_bufs) = rest
    s, h, v = lax.axis_index("s"), lax.axis_index("h"), lax.axis_index("v")
    v0 = v * BP
    g = lax.div(h, rep)
    sq = (Q, Q)
    y_rows = lambda r0: (lambda off, size: y_ref.at[pl.ds(r0 + off, size), h, pl.ds(v0, BP)])
    box_of = lambda lo: pl.multiple_of(lax.div(lo, 8) * 8, 8)     # TMA rows of tiled SMEM start 8-aligned

    @pl.when(s < S)
    def _sequence():
        start, end = meta_ref[0, s], meta_ref[0, s + 1]
        g0 = meta_ref[1, s]
        steps = meta_ref[1, s + 1] - g0
        u0 = meta_ref[2, s]

        def issue(n, slot):
            rows = pl.ds(box_of(steps_ref[0, g0 + n]), Q)
            bar = in_bar.at[slot]
            plgpu.copy_gmem_to_smem(x_ref.at[rows, h, pl.ds(v0, BP)], x_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(b_ref.at[rows, g], b_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(c_ref.at[rows, g], c_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(acs_ref.at[h, pl.ds((g0 + n) * Q, Q)], a_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(acs_ref.at[h, pl.ds((g0 + n) * Q, Q)], ar_s.at[slot], bar)
            plgpu.copy_gmem_to_smem(dtc_ref.at[h, pl.ds((g0 + n) * Q, Q)], d_s.at[slot], bar)

        @pl.when(steps > 0)
        def _():
            issue(0, 0)

        if has_init:
            plgpu.copy_gmem_to_smem(h0_ref.at[s, h, pl.ds(v0, BP)], st32, st_bar)
            plgpu.barrier_wait(st_bar)
            state0 = plgpu.load(st32, layout=WGMMA)
        else:
            state0 = plgpu.layout_cast(jnp.zeros((BP, N), F32), WGMMA)

        def step(n, state):
            slot = lax.rem(n, STAGES)
            half = lax.rem(n, 2)
            plgpu.barrier_wait(in_bar.at[slot])

            @pl.when(n + 1 < steps)
            def _prefetch():
                plgpu.commit_smem()
                issue(n + 1, 1 - slot)

            s16[...] = state.astype(dtype)
            plgpu.commit_smem()
            cb, cs = _mm2(c_s.at[slot], b_s.at[slot].T, sq, c_s.at[slot], s16.T, (Q, BP))
            causal = (plgpu.broadcasted_iota(jnp.int32, sq, 0, layout=WGMMA)
                      >= plgpu.broadcasted_iota(jnp.int32, sq, 1, layout=WGMMA))
            a_row = plgpu.load(ar_s.at[slot], layout=ROWS)   # a second copy: one SMEM ref, one layout
            a_col = plgpu.load(a_s.at[slot], layout=COLS)
            d_col = plgpu.load(d_s.at[slot], layout=COLS)
            expo = jnp.where(causal, jnp.minimum(_bcast_rows(a_row, sq) - _bcast_cols(a_col, sq), 0.0), -jnp.inf)
            w = (cb * jnp.exp2(expo) * _bcast_cols(d_col, sq)).astype(dtype)
            y0 = cs * _bcast_rows(jnp.exp2(jnp.minimum(a_row, 0.0)), (Q, BP))
            if has_D:
                y0 = y0 + d_ref[h] * plgpu.load(x_s.at[slot], layout=WGMMA).astype(F32)
            a_end = a_s[slot, Q - 1]
            x_t = plgpu.load(x_s.at[slot].T, layout=WGMMA).astype(F32)             # [BP, Q]
            k_decay = jnp.exp2(jnp.minimum(a_end - a_col, 0.0)) * d_col
            xw = (x_t * _bcast_cols(k_decay, (BP, Q))).astype(dtype)
            s0 = state * jnp.exp2(jnp.minimum(a_end, 0.0))
            # y = y0 + W x and S = s0 + xw B, issued together
            if a_regs:
                y, state = _mm2(w, x_s.at[slot], (Q, BP), xw, b_s.at[slot], (BP, N), inits=(y0, s0))
            else:
                w_s, xw_s = a_bufs
                w_s[...] = w
                xw_s[...] = xw
                plgpu.commit_smem()
                y, state = _mm2(w_s, x_s.at[slot], (Q, BP), xw_s, b_s.at[slot], (BP, N))
                y, state = y + y0, state + s0
            y = y.astype(y_ref.dtype)

            lo, hi = steps_ref[0, g0 + n], steps_ref[1, g0 + n]
            box = box_of(lo)
            whole = (lo == box) & (hi == jnp.minimum(box + Q, T))   # the step covers its whole TMA box
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)

            @pl.when(whole)
            def _full():                    # TMA clips rows past T
                y_st.at[half][...] = y
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(y_st.at[half], y_ref.at[pl.ds(box, Q), h, pl.ds(v0, BP)])

            @pl.when(jnp.logical_not(whole))
            def _part():                    # only the step's rows: the others belong to other steps
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                y_rag[...] = y
                plgpu.commit_smem()
                _store_rows(y_rag, y_rows(box), lo - box, hi - box)

            if want_chunks:
                @pl.when(((hi - start) % chunk_size == 0) | (hi == end))
                def _chunk_state():
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                    st32[...] = state
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(st32, cs_ref.at[u0 + (hi - start - 1) // chunk_size, h, pl.ds(v0, BP)])
            return state

        state = lax.fori_loop(0, steps, step, state0)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        st32[...] = state
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(st32, final_ref.at[s, h, pl.ds(v0, BP)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(s == S)
    def _tail():                            # zero y past cu_seqlens[-1] and the unused chunk-state rows
        first = meta_ref[0, S]
        zeros = plgpu.layout_cast(jnp.zeros((Q, BP), y_ref.dtype), WGMMA)
        y_st.at[0][...] = zeros
        y_rag[...] = zeros
        plgpu.commit_smem()
        box = box_of(first)

        @pl.when(first < T)
        def _():
            _store_rows(y_rag, y_rows(box), first - box, jnp.minimum(T - box, Q))

        @pl.loop(0, (T - box + Q - 1) // Q - 1)
        def _(i):
            plgpu.copy_smem_to_gmem(y_st.at[0], y_ref.at[pl.ds(box + (i + 1) * Q, Q), h, pl.ds(v0, BP)])

        if want_chunks:
            st32[...] = plgpu.layout_cast(jnp.zeros((BP, N), F32), WGMMA)
            plgpu.commit_smem()

            @pl.loop(meta_ref[2, S], NCU)
            def _(r):
                plgpu.copy_smem_to_gmem(st32, cs_ref.at[r, h, pl.ds(v0, BP)])

        plgpu.wait_smem_to_gmem(0)


def step_table(T: int, cu: jax.Array, chunk_size: int):
    """Steps of at most Q tokens, none spanning a chunk_size boundary of its sequence, each inside one Q-row TMA
    box that starts on a multiple of 8 rows (tiled SMEM needs it): a chunk starting at row r has steps
    [r, 8 floor(r / 8) + Q), then Q-token steps.  Returns (lo [NST], hi [NST], step_cu [S+1], utab)."""
    utab = chunk_table(T, cu, chunk_size)
    K = chunk_size // Q + 1
    lo0 = utab.start[:, None]
    base = lo0 - lo0 % 8
    k = jnp.arange(K, dtype=jnp.int32)[None, :]
    lo = jnp.where(k == 0, lo0, base + Q * k)                                   # [NCU, K]
    hi = jnp.minimum(base + Q * (k + 1), lo0 + utab.length[:, None])
    valid = (lo < hi) & (utab.length[:, None] > 0)
    NST = lo.size
    pos = jnp.where(valid, jnp.cumsum(valid.reshape(-1)).reshape(valid.shape) - 1, NST)
    put = lambda a: jnp.zeros((NST,), jnp.int32).at[pos.reshape(-1)].set(a.reshape(-1), mode="drop")
    per_chunk = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(valid.sum(1)).astype(jnp.int32)])
    return put(lo), put(hi), per_chunk[utab.chunk_cu], utab


def ssd_scan_mosaic(x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array, *, chunk_size: int,
                    D: jax.Array | None = None, dt_bias: jax.Array | None = None, dt_softplus: bool = True,
                    dt_limit: tuple[float, float] = (0.0, math.inf), initial_states: jax.Array | None = None,
                    cu_seqlens: jax.Array | None = None, return_chunk_states: bool = False, precision=HIGHEST,
                    interpret=False, blocks=None, a_regs: bool | None = None) -> SsdOutput:
    """The Mosaic GPU scan; same call and results as `ssd_scan_reference`.  Calls it does not cover (see
    `mosaic_supports`) run the Triton arm (`blocks` is passed there).  a_regs: the left operands of the y and
    state products from registers (default on the GPU) instead of staged through SMEM (interpret mode)."""
    T, H, P, G, N = check_ssd_args(x, dt, A, B, C, D, dt_bias)
    if not mosaic_supports(x.dtype, B.dtype, C.dtype, P, N, chunk_size):
        return ssd_scan_pallas(x, dt, A, B, C, chunk_size=chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
                               dt_limit=dt_limit, initial_states=initial_states, cu_seqlens=cu_seqlens,
                               return_chunk_states=return_chunk_states, precision=precision, interpret=bool(interpret),
                               blocks=blocks)
    return _ssd_scan_mosaic(x, dt, A, B, C, D, dt_bias, initial_states, cu_seqlens, chunk_size=chunk_size,
                            dt_softplus=dt_softplus, dt_limit=tuple(float(v) for v in dt_limit),
                            return_chunk_states=return_chunk_states,
                            interpret=interpret if isinstance(interpret, plgpu.InterpretGPUParams) else bool(interpret),
                            a_regs=(not interpret) if a_regs is None else bool(a_regs))


@functools.partial(jax.jit, static_argnames=("chunk_size", "dt_softplus", "dt_limit", "return_chunk_states",
                                             "interpret", "a_regs"))
def _ssd_scan_mosaic(x, dt, A, B, C, D, dt_bias, initial_states, cu_seqlens, *, chunk_size, dt_softplus, dt_limit,
                     return_chunk_states, interpret, a_regs):
    T0, H, P, G, N, cu, S = sequences(x, B, cu_seqlens, initial_states)
    T = -(-T0 // 8) * 8                    # TMA views of tiled SMEM need the token count a multiple of 8
    if T != T0:
        pad = lambda a: jnp.pad(a, [(0, T - T0)] + [(0, 0)] * (a.ndim - 1))
        x, dt, B, C = pad(x), pad(dt), pad(B), pad(C)
    # dt' and the step-local cumsum of dt' A (log2 units) over each step's TMA box, head-major [H, NST * Q] f32:
    # a gather of 64-token runs from dt'^T and the cumsum as a product with a triangular matrix (f32, HIGHEST)
    lo, hi, step_cu, utab = step_table(T, cu, chunk_size)
    NST, NCU = lo.shape[0], utab.start.shape[0]
    rows = (lo - lo % 8)[:, None] + jnp.arange(Q, dtype=jnp.int32)[None, :]          # [NST, Q]
    mask = (rows >= lo[:, None]) & (rows < hi[:, None])
    dtp = process_dt(dt, dt_bias, dt_softplus, dt_limit).T                           # [H, T]
    dtc = jnp.where(mask[None], dtp[:, jnp.clip(rows, 0, T - 1)], 0.0)               # [H, NST, Q]
    tri = (jnp.arange(Q)[:, None] <= jnp.arange(Q)[None, :]).astype(F32)             # [Q, Q] upper
    acs = jnp.einsum("hsq,qk->hsk", dtc * (A.astype(F32) * LOG2E)[:, None, None], tri,
                     precision=HIGHEST).reshape(H, NST * Q)
    dtc = dtc.reshape(H, NST * Q)
    meta = jnp.stack([cu, step_cu, utab.chunk_cu]).astype(jnp.int32)               # [3, S + 1]

    out_type = [jax.ShapeDtypeStruct((T, H, P), x.dtype), jax.ShapeDtypeStruct((S, H, P, N), F32)]
    if return_chunk_states:
        out_type.append(jax.ShapeDtypeStruct((NCU, H, P, N), F32))
    dtype = x.dtype
    scratch = [
        _smem((STAGES, Q, BP), dtype), _smem((STAGES, Q, N), dtype), _smem((STAGES, Q, N), dtype),
        plgpu.SMEM((STAGES, Q), F32), plgpu.SMEM((STAGES, Q), F32), plgpu.SMEM((STAGES, Q), F32),
        _smem((BP, N), dtype),                   # S in the input dtype for C S^T
        _smem((2, Q, BP), dtype),                # y staging (double-buffered TMA stores)
        plgpu.SMEM((Q, BP), dtype),              # y staging of a partial step (untiled: any row offset)
        plgpu.SMEM((BP, N), F32),                # f32 state staging (initial, chunk, final states)
        plgpu.Barrier(num_arrivals=6, num_barriers=STAGES), plgpu.Barrier(),
    ]
    if not a_regs:
        scratch += [_smem((Q, Q), dtype), _smem((BP, Q), dtype)]
    kernel = functools.partial(
        _kernel, S=S, T=T, NCU=NCU, rep=H // G, N=N, chunk_size=chunk_size, has_D=D is not None,
        has_init=initial_states is not None, want_chunks=return_chunk_states, dtype=dtype,
        a_regs=a_regs)
    args = [meta, jnp.stack([lo, hi]), (jnp.zeros((H,), F32) if D is None else D.astype(F32)), acs, dtc, x, B, C]
    if initial_states is not None:
        args.append(initial_states.astype(F32))
    outs = plgpu.kernel(
        kernel, out_type=out_type, scratch_types=scratch, grid=(S + 1, H, P // BP), grid_names=("s", "h", "v"),
        compiler_params=plgpu.CompilerParams(approx_math=True), kernel_name="ssd_scan_mgpu",
        interpret=(interpret if isinstance(interpret, plgpu.InterpretGPUParams)
                   else plgpu.InterpretGPUParams() if interpret else None),
    )(*args)
    chunks = None
    if return_chunk_states:
        chunks = ChunkStates(states=outs[2], seq=utab.seq, end_pos=utab.end_pos, valid=utab.length > 0)
    return SsdOutput(y=outs[0][:T0], final_states=outs[1], chunk_states=chunks)


# gpu_default: 1.9-2.2x faster than the Triton arm at every benchmark shape (benchmarks/notes/ssd_scan.md, call 3)
registry.register("ssd_scan", mosaic=ssd_scan_mosaic, gpu_default="mosaic")
