"""Token sampling for the engine: greedy, temperature and top-p, one seeded random stream per request.

Every row carries its own parameters (temperature [B], top_p [B]) and its own key, derived from the
request's seed and the index of the token being drawn, so a request samples the same tokens whatever
batch it runs in. A row with temperature 0 is greedy (argmax).
"""

from __future__ import annotations

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
