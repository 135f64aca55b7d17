"""Random weights for a config (tests, benchmarks, training from scratch): one rule per tensor name, scaled like
HF's init, drawn with jax.random from one key per tensor (the key folded with the tensor's index in the checkpoint
table), so a tensor's values do not depend on how or where the others are drawn.

Rules: linear maps ~ N(0, 1/fan_in) (output maps further / sqrt(layers)); norms and D ~ 1 + 0.1 N; embeddings
~ N(0, 1); dt_bias the inverse softplus of dt log-uniform in [time_step_min, time_step_max] (floored at
time_step_floor), A_log the log of a uniform A in [1, 16], as Mamba-2 inits them; conv weights N / sqrt(width);
small random biases (the MoE router's e_score_correction_bias included, so its choice-only effect is exercised).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp

from metrale_jax.config import ModelConfig
from metrale_jax.layers.mamba2 import NemotronSsmWeights
from metrale_jax.weights.checkpoint import expected_tensors, layer_weights, mtp_tensors

_OUT_PROJECTIONS = ("out_proj.weight", "o_proj.weight", "down_proj.weight", "fc2_latent_proj.weight", "down_proj")


def init_rule(name: str, shape: tuple[int, ...], config: ModelConfig) -> tuple:
    """How tensor `name` is drawn: ("normal", scale, mean), ("dt", log lo, log hi) or ("A_log", lo, hi)."""
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight") or name == "backbone.norm_f.weight" or leaf == "D":
        return "normal", 0.1, 1.0
    if name == "backbone.embeddings.weight":
        return "normal", 1.0, 0.0
    if leaf == "dt_bias":
        return "dt", math.log(config.time_step_min), math.log(config.time_step_max)
    if leaf == "A_log":
        return "A_log", 1.0, 16.0
    if name.endswith("conv1d.weight"):
        return "normal", config.conv_kernel ** -0.5, 0.0
    if name.endswith("conv1d.bias"):
        return "normal", 0.1, 0.0
    if leaf == "e_score_correction_bias":
        return "normal", 0.05, 0.0
    if leaf == "bias":
        return "normal", 0.02, 0.0
    depth = config.num_hidden_layers ** -0.5 if name.endswith(_OUT_PROJECTIONS) else 1.0
    return "normal", shape[-1] ** -0.5 * depth, 0.0


def draw(rule: tuple, shape: tuple[int, ...], key: jax.Array, config: ModelConfig) -> jax.Array:
    """A float32 tensor of `shape` drawn by `rule` (init_rule)."""
    kind, a, b = rule
    if kind == "normal":
        return jax.random.normal(key, shape, jnp.float32) * a + b
    u = jax.random.uniform(key, shape, jnp.float32, minval=a, maxval=b)
    if kind == "A_log":
        return jnp.log(u)
    dt = jnp.maximum(jnp.exp(u), config.time_step_floor)
    return dt + jnp.log(-jnp.expm1(-dt))                                   # inverse softplus


def tensor_table(config: ModelConfig, *, mtp: bool = True) -> dict:
    """Every tensor a checkpoint of `config` holds, in order (the MTP head's after the main ones): name -> spec."""
    return {**expected_tensors(config), **(mtp_tensors(config) if mtp else {})}


def iter_random_tensors(config: ModelConfig, key: jax.Array, *, mtp: bool = True) -> Iterator[tuple[str, jax.Array]]:
    """(name, float32 array) of every tensor, drawn one at a time on the default device."""
    for i, (name, spec) in enumerate(tensor_table(config, mtp=mtp).items()):
        yield name, draw(init_rule(name, spec.shape, config), spec.shape, jax.random.fold_in(key, i), config)


def random_tensors(config: ModelConfig, key: jax.Array, dtype=jnp.bfloat16, *, mtp: bool = True) -> dict:
    """Random weights under HF names, in `dtype` except those the checkpoint table keeps in float32. With
    num_nextn_predict_layers > 0 (and mtp) the MTP head's tensors are drawn too; the main ones stay the same."""
    table = tensor_table(config, mtp=mtp)
    return {n: v.astype(jnp.float32 if table[n].keep_f32 else dtype) for n, v in iter_random_tensors(config, key,
                                                                                                     mtp=mtp)}


def random_ssm_weights(config: ModelConfig, key: jax.Array, dtype=jnp.bfloat16) -> NemotronSsmWeights:
    """One Mamba-2 mixer's weights (those of the config's first Mamba layer), drawn by the same rules."""
    i = config.mamba_layer_ids[0]
    prefix = f"backbone.layers.{i}."
    table = {n: s for n, s in expected_tensors(config).items() if n.startswith(prefix)}
    keys = jax.random.split(key, len(table))
    tensors = {n: draw(init_rule(n, s.shape, config), s.shape, k, config).astype(jnp.float32 if s.keep_f32 else dtype)
               for k, (n, s) in zip(keys, table.items())}
    return layer_weights(config, i, tensors)[1]


def random_norm(config: ModelConfig, key: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """An RMSNorm weight [hidden] ~ 1 + 0.1 N."""
    return (1.0 + 0.1 * jax.random.normal(key, (config.hidden_size,))).astype(dtype)
