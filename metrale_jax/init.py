"""Random weights for a config (tests, benchmarks, training from scratch), scaled like HF's init."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from metrale_jax.config import ModelConfig
from metrale_jax.layers.mamba2 import NemotronSsmWeights
from metrale_jax.weights.containers import DenseWeight


def _normal(key, shape, scale, dtype):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def random_ssm_weights(config: ModelConfig, key: jax.Array, dtype=jnp.bfloat16) -> NemotronSsmWeights:
    """Mixer weights with dt in [time_step_min, time_step_max] and A in [-16, -1], as Mamba-2 inits them."""
    c = config
    k = jax.random.split(key, 8)
    H, I, C, D = c.mamba_num_heads, c.d_inner, c.conv_dim, c.hidden_size
    dt = jnp.exp(jax.random.uniform(k[0], (H,)) * (math.log(c.time_step_max) - math.log(c.time_step_min))
                 + math.log(c.time_step_min))
    dt = jnp.maximum(dt, c.time_step_floor)
    return NemotronSsmWeights(
        in_proj=DenseWeight(_normal(k[1], (c.in_proj_dim, D), D ** -0.5, dtype)),
        out_proj=DenseWeight(_normal(k[2], (D, I), I ** -0.5 / math.sqrt(max(c.num_hidden_layers, 1)), dtype)),
        conv1d_weight=_normal(k[3], (C, c.conv_kernel), c.conv_kernel ** -0.5, dtype),
        conv1d_bias=_normal(k[4], (C,), 0.1, dtype) if c.use_conv_bias else None,
        dt_bias=(dt + jnp.log(-jnp.expm1(-dt))).astype(jnp.float32),
        A_log=jnp.log(jax.random.uniform(k[5], (H,), minval=1.0, maxval=16.0)).astype(jnp.float32),
        D=(1.0 + 0.1 * jax.random.normal(k[6], (H,))).astype(jnp.float32),
        norm_weight=(1.0 + 0.1 * jax.random.normal(k[7], (I,))).astype(dtype),
    )


def random_norm(config: ModelConfig, key: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    return (1.0 + 0.1 * jax.random.normal(key, (config.hidden_size,))).astype(dtype)
