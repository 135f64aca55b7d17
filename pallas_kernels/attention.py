"""Causal GQA attention (softmax in float32) and decode attention over the key/value pool in place.

`attend` is the model's attention for every phase (jnp). `decode_attention` is one query token per sequence against
its slot's keys and values in the pool [layers, slots, max_len, KVH, hd]: the jnp reference gathers each row's
whole slot (max_len positions) and masks; the Pallas kernel's program (row, kv head) streams blocks of the
positions the row holds, [0, limit), with an online softmax in float32, so a step reads what the sequences hold,
not max_len. Positions at and past a row's limit are never read (the tests poison them with NaN).
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


def _check(q, k_pool, v_pool, slots, limit, layer):
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


def decode_attention_reference(q, k_pool, v_pool, slots, limit, *, layer: int, scale: float) -> jax.Array:
    """q [B, KVH, G, hd] (one token per row); k_pool / v_pool [layers, S, L, KVH, hd]; slots, limit int32 [B]: row
    b attends to positions [0, limit[b]) of slot slots[b] in `layer`. -> [B, KVH, G, hd] float32 (`attend`'s
    numbers for a query at position limit - 1)."""
    _check(q, k_pool, v_pool, slots, limit, layer)
    L = k_pool.shape[2]
    pos = (limit - 1)[:, None]                                                  # [B, 1]
    return attend(q[:, None], k_pool[layer, slots], v_pool[layer, slots], pos, jnp.arange(L, dtype=jnp.int32),
                  limit, scale)[:, 0]


@dataclasses.dataclass(frozen=True)
class DecodeAttentionConfig:
    """block_k: positions per loop step (a [G, block_k, hd] float32 product per step lives in registers)."""

    block_k: int = 32
    num_warps: int = 4


CONFIG = DecodeAttentionConfig()


def _decode_kernel(slots_ref, limit_ref, q_ref, k_ref, v_ref, o_ref, *, layer, S, L, G, BG, hd, BD, BK, scale):
    b, h = pl.program_id(0), pl.program_id(1)
    f32 = jnp.float32
    # clamped as the reference's gather clamps them: nothing outside the pool is ever read
    slot, n = jnp.clip(slots_ref[b], 0, S - 1), jnp.clip(limit_ref[b], 0, L)
    g, d = jnp.arange(BG), jnp.arange(BD)
    gm, dm = g < G, d < hd
    q = plgpu.load(q_ref.at[b, h, g[:, None], d[None, :]], mask=gm[:, None] & dm[None, :], other=0.0)
    q = q.astype(k_ref.dtype).astype(f32)                                      # [BG, BD], as attend rounds it

    def block(i, carry):
        m, total, acc = carry
        pos = i * BK + jnp.arange(BK)
        pm = pos < n
        tile = pm[:, None] & dm[None, :]
        k = plgpu.load(k_ref.at[layer, slot, pos[:, None], h, d[None, :]], mask=tile, other=0.0).astype(f32)
        s = jnp.sum(q[:, None, :] * k[None, :, :], axis=2) * scale                # [BG, BK]
        s = jnp.where(pm[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        v = plgpu.load(v_ref.at[layer, slot, pos[:, None], h, d[None, :]], mask=tile, other=0.0).astype(f32)
        acc = acc * alpha[:, None] + jnp.sum(p[:, :, None] * v[None, :, :], axis=1)
        return m_new, total * alpha + jnp.sum(p, axis=1), acc

    init = (jnp.full((BG,), NEG, f32), jnp.zeros((BG,), f32), jnp.zeros((BG, BD), f32))
    _, total, acc = jax.lax.fori_loop(0, pl.cdiv(n, BK), block, init)
    out = acc / jnp.where(total > 0, total, 1.0)[:, None]
    plgpu.store(o_ref.at[b, h, g[:, None], d[None, :]], out, mask=gm[:, None] & dm[None, :])


@functools.partial(jax.jit, static_argnames=("layer", "scale", "interpret", "config"))
def _decode_call(q, k_pool, v_pool, slots, limit, *, layer, scale, interpret, config):
    B, KVH, G, hd = q.shape
    kernel = functools.partial(_decode_kernel, layer=layer, S=k_pool.shape[1], L=k_pool.shape[2], G=G,
                               BG=next_pow2(G), hd=hd, BD=next_pow2(hd), BK=config.block_k, scale=scale)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(q.shape, jnp.float32), grid=(B, KVH),
                          compiler_params=compiler_params(config.num_warps), interpret=interpret,
                          name="decode_attention")(slots.astype(jnp.int32), limit.astype(jnp.int32), q, k_pool, v_pool)


def decode_attention_pallas(q, k_pool, v_pool, slots, limit, *, layer: int, scale: float, interpret: bool = False,
                            config: DecodeAttentionConfig = CONFIG) -> jax.Array:
    """Pallas (Triton) arm of `decode_attention`: the reference's call and result (up to float32 summation order,
    and probabilities kept in float32 where the reference rounds them to the pool's dtype)."""
    _check(q, k_pool, v_pool, slots, limit, layer)
    return _decode_call(q, k_pool, v_pool, slots, limit, layer=layer, scale=float(scale), interpret=interpret,
                        config=config)


registry.register("decode_attention", reference=decode_attention_reference, pallas=decode_attention_pallas)
