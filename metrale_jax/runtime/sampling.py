"""Token sampling for the engine: greedy, temperature and top-p, one seeded random stream per request.

Every row carries its own parameters (temperature [B], top_p [B]) and its own key, derived from the
request's seed and the index of the token being drawn, so a request samples the same tokens whatever
batch it runs in. A row with temperature 0 is greedy (argmax).
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


def filtered_logits(logits: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
    """logits [..., V] / temperature, with every token outside the top-p nucleus set to -inf (the top
    token is always kept).  temperature / top_p broadcast against logits[..., 0]."""
    z = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)[..., None]
    order = jnp.argsort(-z, axis=-1)
    sorted_z = jnp.take_along_axis(z, order, axis=-1)
    sorted_p = jax.nn.softmax(sorted_z, axis=-1)
    keep_sorted = (jnp.cumsum(sorted_p, axis=-1) - sorted_p) < top_p[..., None]
    # the threshold logit: the smallest kept one; ties with it are kept too
    n_keep = jnp.sum(keep_sorted, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(sorted_z, n_keep - 1, axis=-1)
    return jnp.where(z >= threshold, z, -jnp.inf)


def sample_tokens(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, seeds: jax.Array,
                  counters: jax.Array, *, sampling: bool) -> jax.Array:
    """Next tokens [B] int32 from logits [B, V].  sampling False: argmax for every row (the greedy-only
    executable, no sort); else rows with temperature > 0 draw from the top-p nucleus."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not sampling:
        return greedy
    z = filtered_logits(logits, temperature, top_p)
    drawn = jax.vmap(lambda k, zz: jax.random.categorical(k, zz))(row_keys(seeds, counters, SALT_SAMPLE), z)
    return jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotSampling:
    """Each slot's sampling parameters and last sampled token, on the device, so that a decode step takes its
    input tokens and parameters without a host round trip (the engine reads the tokens back a step later).

    pending [S] int32: the slot's last sampled token (the next decode step's input); counter [S] int32: how
    many tokens the slot's request has drawn (the index of its next draw's random stream); temperature,
    top_p [S] float32 and seed [S] int32: the request's parameters."""

    pending: jax.Array
    counter: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    seed: jax.Array

    @classmethod
    def create(cls, num_slots: int) -> SlotSampling:
        return cls(pending=jnp.zeros((num_slots,), jnp.int32), counter=jnp.zeros((num_slots,), jnp.int32),
                   temperature=jnp.zeros((num_slots,), jnp.float32), top_p=jnp.ones((num_slots,), jnp.float32),
                   seed=jnp.zeros((num_slots,), jnp.int32))


def start_request(state: SlotSampling, slot, temperature, top_p, seed) -> SlotSampling:
    """A new request in `slot`: its parameters, no token drawn yet."""
    return SlotSampling(pending=state.pending.at[slot].set(0), counter=state.counter.at[slot].set(0),
                        temperature=state.temperature.at[slot].set(temperature),
                        top_p=state.top_p.at[slot].set(top_p), seed=state.seed.at[slot].set(seed))


def sample_slots(logits: jax.Array, state: SlotSampling, slots: jax.Array, draw: jax.Array, *,
                 sampling: bool) -> tuple[jax.Array, SlotSampling]:
    """Next tokens [B] from logits [B, V] of the requests in slots [B], with each slot's parameters and
    stream (`sample_tokens`); rows with draw [B] True record their token as the slot's pending one and
    advance its counter (a prefill row mid-prompt draws nothing)."""
    tokens = sample_tokens(logits, state.temperature[slots], state.top_p[slots], state.seed[slots],
                           state.counter[slots], sampling=sampling)
    return tokens, record_tokens(state, slots, tokens, draw.astype(jnp.int32))


def record_tokens(state: SlotSampling, slots: jax.Array, last: jax.Array, drawn: jax.Array) -> SlotSampling:
    """Slots [B] drew `drawn` [B] more tokens, the last of them `last` [B] (rows with drawn 0 keep theirs)."""
    pending = state.pending.at[slots].set(jnp.where(drawn > 0, last, state.pending[slots]))
    return dataclasses.replace(state, pending=pending, counter=state.counter.at[slots].add(drawn))
