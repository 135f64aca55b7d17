"""Decode attention over the key/value pool in place (pallas_kernels/attention.py): the Pallas kernel against its
jnp reference and a float64 numpy softmax attention; positions a row does not hold (past its limit, other slots,
other layers) are NaN-poisoned, so reading any of them shows."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import registry
from pallas_kernels.attention import (DecodeAttentionConfig, append_kv, decode_attention_pallas,
                                      decode_attention_reference)
from pallas_kernels.errors import ShapeError
from pallas_kernels.split_partials import SplitPartials, chain_sum, split_halves
from tests.numpy_refs import rel_err


def _case(rng, dtype, *, layers=2, S=5, L=45, KVH=2, G=3, hd=12, B=4):
    """Pools [layers, S, L, KVH, hd] NaN everywhere but the held positions of the rows' slots in `layer` 1;
    slots distinct, limits from 1 to L (a block edge, the whole slot)."""
    q = jnp.asarray(rng.standard_normal((B, KVH, G, hd)), dtype)
    slots = rng.permutation(S)[:B].astype(np.int32)
    limit = np.array([1, 32, L, 19][:B], np.int32)
    k, v = (np.full((layers, S, L, KVH, hd), np.nan, np.float32) for _ in range(2))
    for b in range(B):
        for pool in (k, v):
            pool[1, slots[b], :limit[b]] = rng.standard_normal((limit[b], KVH, hd)) * 2
    return q, jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(slots), jnp.asarray(limit)


def _numpy(q, k, v, slots, limit, layer, scale):
    """float64 softmax attention of each row's query over its held positions."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    out = np.zeros(q.shape)
    for b, (s, n) in enumerate(zip(np.asarray(slots), np.asarray(limit))):
        kk, vv = k[layer, s, :n], v[layer, s, :n]                      # [n, KVH, hd]
        sc = np.einsum("kgd,nkd->kgn", q[b], kk) * scale
        p = np.exp(sc - sc.max(-1, keepdims=True))
        out[b] = np.einsum("kgn,nkd->kgd", p / p.sum(-1, keepdims=True), vv)
    return out


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("block_k,split", [(16, None), (64, 512), (16, 16), (16, 32)])
def test_kernel_reads_only_the_held_positions(rng, interpret, dtype, tol, block_k, split):
    """One program per row and kv head, or the slot (45 positions) in 3 / 2 pieces: rows whose limit ends inside
    the first piece (later pieces empty), on a piece's edge (32), inside the last."""
    q, k, v, slots, limit = _case(rng, dtype)
    scale = 12 ** -0.5
    config = DecodeAttentionConfig(block_k=block_k, split_positions=split)
    assert config.pieces(45) == {None: 1, 512: 1, 16: 3, 32: 2}[split]
    out = decode_attention_pallas(q, k, v, slots, limit, layer=1, scale=scale, interpret=interpret, config=config)
    assert out.shape == q.shape and out.dtype == jnp.float32
    assert np.all(np.isfinite(np.asarray(out)))                         # no poisoned position was read
    want = _numpy(q.astype(k.dtype), k, v, slots, limit, 1, scale)      # the query as the pool's dtype, as attend
    assert rel_err(np.asarray(out), want) <= tol


@pytest.mark.parametrize("split", [None, 16])
def test_output_dtype_is_one_rounding_of_the_float32_output(rng, interpret, split):
    """out_dtype (the model's bf16): the float32 result rounded once, in the kernel (one piece) or after the
    pieces' combine; the reference likewise."""
    q, k, v, slots, limit = _case(rng, jnp.bfloat16)
    kw = dict(layer=1, scale=0.3, interpret=interpret, config=DecodeAttentionConfig(block_k=16, split_positions=split))
    out = decode_attention_pallas(q, k, v, slots, limit, out_dtype=jnp.bfloat16, **kw)
    f32 = decode_attention_pallas(q, k, v, slots, limit, **kw)
    assert out.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(out, np.float32)))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(f32.astype(jnp.bfloat16), np.float32))
    k, v = (jnp.nan_to_num(a) for a in (k, v))            # the reference reads (and masks) the whole slot
    ref = decode_attention_reference(q, k, v, slots, limit, layer=1, scale=0.3, out_dtype=jnp.bfloat16)
    assert ref.dtype == jnp.bfloat16 and rel_err(np.asarray(out, np.float32), np.asarray(ref, np.float32)) <= 1e-2
    for fn in (decode_attention_pallas, decode_attention_reference):
        with pytest.raises(ShapeError, match="out_dtype expected a floating dtype, got int32"):
            fn(q, k, v, slots, limit, layer=1, scale=0.3, out_dtype=jnp.int32)


def _bits(a):
    return np.asarray(a).view(np.uint16 if a.dtype == jnp.bfloat16 else np.uint32)


@pytest.mark.parametrize("split", [None, 16])
def test_new_keys_and_values_are_appended_in_place(rng, interpret, split):
    """new_kv (a decode step's own keys and values): written at position limit - 1 of each row's slot, the pools bit
    for bit the reference's scatter, and attended from registers: the output is the kernel's own on the written
    pools, bit for bit. The stale entries at limit - 1 are NaN (a read would show); a row whose limit is past the
    pool's end writes nothing and attends to its whole slot."""
    q, k, v, slots, limit = _case(rng, jnp.bfloat16)                    # limits 1, 32, 45 (the whole slot), 19
    limit = limit.at[2].set(48)                                         # past the 45 positions: nothing written
    stale = [(b, int(limit[b]) - 1) for b in (0, 1, 3)]
    for b, p in stale:
        k, v = (a.at[1, slots[b], p].set(jnp.nan) for a in (k, v))
    B, KVH, _, hd = q.shape
    new = tuple(jnp.asarray(rng.standard_normal((B, KVH, hd)), jnp.bfloat16) for _ in range(2))
    kw = dict(layer=1, scale=0.3, interpret=interpret, config=DecodeAttentionConfig(block_k=16, split_positions=split))
    out, k_got, v_got = decode_attention_pallas(q, k, v, slots, limit, new_kv=new, **kw)
    k_want, v_want = append_kv(k, v, slots, limit, 1, new)
    np.testing.assert_array_equal(_bits(k_got), _bits(k_want))
    np.testing.assert_array_equal(_bits(v_got), _bits(v_want))
    for b, p in stale:
        np.testing.assert_array_equal(_bits(k_got[1, slots[b], p]), _bits(new[0][b]))
    assert np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_array_equal(_bits(out), _bits(decode_attention_pallas(q, k_want, v_want, slots, limit, **kw)))
    clean = [jnp.nan_to_num(a) for a in (k, v)]
    ref, k_ref, _ = decode_attention_reference(q, *clean, slots, limit, layer=1, scale=0.3, new_kv=new)
    np.testing.assert_array_equal(_bits(k_ref), _bits(append_kv(*clean, slots, limit, 1, new)[0]))
    assert rel_err(np.asarray(out), np.asarray(ref)) <= 1e-2
    with pytest.raises(ShapeError, match="new_kv expected"):
        decode_attention_pallas(q, k, v, slots, limit, new_kv=(new[0], new[1].astype(jnp.float32)), **kw)
    with pytest.raises(ShapeError, match="new_kv expected"):
        decode_attention_reference(q, k, v, slots, limit, layer=1, scale=0.3, new_kv=(new[0][:, :1], new[1]))


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_reference_is_attend_over_the_gathered_slots(rng, dtype, tol):
    """The reference (what the model computed before the kernel: the whole slot gathered, masked) on clean pools
    equals the numpy attention; bf16 pools: the reference rounds its probabilities to bf16."""
    q, k, v, slots, limit = _case(rng, dtype)
    clean = lambda a: jnp.where(jnp.isnan(a), jnp.asarray(rng.standard_normal(a.shape), a.dtype), a)
    k, v = clean(k), clean(v)
    got = decode_attention_reference(q, k, v, slots, limit, layer=1, scale=0.3)
    assert rel_err(np.asarray(got), _numpy(q.astype(k.dtype), k, v, slots, limit, 1, 0.3)) <= tol
    ker = registry.get("decode_attention", "interpret")(q, k, v, slots, limit, layer=1, scale=0.3)
    assert rel_err(np.asarray(ker), np.asarray(got)) <= tol


def test_configs_the_kernel_cannot_run_are_refused():
    for bad in (8, 48):
        with pytest.raises(ShapeError, match=f"block_k must be a power of two >= 16, got {bad}"):
            DecodeAttentionConfig(block_k=bad)
    for bad in (0, 40):
        with pytest.raises(ShapeError, match=f"split_positions must be a positive multiple of block_k 16.*{bad}"):
            DecodeAttentionConfig(block_k=16, split_positions=bad)


def _partials(rng, rows, halves: bool, S: int, R: int) -> SplitPartials:
    """S float32 partials [S, R, N] of rows [B, N] (their chain sum is rows up to float32 rounding), NaN in the
    padding rows past B (a read would show); halves: as uint16 [2, S, R, N]."""
    B, N = rows.shape
    p = np.full((S, R, N), np.nan, np.float32)
    p[:, :B] = rng.standard_normal((S, B, N)).astype(np.float32) * 0.5
    p[S - 1, :B] += np.asarray(rows, np.float32)
    if halves:
        return SplitPartials(jnp.stack(split_halves(jnp.asarray(p))))
    return SplitPartials(jnp.asarray(p))


@pytest.mark.parametrize("split", [None, 16])
@pytest.mark.parametrize("halves", [False, True])
def test_new_keys_and_values_as_split_partials_are_summed_in_the_kernel(rng, interpret, split, halves):
    """The new keys / values as k_proj's / v_proj's split partials (2 and 1 splits, padding rows NaN): the kernel
    sums them in split order and rounds them to the pools' dtype: output and pools bit for bit the kernel's on
    those settled arrays (and with one of each); the reference settles them the same way."""
    q, k, v, slots, limit = _case(rng, jnp.bfloat16)
    B, KVH, _, hd = q.shape
    kp, vp = (_partials(rng, rng.standard_normal((B, KVH * hd)), halves, S, B + 2) for S in (2, 1))
    k_s, v_s = (chain_sum(p, B).astype(jnp.bfloat16).reshape(B, KVH, hd) for p in (kp, vp))
    kw = dict(layer=1, scale=0.3, out_dtype=jnp.bfloat16, interpret=interpret,
              config=DecodeAttentionConfig(block_k=16, split_positions=split))
    got = decode_attention_pallas(q, k, v, slots, limit, new_kv=(kp, vp), **kw)
    want = decode_attention_pallas(q, k, v, slots, limit, new_kv=(k_s, v_s), **kw)
    assert np.all(np.isfinite(np.asarray(got[0], np.float32)))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    mixed = decode_attention_pallas(q, k, v, slots, limit, new_kv=(k_s, vp), **kw)
    for a, b in zip(mixed, want):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    clean = [jnp.nan_to_num(a) for a in (k, v)]
    ref = decode_attention_reference(q, *clean, slots, limit, layer=1, scale=0.3, new_kv=(kp, vp))
    ref_s = decode_attention_reference(q, *clean, slots, limit, layer=1, scale=0.3, new_kv=(k_s, v_s))
    for a, b in zip(ref, ref_s):
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_bad_split_partials_are_typed_errors(rng):
    q, k, v, slots, limit = _case(rng, jnp.bfloat16)
    B, KVH, _, hd = q.shape
    kp = _partials(rng, rng.standard_normal((B, KVH * hd)), False, 2, B)
    v_new = jnp.asarray(rng.standard_normal((B, KVH, hd)), jnp.bfloat16)
    kw = dict(layer=1, scale=0.3, interpret=True)
    with pytest.raises(ShapeError, match=r"new_kv keys expected float32 \[S, R >= 4, 24\]"):
        decode_attention_pallas(q, k, v, slots, limit, new_kv=(SplitPartials(kp.values[:, :2]), v_new), **kw)
    with pytest.raises(ShapeError, match="new_kv keys expected float32"):
        decode_attention_reference(q, k, v, slots, limit, layer=1, scale=0.3,
                                   new_kv=(SplitPartials(kp.values[..., :20]), v_new))
    with pytest.raises(ShapeError, match="new_kv values expected float32"):
        decode_attention_pallas(q, k, v, slots, limit, new_kv=(kp, SplitPartials(kp.values.astype(jnp.int32))), **kw)


def test_bad_shapes_are_typed_errors(rng):
    q, k, v, slots, limit = _case(rng, jnp.float32)
    with pytest.raises(ShapeError, match="decode_attention: expected q"):
        decode_attention_reference(q[0], k, v, slots, limit, layer=1, scale=1.0)
    with pytest.raises(ShapeError, match=r"needs pools \[\.\.\., 2, 12\]"):
        decode_attention_pallas(q, k[..., :8], v[..., :8], slots, limit, layer=1, scale=1.0, interpret=True)
    with pytest.raises(ShapeError, match="slots / limit"):
        decode_attention_pallas(q, k, v, slots[:2], limit, layer=1, scale=1.0, interpret=True)
    with pytest.raises(ShapeError, match="layer 2 is not in the pool's 2 layers"):
        decode_attention_reference(q, k, v, slots, limit, layer=2, scale=1.0)


@pytest.mark.parametrize("split", [None, 16])
def test_limits_past_the_pool_read_the_whole_slot_and_nothing_beyond(rng, interpret, split):
    """A limit above max_len (which the engine never sends) reads the slot's max_len positions, as the reference's
    mask does, and nothing past them (other slots and layer 0 stay NaN)."""
    q, k, v, slots, _ = _case(rng, jnp.float32, L=40)
    full = jnp.asarray(rng.standard_normal(k.shape[2:]), jnp.float32)
    k, v = (a.at[1, slots].set(full) for a in (k, v))                   # every position of the rows' slots held
    limit = jnp.asarray([41, 40, 1000, 7], jnp.int32)
    out = decode_attention_pallas(q, k, v, slots, limit, layer=1, scale=0.4, interpret=interpret,
                                  config=DecodeAttentionConfig(block_k=16, split_positions=split))
    assert np.all(np.isfinite(np.asarray(out)))
    want = _numpy(q, k, v, slots, np.minimum(np.asarray(limit), 40), 1, 0.4)
    assert rel_err(np.asarray(out), want) <= 1e-5


def test_pieces_past_a_rows_held_positions_store_no_sum(rng, interpret, monkeypatch):
    """A row's pieces past its held positions write no partial sum (short rows in a long pool move only what they
    hold): the partials the combine receives are untouched there (poisoned with NaN beforehand here), written for
    every piece a row holds, and the combined output is the float64 attention all the same."""
    from pallas_kernels import attention

    q, k, v, slots, limit = _case(rng, jnp.float32)                 # limits 1, 32, 45, 19 of 45; pieces of 16
    seen = {}
    real = attention._combine

    def poisoned(acc, m, total):
        seen.update(acc=np.asarray(acc), total=np.asarray(total))
        return real(acc, m, total)

    monkeypatch.setattr(attention, "_combine", poisoned)
    config = DecodeAttentionConfig(block_k=16, split_positions=16)
    out = attention._decode_call.__wrapped__(q, k, v, slots, limit, None, layer=1, scale=0.3, interpret=interpret,
                                             config=config, out_dtype=jnp.float32)  # unjitted: concrete partials
    held = np.arange(3)[None, :] * 16 < np.asarray(limit)[:, None]        # [B, pieces]: a piece holds positions
    assert (~held).sum() == 4                                            # rows 0 (2), 1 and 3 leave pieces empty
    acc, total = seen["acc"], seen["total"]
    assert np.all(np.isfinite(acc.transpose(0, 2, 1, 3, 4)[held]))       # [B, pieces, KVH, G, hd] where held
    assert np.all(total.transpose(0, 2, 1, 3)[~held] == 0)
    if interpret:                                                        # interpret mode's outputs start as NaN
        assert np.all(np.isnan(acc.transpose(0, 2, 1, 3, 4)[~held]))
    assert np.all(np.isfinite(np.asarray(out)))
    assert rel_err(np.asarray(out), _numpy(q, k, v, slots, limit, 1, 0.3)) <= 1e-5
