"""Token sampling for the engine: greedy, temperature, top-k, min-p and top-p, one seeded random stream per request.

Every row carries its own parameters (temperature, top_p, top_k, min_p [B]) and its own key, derived from the
request's seed and the index of the token being drawn, so a request samples the same tokens whatever batch it runs
in. A row with temperature 0 is greedy (argmax). Log-probs reported with the tokens are those of the raw
distribution (log_softmax of the logits, temperature 1, no filter; `token_logprobs`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# salts that keep the random streams of the different draws of one token index apart
SALT_SAMPLE, SALT_ACCEPT, SALT_RESIDUAL = 0, 1, 2


def row_keys(seeds: jax.Array, counters: jax.Array, salt: int) -> jax.Array:
    """One typed key per row: fold(fold(key(seed), counter), salt).  seeds / counters [...] int."""
    def one(seed, counter):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), counter), salt)

    flat = jax.vmap(one)(seeds.reshape(-1).astype(jnp.uint32), counters.reshape(-1).astype(jnp.uint32))
    return flat.reshape(seeds.shape)


def filtered_logits(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array | None = None,
                    min_p: jax.Array | None = None) -> jax.Array:
    """logits [..., V] / temperature, with every token the filters drop set to -inf (the top token is always kept).
    In HF transformers' and vLLM's order, on the temperature-scaled distribution p: top_k (0: off) keeps the k most
    likely tokens, min_p (0: off) those with p >= min_p * max p, then top_p the smallest most-likely set whose
    probability renormalized over what those kept reaches top_p. Each filter keeps a most-likely prefix, so one sort
    serves all three; ties with the last kept token are kept too. Parameters broadcast against logits[..., 0]."""
    z = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)[..., None]
    sorted_z = -jnp.sort(-z, axis=-1)                                        # descending
    sorted_p = jax.nn.softmax(sorted_z, axis=-1)
    keep = jnp.ones(sorted_z.shape, bool)
    if top_k is not None:
        rank = jnp.arange(z.shape[-1], dtype=jnp.int32)
        keep &= (top_k[..., None] <= 0) | (rank < top_k[..., None])
    if min_p is not None:
        keep &= sorted_p >= min_p[..., None] * sorted_p[..., :1]
    if top_k is not None or min_p is not None:
        kept = jnp.where(keep, sorted_p, 0.0)
        sorted_p = kept / jnp.sum(kept, axis=-1, keepdims=True)
    # top_p 1 is off: a float32 cumsum reaches 1 before the tail, which would drop the least likely tokens
    keep &= ((jnp.cumsum(sorted_p, axis=-1) - sorted_p) < top_p[..., None]) | (top_p[..., None] >= 1)
    # the threshold logit: the smallest kept one; ties with it are kept too
    n_keep = jnp.sum(keep, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(sorted_z, n_keep - 1, axis=-1)
    return jnp.where(z >= threshold, z, -jnp.inf)


def sample_tokens(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, seeds: jax.Array,
                  counters: jax.Array, *, sampling: bool, top_k: jax.Array | None = None,
                  min_p: jax.Array | None = None) -> jax.Array:
    """Next tokens [B] int32 from logits [B, V].  sampling False: argmax for every row (the greedy-only
    executable, no sort); else rows with temperature > 0 draw from what `filtered_logits` keeps."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not sampling:
        return greedy
    z = filtered_logits(logits, temperature, top_p, top_k, min_p)
    drawn = jax.vmap(lambda k, zz: jax.random.categorical(k, zz))(row_keys(seeds, counters, SALT_SAMPLE), z)
    return jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """Log-probs of chosen tokens under the raw distribution: chosen [...] of each token, and the n most likely
    tokens top_ids [..., n] int32 with their log-probs top_logprobs [..., n] (n may be 0), best first."""

    chosen: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def token_logprobs(logits: jax.Array, tokens: jax.Array, n: int) -> TokenLogprobs:
    """log_softmax(logits [..., V]) (float32, temperature 1, no filter) at tokens [...], and its n largest."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(lp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    top_lp, top_ids = jax.lax.top_k(lp, n)
    return TokenLogprobs(chosen, top_ids.astype(jnp.int32), top_lp)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotSampling:
    """Each slot's sampling parameters and last sampled token, on the device, so that a decode step takes its
    input tokens and parameters without a host round trip (the engine reads the tokens back a step later).

    pending [S] int32: the slot's last sampled token (the next decode step's input); counter [S] int32: how
    many tokens the slot's request has drawn (the index of its next draw's random stream); temperature,
    top_p, min_p [S] float32, top_k [S] int32 and seed [S] int32: the request's parameters (SamplingParams)."""

    pending: jax.Array
    counter: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    seed: jax.Array
    top_k: jax.Array
    min_p: jax.Array

    @classmethod
    def create(cls, num_slots: int) -> SlotSampling:
        zeros = lambda dtype: jnp.zeros((num_slots,), dtype)
        return cls(pending=zeros(jnp.int32), counter=zeros(jnp.int32), temperature=zeros(jnp.float32),
                   top_p=jnp.ones((num_slots,), jnp.float32), seed=zeros(jnp.int32), top_k=zeros(jnp.int32),
                   min_p=zeros(jnp.float32))


def start_request(state: SlotSampling, slot, temperature, top_p, top_k, min_p, seed) -> SlotSampling:
    """A new request in `slot`: its parameters, no token drawn yet."""
    return SlotSampling(pending=state.pending.at[slot].set(0), counter=state.counter.at[slot].set(0),
                        temperature=state.temperature.at[slot].set(temperature),
                        top_p=state.top_p.at[slot].set(top_p), seed=state.seed.at[slot].set(seed),
                        top_k=state.top_k.at[slot].set(top_k), min_p=state.min_p.at[slot].set(min_p))


def sample_slots(logits: jax.Array, state: SlotSampling, slots: jax.Array, draw: jax.Array, *,
                 sampling: bool) -> tuple[jax.Array, SlotSampling]:
    """Next tokens [B] from logits [B, V] of the requests in slots [B], with each slot's parameters and
    stream (`sample_tokens`); rows with draw [B] True record their token as the slot's pending one and
    advance its counter (a prefill row mid-prompt draws nothing)."""
    tokens = sample_tokens(logits, state.temperature[slots], state.top_p[slots], state.seed[slots],
                           state.counter[slots], sampling=sampling, top_k=state.top_k[slots],
                           min_p=state.min_p[slots])
    return tokens, record_tokens(state, slots, tokens, draw.astype(jnp.int32))


def draw_slots(logits: jax.Array, state: SlotSampling, slots: jax.Array, draw: jax.Array, *, sampling: bool,
               logprobs: int | None = None) -> tuple[jax.Array, SlotSampling, TokenLogprobs | None]:
    """`sample_slots`, and with logprobs = n the tokens' raw log-probs and the n most likely (None without)."""
    tokens, state = sample_slots(logits, state, slots, draw, sampling=sampling)
    return tokens, state, None if logprobs is None else token_logprobs(logits, tokens, logprobs)


def record_tokens(state: SlotSampling, slots: jax.Array, last: jax.Array, drawn: jax.Array) -> SlotSampling:
    """Slots [B] drew `drawn` [B] more tokens, the last of them `last` [B] (rows with drawn 0 keep theirs)."""
    pending = state.pending.at[slots].set(jnp.where(drawn > 0, last, state.pending[slots]))
    return dataclasses.replace(state, pending=pending, counter=state.counter.at[slots].add(drawn))
