"""Model-level step functions the runtime compiles: pure functions of (model, cache, inputs).

They walk the blocks through the one block loop (layers/stack.py), as model.py's steps do, and add
what serving needs: chunked prefill that always continues from each slot's cached length, with an
optional replay-tail capture at a cut per row (the SSM state at the cut comes back for the prefix
cache; the KV rows before the cut stay in the pool), a multi-token verify through every layer with
write-on-accept (the state after the last accepted token is committed, nothing is re-run), and the
slot helpers (zero, restore a snapshot, copy KV blocks out and in). The padding slot absorbs padded
rows; each step leaves its seq_len at 0.
With an MtpCache (mtp=..., a model with an MTP head) prefill and verify also run the MTP head over the pairs
(h_t, tok_{t+1}) their tokens complete, h_t being the main model's final-normed hidden state, so that the MTP
keys/values hold every position before the slot's last and MtpCache.hidden the hidden state at the last;
`mtp_draft_step` then drafts from the pending token (layers/mtp.py). A replay-tail capture then also returns
the hidden state at each cut's last position, and the MTP slot helpers copy MTP KV blocks and the carried
hidden state out and in, so that prefix snapshots hold the MTP state at the cut.
On a mesh-sharded model (model.tp) a step runs through shard_map on the model's device view
(sharding.run_sharded), the way model.py's steps do: logits come out split over the vocabulary like
lm_head, the cache and captured states keep their head / channel split, verify gathers the vocabulary
before acceptance. The slot helpers take no model; the engine runs them through
sharding.run_sharded_state.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from metrale_jax import sharding
from metrale_jax.errors import ConfigError
from metrale_jax.layers.mtp import MtpCache
from metrale_jax.layers.stack import DecodeRows, PrefillRows, run_blocks
from metrale_jax.model import _logits, _rmsnorm, _token_logprobs, decode_step, prefill_hidden  # noqa: F401
from metrale_jax.runtime.sampling import SlotSampling, record_tokens, token_logprobs
from metrale_jax.runtime.speculative import accept_drafts
from metrale_jax.state import slot_pool
from metrale_jax.state.cache import ModelCache, zero_slot  # noqa: F401  (zero_slot: a step the engine runs)
from metrale_jax.state.kv_pool import KvPool, KvSlotState
from metrale_jax.state.ssm_pool import SlotState, SsmPool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillOut:
    """logits [B, V] f32 of each row's last real token; the new cache; captured: one SlotState per
    capture row (state at that row's cut, conv [L, C, K-1] / ssm [L, H, P, N]) or None; target_logprobs
    [B, T] (log p(targets[b, t] | row prefix through t), 0 past each length) or None; mtp: the new MtpCache
    when one was given; captured_hidden: with an MtpCache and a capture, per capture row the final-normed hidden
    state [D] at its cut - 1 (what MtpCache.hidden holds after a prefill ending at the cut), else None."""

    logits: jax.Array
    cache: ModelCache
    captured: tuple | None = None
    target_logprobs: jax.Array | None = None
    mtp: MtpCache | None = None
    captured_hidden: tuple | None = None


def _captured_states(cache: ModelCache, captured, capture_rows) -> tuple[SlotState, ...]:
    """Per capture row r: the state at its row's cut in every Mamba layer (captured: the block loop's
    SlotStates [B, ...] per Mamba layer)."""
    out = []
    for r in range(capture_rows.shape[0]):
        b = capture_rows[r]
        if captured:
            conv = jnp.stack([c.conv[b] for c in captured])
            st = jnp.stack([c.ssm[b] for c in captured])
        else:                                            # no Mamba layers: empty states
            conv = jnp.zeros((0, *cache.ssm.conv_state.shape[2:]), cache.ssm.conv_state.dtype)
            st = jnp.zeros((0, *cache.ssm.ssm_state.shape[2:]), cache.ssm.ssm_state.dtype)
        out.append(SlotState(conv=conv, ssm=st))
    return tuple(out)


def prefill_step(model, cache: ModelCache, slots, ids, lengths, cuts=None, capture_rows=None,
                 targets=None, mtp: MtpCache | None = None) -> PrefillOut:
    """One chunk of prefill for B rows: ids [B, T] right-padded, lengths [B] (0 for a padding row), each
    row continuing its slot from the slot's cached length (0 for a fresh slot).

    cuts [B] / capture_rows [R] (both or neither): replay-tail capture; row b is split after cuts[b] of its
    tokens (cuts[b] = lengths[b]: no split) and the state at the cut of rows capture_rows comes back.
    targets [B, T]: also return log p(targets[b, t]) at every row position (scoring).
    mtp: the MTP head's state, brought up to date (`mtp_prefill`); with a capture, also the hidden states at
    the cuts (PrefillOut.captured_hidden)."""
    if model.tp is not None:
        if mtp is not None:
            raise ConfigError("mtp", "the MTP head does not run on a mesh-sharded model")
        state_spec = sharding.slot_specs(model.config, model.tp)[0]
        out_specs = PrefillOut(
            logits=sharding.logits_spec(model, 2), cache=sharding.cache_specs(model.config, model.tp),
            captured=None if cuts is None else (state_spec,) * capture_rows.shape[0],
            target_logprobs=None if targets is None else P())        # reduced over the vocabulary in the view
        return sharding.run_sharded(prefill_step, model, cache, slots, ids, lengths, cuts, capture_rows, targets,
                                    out_specs=out_specs)
    B, T = ids.shape
    pad = cache.padding_slot
    starts = cache.seq_lens[slots]
    rows = PrefillRows.make(slots, lengths, T, starts, padding_slot=pad, cuts=cuts)
    h, new, captured = prefill_hidden(model, cache, rows, ids)
    seq_lens = cache.seq_lens.at[slots].set(starts + lengths).at[pad].set(0)
    logits = _logits(model, h[jnp.arange(B), jnp.clip(lengths - 1, 0, T - 1)], slots=slots)
    states = None if cuts is None else _captured_states(cache, [c for c in captured if c is not None],
                                                         capture_rows)
    lp = None
    if targets is not None:
        lp = _token_logprobs(model, h.reshape(B * T, -1), targets.reshape(-1),
                             slots=jnp.repeat(slots, T)).reshape(B, T)
        lp = jnp.where(jnp.arange(T)[None, :] < lengths[:, None], lp, 0.0)
    cut_hidden = None
    if mtp is not None:
        if cuts is not None:                             # a capture row's cut is >= 1 of its tokens
            at = jnp.clip(cuts[capture_rows] - 1, 0, T - 1)
            cut_hidden = tuple(h[capture_rows[r], at[r]].astype(mtp.hidden.dtype) for r in range(at.shape[0]))
        mtp = mtp_prefill(model, mtp, slots, ids, h, lengths, starts)
    return PrefillOut(logits=logits, cache=dataclasses.replace(new, seq_lens=seq_lens), captured=states,
                      target_logprobs=lp,
                      mtp=mtp, captured_hidden=cut_hidden)


def mtp_prefill(model, mtp: MtpCache, slots, ids, h, lengths, starts) -> MtpCache:
    """The MTP pairs a prefill chunk completes: ids [B, T] (row b continuing at starts[b], lengths[b] real),
    h [B, T, D] their final-normed hidden states. Row b's pairs are (h_{p}, tok_{p+1}) for p = starts[b] - 1 ..
    starts[b] + lengths[b] - 2, the first one's h being the carried one (none for a new sequence); the last
    hidden state is carried for the next."""
    B, T, D = h.shape
    off = (starts == 0).astype(jnp.int32)                              # a new sequence has no pair before it
    ext_h = jnp.concatenate([mtp.hidden[slots][:, None].astype(h.dtype), h], axis=1)         # [B, T+1, D]
    ext_ids = jnp.concatenate([ids, jnp.zeros((B, 1), ids.dtype)], axis=1)                   # [B, T+1]
    idx = off[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]                              # [B, T]
    hidden = jnp.take_along_axis(ext_h, idx[..., None], axis=1)
    emb = model.embeddings[...][jnp.take_along_axis(ext_ids, idx, axis=1)]
    n = jnp.maximum(lengths - off, 0)
    _, kv = model.mtp.prefill(mtp.kv, slots, emb, hidden, n, jnp.maximum(starts - 1, 0))
    last = h[jnp.arange(B), jnp.clip(lengths - 1, 0, T - 1)]
    carried = jnp.where((lengths > 0)[:, None], last.astype(mtp.hidden.dtype), mtp.hidden[slots])
    return MtpCache(kv, mtp.hidden.at[slots].set(carried))


def mtp_draft_step(model, cache: ModelCache, mtp: MtpCache, slots, pending, *, num_draft: int):
    """Greedy MTP drafts for n sequences: slots [n], pending [n] (each sequence's emitted token not fed yet, at
    position seq_len). Step j runs the pair (h, tok) at position seq_len - 1 + j, starting from the carried
    hidden state and the pending token, then its own output and draft. Returns (drafts [n, num_draft], mtp):
    the keys/values written past seq_len - 1 are scratch, rewritten by the verify that follows."""
    if model.tp is not None:
        raise ConfigError("mtp", "the MTP head does not run on a mesh-sharded model")
    pos = jnp.maximum(cache.seq_lens[slots] - 1, 0)
    h, tok, kv, drafts = mtp.hidden[slots], pending, mtp.kv, []
    for j in range(num_draft):
        h, kv = model.mtp.rows(kv, slots, model.embeddings[...][tok], h, pos + j, 1)
        tok = jnp.argmax(_logits(model, h, "decode", slots=slots), axis=-1).astype(jnp.int32)
        drafts.append(tok)
    return jnp.stack(drafts, axis=1), MtpCache(kv, mtp.hidden)


def verify_step(model, cache: ModelCache, slots, tokens, num_draft, temperature, top_p, seeds, counters,
                mtp: MtpCache | None = None, top_k=None, min_p=None, *, sampling: bool, logprobs: int | None = None):
    """Speculative verify with write-on-accept for n sequences in one sweep.

    tokens [n, k]: each sequence's pending token then its drafts (num_draft [n] real ones). Every layer
    runs the n*k rows (Mamba layers through decode_verify_multi, which keeps the state after every row;
    attention writes the k rows' keys/values). After acceptance (speculative.accept_drafts, with each row's
    temperature, top_p and optional top_k / min_p) each Mamba
    layer commits the state after the last kept row and seq_len advances by accepted + 1; keys/values
    past it are masked by seq_len and overwritten later. Returns (out [n, k], accepted [n], cache): the
    sequence emits out[i, :accepted[i] + 1]. On a mesh every device runs the same acceptance on the whole
    vocabulary's logits (gathered), so out / accepted agree everywhere and each commits its own heads.
    mtp: also run the MTP head over the pairs the k rows complete (positions seq_len - 1 ..): returns
    (out, accepted, cache, mtp), MtpCache.hidden holding the hidden state after the last accepted row.
    logprobs = n: one more result at the end, the raw log-probs of out [n, k] and the n most likely
    (sampling.TokenLogprobs)."""
    if model.tp is not None:
        if mtp is not None:
            raise ConfigError("mtp", "the MTP head does not run on a mesh-sharded model")
        out_specs = (P(), P(), sharding.cache_specs(model.config, model.tp)) + ((P(),) if logprobs is not None else ())
        return sharding.run_sharded(verify_step, model, cache, slots, tokens, num_draft, temperature, top_p, seeds,
                                    counters, None, top_k, min_p, out_specs=out_specs, sampling=sampling,
                                    logprobs=logprobs)
    n, k = tokens.shape
    pad = cache.padding_slot
    pos = cache.seq_lens[slots]
    h = model.embeddings[...][tokens.reshape(-1)]                           # [n*k, D]
    h, new, captured = run_blocks(model.layers, DecodeRows(slots, pos, k, verify=True), cache, h, pending_out=True)
    steps = [(layer.pool_layer, st) for layer, st in zip(model.layers, captured) if st is not None]
    hn = _rmsnorm(model, h)                                                 # [n*k, D]
    logits = _logits(model, hn, "decode", slots=jnp.repeat(slots, k))     # [n*k, V]
    if model.vocab_axis is not None:                 # a device view holds V / tp vocabulary columns
        logits = jax.lax.all_gather(logits, model.vocab_axis, axis=1, tiled=True)
    logits = logits.reshape(n, k, -1)
    out, accepted = accept_drafts(logits, tokens, num_draft, temperature, top_p, seeds, counters,
                                  sampling=sampling, top_k=top_k, min_p=min_p)
    lp = () if logprobs is None else (token_logprobs(logits, out, logprobs),)
    rows = jnp.arange(n)
    conv, state = new.ssm.conv_state, new.ssm.ssm_state
    for l, st in steps:
        conv = conv.at[l, slots].set(st.conv[rows, accepted].astype(conv.dtype))
        state = state.at[l, slots].set(st.ssm[rows, accepted].astype(state.dtype))
    seq_lens = cache.seq_lens.at[slots].set(pos + accepted + 1).at[pad].set(0)
    new_cache = ModelCache(SsmPool(conv, state), new.kv, seq_lens)
    if mtp is None:
        return out, accepted, new_cache, *lp
    hk = hn.reshape(n, k, -1)
    hidden = jnp.concatenate([mtp.hidden[slots][:, None].astype(hk.dtype), hk[:, :-1]], axis=1)   # h_{p-1}
    _, mkv = model.mtp.rows(mtp.kv, slots, model.embeddings[...][tokens.reshape(-1)], hidden.reshape(n * k, -1),
                            jnp.maximum(pos - 1, 0), k)
    carried = mtp.hidden.at[slots].set(hk[rows, accepted].astype(mtp.hidden.dtype))
    return out, accepted, new_cache, MtpCache(mkv, carried), *lp


def decode_pending_step(model, cache: ModelCache, pending, slots):
    """`decode_step` on each slot's last sampled token (pending [S], sampling.SlotSampling.pending): the
    engine's decode input never leaves the device. Returns (logits [B, V], cache)."""
    return decode_step(model, cache, slots, pending[slots])


def verify_sampled(model, cache: ModelCache, sampling: SlotSampling, slots, tokens, num_draft, live,
                   mtp: MtpCache | None = None, *, sampling_rows: bool, logprobs: int | None = None):
    """`verify_step` with each slot's sampling parameters and stream taken from `sampling`, which records what
    the live rows (live [n]) emitted: accepted + 1 tokens, the last one pending. Returns (out, accepted, cache,
    sampling, mtp or None, TokenLogprobs of out or None)."""
    res = verify_step(model, cache, slots, tokens, num_draft, sampling.temperature[slots], sampling.top_p[slots],
                      sampling.seed[slots], sampling.counter[slots], mtp, sampling.top_k[slots],
                      sampling.min_p[slots], sampling=sampling_rows, logprobs=logprobs)
    out, accepted, new_cache = res[:3]
    new_mtp = res[3] if mtp is not None else None
    lp = res[-1] if logprobs is not None else None
    last = out[jnp.arange(out.shape[0]), accepted]
    sampling = record_tokens(sampling, slots, last, jnp.where(live, accepted + 1, 0))
    return out, accepted, new_cache, sampling, new_mtp, lp


# ---- slot helpers -----------------------------------------------------------------------------
def slot_ssm_state(cache: ModelCache, slot) -> SlotState:
    """A copy of one slot's Mamba states in every layer (the two-pass capture's snapshot)."""
    return slot_pool.take_slot(cache.ssm, slot)


def restore_ssm(cache: ModelCache, slot, state: SlotState, seq_len) -> ModelCache:
    """Put a snapshot's Mamba states into `slot` and set its length (its KV blocks go in separately)."""
    return ModelCache(slot_pool.put_slot(cache.ssm, slot, state), cache.kv, cache.seq_lens.at[slot].set(seq_len))


def _kv_take(kv: KvPool, slot, start, block: int) -> KvSlotState:
    take = lambda a: jax.lax.dynamic_slice_in_dim(a[:, slot], start, block, axis=1)
    return KvSlotState(take(kv.k), take(kv.v))


def _kv_put(kv: KvPool, slot, start, blk: KvSlotState) -> KvPool:
    put = lambda a, b: jax.lax.dynamic_update_slice(a, b[:, None].astype(a.dtype), (0, slot, start, 0, 0))
    return KvPool(put(kv.k, blk.k), put(kv.v, blk.v))


def kv_block_get(cache: ModelCache, slot, start, *, block: int) -> KvSlotState:
    """Keys/values of positions start .. start+block-1 of `slot`: k, v [L, block, KVH, hd]."""
    return _kv_take(cache.kv, slot, start, block)


def kv_block_put(cache: ModelCache, slot, start, blk: KvSlotState) -> ModelCache:
    """Write a KV block (from kv_block_get) at positions start.. of `slot`."""
    return ModelCache(cache.ssm, _kv_put(cache.kv, slot, start, blk), cache.seq_lens)


def mtp_block_get(mtp: MtpCache, slot, start, *, block: int) -> KvSlotState:
    """The MTP head's keys/values of positions start .. start+block-1 of `slot`: k, v [L, block, KVH, hd]."""
    return _kv_take(mtp.kv, slot, start, block)


def mtp_block_put(mtp: MtpCache, slot, start, blk: KvSlotState) -> MtpCache:
    """Write an MTP KV block (from mtp_block_get) at positions start.. of `slot`."""
    return MtpCache(_kv_put(mtp.kv, slot, start, blk), mtp.hidden)


def mtp_slot_hidden(mtp: MtpCache, slot) -> jax.Array:
    """A copy of the hidden state `slot` carries for its next MTP pair [D]."""
    return mtp.hidden[slot]


def mtp_restore_hidden(mtp: MtpCache, slot, hidden) -> MtpCache:
    """Set the hidden state `slot` carries (a snapshot's, from mtp_slot_hidden or a capture)."""
    return MtpCache(mtp.kv, mtp.hidden.at[slot].set(hidden.astype(mtp.hidden.dtype)))
