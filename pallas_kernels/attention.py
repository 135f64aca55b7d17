"""Causal GQA attention (softmax in float32) and decode attention over the key/value pool in place.

`attend` is the model's attention for every phase (jnp). `decode_attention` is one query token per sequence against
its slot's keys and values in the pool [layers, slots, max_len, KVH, hd]: the jnp reference gathers each row's
whole slot (max_len positions) and masks; the Pallas kernel's program (row, kv head, piece of the slot) streams
blocks of the positions the row holds, [0, limit), with an online softmax in float32 (the pieces' partial softmaxes
combined after), so a step reads what the sequences hold, not max_len. Positions at and past a row's limit are
never read (the tests poison them with NaN). With `new_kv` (a decode step's own keys and values) the kernel also
appends them: the program that holds position limit - 1 writes them into the pool (aliased, in place) and
attends to them from registers, so no scatter runs before it. The new keys / values may come as their
projections' split-K partials (split_partials.py): the kernel sums them in split order and rounds them to the
pools' dtype, where an XLA sum would run before it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import registry
from pallas_kernels.errors import ShapeError
from pallas_kernels.split_partials import SplitPartials, chain_sum, check_partials, load_sum
from pallas_kernels.triton_util import compiler_params, next_pow2

NEG = float(jnp.finfo(jnp.float32).min)
# queries attended at once: the scores of a block are [B, KVH, G, QUERY_BLOCK, Tk] float32, so a long prefill
# needs memory linear in its length, not quadratic (each query's softmax still spans all its keys)
QUERY_BLOCK = 512


def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, limit: jax.Array,
           scale: float) -> jax.Array:
    """Masked GQA attention, softmax in float32.

    q [B, Tq, KVH, G, hd], k/v [B, Tk, KVH, hd], q_pos [B, Tq], k_pos [Tk]; a key is visible to a query
    when k_pos <= q_pos and k_pos < limit[b].  Returns [B, Tq, KVH, G, hd] float32. More than QUERY_BLOCK
    queries are taken a block at a time.
    """
    Tq = q.shape[1]
    if Tq <= QUERY_BLOCK:
        return _attend_block(q, k, v, q_pos, k_pos, limit, scale)
    n = -(-Tq // QUERY_BLOCK)
    pad = n * QUERY_BLOCK - Tq
    qb = jnp.pad(q, ((0, 0), (0, pad)) + ((0, 0),) * 3)
    pb = jnp.pad(q_pos, ((0, 0), (0, pad)))
    blocks = lambda x: jnp.moveaxis(x.reshape(x.shape[0], n, QUERY_BLOCK, *x.shape[2:]), 1, 0)
    out = jax.lax.map(lambda a: _attend_block(a[0], k, v, a[1], k_pos, limit, scale), (blocks(qb), blocks(pb)))
    return jnp.moveaxis(out, 0, 1).reshape(q.shape[0], n * QUERY_BLOCK, *out.shape[3:])[:, :Tq]


def _attend_block(q, k, v, q_pos, k_pos, limit, scale):
    s = jnp.einsum("bqkgd,bskd->bkgqs", q.astype(k.dtype), k, preferred_element_type=jnp.float32) * scale
    visible = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < limit[:, None, None])
    s = jnp.where(visible[:, None, None], s, NEG)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bkgqs,bskd->bqkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)


def _check(q, k_pool, v_pool, slots, limit, layer, out_dtype=jnp.float32, new_kv=None):
    """q [B, KVH, G, hd]; new_kv (keys, values), each [B, KVH, hd] in the pools' dtype or k_proj's / v_proj's split
    partials [S, R >= B, KVH * hd]."""
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise ShapeError(f"decode_attention: out_dtype expected a floating dtype, got {jnp.dtype(out_dtype)}")
    if q.ndim != 4 or k_pool.ndim != 5 or k_pool.shape != v_pool.shape:
        raise ShapeError(f"decode_attention: expected q [B, KVH, G, hd] and k_pool / v_pool [layers, slots, max_len, "
                         f"KVH, hd] of one shape, got q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}, v_pool "
                         f"{tuple(v_pool.shape)}")
    B, KVH, _, hd = q.shape
    if k_pool.shape[3:] != (KVH, hd) or slots.shape != (B,) or limit.shape != (B,):
        raise ShapeError(f"decode_attention: q {tuple(q.shape)} needs pools [..., {KVH}, {hd}] and slots / limit "
                         f"[{B}], got pools {tuple(k_pool.shape)}, slots {tuple(slots.shape)}, limit "
                         f"{tuple(limit.shape)}")
    if not 0 <= layer < k_pool.shape[0]:
        raise ShapeError(f"decode_attention: layer {layer} is not in the pool's {k_pool.shape[0]} layers")
    if new_kv is not None:
        if len(new_kv) != 2 or any(not isinstance(a, SplitPartials) and (
                getattr(a, "shape", None) != (B, KVH, hd) or a.dtype != k_pool.dtype) for a in new_kv):
            got = [_described(a) for a in new_kv]
            raise ShapeError(f"decode_attention: new_kv expected (keys, values) [{B}, {KVH}, {hd}] in the pool's "
                             f"{k_pool.dtype} (or split partials), got {got}")
        for name, a in zip(("keys", "values"), new_kv):
            if isinstance(a, SplitPartials):
                check_partials("decode_attention", f"new_kv {name}", a, B, KVH * hd)


def _described(a) -> str:
    if isinstance(a, SplitPartials):
        return f"split partials {a.values.dtype} {tuple(a.values.shape)}"
    return f"{tuple(getattr(a, 'shape', ()))} {getattr(a, 'dtype', type(a).__name__)}"


def append_kv(k_pool, v_pool, slots, limit, layer, new_kv):
    """The pools with each row's new key and value at position limit - 1 of its slot in `layer` (none where that
    position is outside the pool)."""
    L = k_pool.shape[2]
    wpos = jnp.where((limit >= 1) & (limit <= L), limit - 1, L)                # L: dropped
    k_new, v_new = new_kv
    return (k_pool.at[layer, slots, wpos].set(k_new, mode="drop"),
            v_pool.at[layer, slots, wpos].set(v_new, mode="drop"))


def decode_attention_reference(q, k_pool, v_pool, slots, limit, *, layer: int, scale: float,
                               out_dtype=jnp.float32, new_kv=None):
    """q [B, KVH, G, hd] (one token per row); k_pool / v_pool [layers, S, L, KVH, hd]; slots, limit int32 [B]: row
    b attends to positions [0, limit[b]) of slot slots[b] in `layer`. -> [B, KVH, G, hd] in out_dtype (`attend`'s
    float32 numbers for a query at position limit - 1, rounded once). new_kv: (keys, values) [B, KVH, hd] in the
    pools' dtype, written at position limit - 1 first (`append_kv`); then -> (output, k_pool, v_pool). new_kv may be
    k_proj's / v_proj's split partials: summed in split order and rounded to the pools' dtype first."""
    _check(q, k_pool, v_pool, slots, limit, layer, out_dtype, new_kv)
    if new_kv is not None:
        new_kv = tuple(chain_sum(a, q.shape[0]).astype(k_pool.dtype).reshape(q.shape[0], *k_pool.shape[3:])
                       if isinstance(a, SplitPartials) else a for a in new_kv)
        k_pool, v_pool = append_kv(k_pool, v_pool, slots, limit, layer, new_kv)
    L = k_pool.shape[2]
    pos = (limit - 1)[:, None]                                                  # [B, 1]
    out = attend(q[:, None], k_pool[layer, slots], v_pool[layer, slots], pos, jnp.arange(L, dtype=jnp.int32),
                 limit, scale)[:, 0].astype(out_dtype)
    return out if new_kv is None else (out, k_pool, v_pool)


MMA_ROWS = 16                                      # the smallest M (and N) of a Triton dot


@dataclasses.dataclass(frozen=True)
class DecodeAttentionConfig:
    """block_k: positions per loop step; the two products per step ([G, hd] x [hd, block_k] and back) run on the
    tensor cores with the query heads of a kv head padded to 16 rows. split_positions: a row's slot is cut into
    pieces of this many positions, one program each, whose partial softmaxes are then combined (flash-decoding),
    so that a few long rows still fill the GPU; the pieces depend on the pool's max_len only, never on the batch,
    so a row's result does not depend on the rows beside it. None: one program per (row, kv head)."""

    block_k: int = 64
    num_warps: int = 4
    split_positions: int | None = 512

    def __post_init__(self):
        if self.block_k < MMA_ROWS or self.block_k & (self.block_k - 1):
            raise ShapeError(f"DecodeAttentionConfig: block_k must be a power of two >= {MMA_ROWS}, got "
                             f"{self.block_k}")
        if self.split_positions is not None and (self.split_positions <= 0 or self.split_positions % self.block_k):
            raise ShapeError(f"DecodeAttentionConfig: split_positions must be a positive multiple of block_k "
                             f"{self.block_k} (or None), got {self.split_positions}")

    def pieces(self, max_len: int) -> int:
        """Programs per (row, kv head) for a pool of max_len positions."""
        return 1 if self.split_positions is None else max(1, -(-max_len // self.split_positions))


CONFIG = DecodeAttentionConfig()


def _dot(a, b, b_contract: int, precision):
    """a [M, K] times b ([N, K] if b_contract == 1, else [K, N]) -> [M, N] float32."""
    return jax.lax.dot_general(a, b, (((1,), (b_contract,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _decode_kernel(slots_ref, limit_ref, q_ref, *refs, layer, S, L, G, BG, hd, BD, BK, piece, scale, append,
                   kv_parts):
    """Program (row b, kv head h, piece s) over positions [s * piece, (s + 1) * piece) of the row's held [0, n).
    One piece: the normalised output [B, KVH, G, hd]; several: the piece's unnormalised sum, max and total.
    append: refs start with the new keys / values [B, KVH, hd] and end with the pools again (aliased): the program
    whose positions hold limit - 1 attends to the new key / value there and writes them into the pool.
    kv_parts: per new keys / values, None, or (splits, halves) where they are split partials ([S, R, KVH * hd]
    float32 or [2, S, R, KVH * hd] uint16), read at row b and summed in split order here."""
    if append:
        kn_ref, vn_ref, k_ref, v_ref, *out_refs, k_out, v_out = refs
    else:
        (k_ref, v_ref, *out_refs), kn_ref = refs, None
    b, h, s_id = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    f32, dtype = jnp.float32, k_ref.dtype
    # float32 pools multiply in float32 (IEEE), not TF32; 16-bit pools are exact products either way
    precision = (jax.lax.Precision.HIGHEST,) * 2 if dtype == jnp.float32 else None
    # clamped as the reference's gather clamps them: nothing outside the pool is ever read
    slot, n = jnp.clip(slots_ref[b], 0, S - 1), jnp.clip(limit_ref[b], 0, L)
    lo = s_id * piece
    hi = jnp.minimum(lo + piece, n)
    g, d = jnp.arange(BG), jnp.arange(BD)
    gm, dm = g < G, d < hd
    q = plgpu.load(q_ref.at[b, h, g[:, None], d[None, :]], mask=gm[:, None] & dm[None, :], other=0.0)
    q = q.astype(dtype)                                                         # [BG, BD], as attend rounds it

    def block(i, carry, new_kv=None):
        """Positions [i * BK, (i + 1) * BK) below hi; new_kv: this step's key / value, attended from registers at
        its position (the pool's entry there is stale)."""
        m, total, acc = carry
        pos = i * BK + jnp.arange(BK)
        pm = pos < hi
        tile = pm[:, None] & dm[None, :]
        k, v = (plgpu.load(ref.at[layer, slot, pos[:, None], h, d[None, :]], mask=tile, other=0.0)
                for ref in (k_ref, v_ref))                                                          # [BK, BD]
        if new_kv is not None:
            here = (pos == new_pos)[:, None]
            k, v = jnp.where(here, new_kv[0][None, :], k), jnp.where(here, new_kv[1][None, :], v)
        s = _dot(q, k, 1, precision) * scale                                                        # [BG, BK]
        s = jnp.where(pm[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        # the probabilities enter the product in the pool's dtype, as attend rounds them; the sum stays float32
        acc = acc * alpha[:, None] + _dot(p.astype(dtype), v, 0, precision)
        return m_new, total * alpha + jnp.sum(p, axis=1), acc

    init = (jnp.full((BG,), NEG, f32), jnp.zeros((BG,), f32), jnp.zeros((BG, BD), f32))
    first, end = lo // BK, pl.cdiv(hi, BK)
    if not append:
        m, total, acc = jax.lax.fori_loop(first, end, block, init)
    else:
        # this step's position, limit - 1, is the last a program holds: its block is peeled off the loop (so the
        # loop's tiles go straight from memory to the matrix units); an empty range (hi <= lo) peels block
        # `first`, all of whose positions are masked
        last = jnp.maximum(end - 1, first)
        carry = jax.lax.fori_loop(first, last, block, init)
        new_pos = limit_ref[b] - 1                          # this step's position: in [lo, hi) for one program
        # read after the loop, so that they hold no registers through it
        new_k, new_v = (plgpu.load(ref.at[b, h, d], mask=dm, other=0.0) if parts is None else
                        load_sum(ref, (b, h * hd + d), dm, splits=parts[0], halves=parts[1]).astype(dtype)
                        for ref, parts in zip((kn_ref, vn_ref), kv_parts))                              # [BD]
        m, total, acc = block(last, carry, (new_k, new_v))
        own = (new_pos >= lo) & (new_pos < hi)      # the one program whose positions hold it writes it
        at = (layer, slot, jnp.clip(new_pos, 0, L - 1), h, d)
        plgpu.store(k_out.at[at], new_k, mask=dm & own)
        plgpu.store(v_out.at[at], new_v, mask=dm & own)
    rows = gm[:, None] & dm[None, :]
    if len(out_refs) == 1:
        out = acc / jnp.where(total > 0, total, 1.0)[:, None]
        plgpu.store(out_refs[0].at[b, h, g[:, None], d[None, :]], out.astype(out_refs[0].dtype), mask=rows)
    else:
        acc_ref, max_ref, total_ref = out_refs
        # a piece past the row's held positions stores no sum (total 0 marks it for the combine): short rows in a
        # long pool write and read back only the pieces they hold
        plgpu.store(acc_ref.at[b, h, s_id, g[:, None], d[None, :]], acc, mask=rows & (lo < n))
        plgpu.store(max_ref.at[b, h, s_id, g], m, mask=gm)
        plgpu.store(total_ref.at[b, h, s_id, g], total, mask=gm)


def _combine(acc, m, total):
    """The pieces' partial softmaxes -> the row's attention.  acc [B, KVH, NS, G, hd], m / total [B, KVH, NS, G];
    an empty piece (total 0) left its acc unwritten and weighs nothing."""
    w = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))                          # [B, KVH, NS, G]; empty pieces: 0
    denom = jnp.sum(total * w, axis=2)                                          # [B, KVH, G]
    parts = jnp.where((total > 0)[..., None], acc * w[..., None], 0.0)
    return jnp.sum(parts, axis=2) / jnp.where(denom > 0, denom, 1.0)[..., None]


@functools.partial(jax.jit, static_argnames=("layer", "scale", "interpret", "config", "out_dtype"))
def _decode_call(q, k_pool, v_pool, slots, limit, new_kv, *, layer, scale, interpret, config, out_dtype):
    B, KVH, G, hd = q.shape
    L = k_pool.shape[2]
    NS = config.pieces(L)
    piece = config.split_positions if NS > 1 else L
    append = new_kv is not None
    parts = lambda x: (x.splits, x.halves) if isinstance(x, SplitPartials) else None
    kernel = functools.partial(_decode_kernel, layer=layer, S=k_pool.shape[1], L=L, G=G, hd=hd,
                               BG=next_pow2(G, MMA_ROWS), BD=next_pow2(hd, MMA_ROWS), BK=config.block_k,
                               piece=piece, scale=scale, append=append, kv_parts=tuple(map(parts, new_kv or ())))
    f32 = jnp.float32
    out_shape = ([jax.ShapeDtypeStruct(q.shape, out_dtype)] if NS == 1 else
                 [jax.ShapeDtypeStruct((B, KVH, NS, G, hd), f32), jax.ShapeDtypeStruct((B, KVH, NS, G), f32),
                  jax.ShapeDtypeStruct((B, KVH, NS, G), f32)])
    values = lambda x: x.values if isinstance(x, SplitPartials) else x
    operands = [slots.astype(jnp.int32), limit.astype(jnp.int32), q, *map(values, new_kv or ()), k_pool, v_pool]
    aliases = {}
    if append:                               # the pools come back as outputs, written in place
        aliases = {len(operands) - 2: len(out_shape), len(operands) - 1: len(out_shape) + 1}
        out_shape += [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in (k_pool, v_pool)]
    res = pl.pallas_call(kernel, out_shape=out_shape, grid=(B, KVH, NS), input_output_aliases=aliases,
                         compiler_params=compiler_params(config.num_warps), interpret=interpret,
                         name="decode_attention")(*operands)
    parts, pools = (res[:-2], res[-2:]) if append else (res, ())
    out = parts[0] if NS == 1 else _combine(*parts).astype(out_dtype)
    return (out, *pools) if append else out


def decode_attention_pallas(q, k_pool, v_pool, slots, limit, *, layer: int, scale: float, out_dtype=jnp.float32,
                            new_kv=None, interpret: bool = False, config: DecodeAttentionConfig = CONFIG):
    """Pallas (Triton) arm of `decode_attention`: the reference's call and result up to float32 summation order
    (the probabilities are rounded to the pool's dtype against the running maximum, the reference's against the
    final one). The output is rounded to out_dtype once, in the kernel (one piece) or after the combine. With
    new_kv the pools come back with the new keys / values written in place (donate them under jit), bit for bit
    the reference's pools. new_kv may be split partials (summed in the kernel, in split order, and rounded to the
    pools' dtype: bit for bit the kernel on their settled sums)."""
    _check(q, k_pool, v_pool, slots, limit, layer, out_dtype, new_kv)
    return _decode_call(q, k_pool, v_pool, slots, limit, None if new_kv is None else tuple(new_kv), layer=layer,
                        scale=float(scale), interpret=interpret, config=config, out_dtype=jnp.dtype(out_dtype))


registry.register("decode_attention", reference=decode_attention_reference, pallas=decode_attention_pallas)
