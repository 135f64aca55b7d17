"""Random Nemotron-H weights drawn on the device(s) for the benchmarks (a host draw of 8B is too slow), scaled
like model.random_tensors, and the matmul parameter count of the FLOP estimates. Shared by bench_runtime and
bench_tp."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from metrale_jax import sharding
from metrale_jax.config import ModelConfig
from metrale_jax.weights.checkpoint import expected_tensors


def _stacked_specs(config: ModelConfig):
    """(name, shape, keep_f32) of every tensor, a layer's routed experts stacked [E, ...] under one name."""
    seen = set()
    for name, spec in expected_tensors(config).items():
        if ".experts." in name:
            mixer, rest = name.split(".experts.")
            proj = rest.split(".")[1]
            name = f"{mixer}.experts.{proj}"
            if name in seen:
                continue
            seen.add(name)
            yield name, (config.n_routed_experts, *spec.shape), False
        else:
            yield name, spec.shape, spec.keep_f32


def _init(name: str, shape, config: ModelConfig) -> tuple:
    """How a tensor is drawn, scaled like model.random_tensors: ("normal", scale, mean), ("dt", log lo, log hi)
    (dt_bias: inverse softplus of a log-uniform dt) or ("A_log", lo, hi) (log of a uniform A)."""
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
    if leaf in ("bias", "e_score_correction_bias"):
        return "normal", 0.05, 0.0
    out_map = name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight", "down_proj"))
    return "normal", shape[-1] ** -0.5 * (config.num_hidden_layers ** -0.5 if out_map else 1.0), 0.0


def _draw(init: tuple, shape, key) -> jax.Array:
    kind, a, b = init
    if kind == "normal":
        return jax.random.normal(key, shape, jnp.float32) * a + b
    u = jax.random.uniform(key, shape, jnp.float32, minval=a, maxval=b)
    if kind == "A_log":
        return jnp.log(u)
    dt = jnp.exp(u)
    return dt + jnp.log(-jnp.expm1(-dt))


def device_tensors(config: ModelConfig, dtype, tp: sharding.TensorParallel | None, seed: int = 0):
    """Every tensor drawn on the device(s): with tp, on its shards in the split model's row order."""
    out = {} if tp is None else sharding.ShardedTensors()
    key = jax.random.key(seed)
    for i, (name, shape, keep_f32) in enumerate(_stacked_specs(config)):
        dt = jnp.float32 if keep_f32 else dtype
        if tp is None:
            rows, target = None, jax.sharding.SingleDeviceSharding(jax.devices()[0])
        else:
            layout = sharding.tensor_layout(name, config, tp)
            spec = P(*(tuple(layout.spec) + (None,) * len(shape))[:len(shape)])
            rows, target = layout.rows, tp.sharding(spec)
        gen = _generator(_init(name, shape, config), tuple(shape), jnp.dtype(dt),
                         None if rows is None else tuple(rows.tolist()), target)
        out[name] = gen(jax.random.fold_in(key, i))
    return out


@functools.lru_cache(maxsize=None)
def _generator(init, shape, dtype, rows, target):
    """A compiled draw per (init, shape, dtype, row order, sharding): a few dozen for a whole model."""
    def gen(key):
        x = _draw(init, shape, key)
        return (x if rows is None else x[jnp.asarray(rows)]).astype(dtype)
    return jax.jit(gen, out_shardings=target)


def matmul_params(config: ModelConfig) -> int:
    """Weights a token multiplies (linear maps + lm_head; k of the E routed experts), for the FLOP estimate."""
    n = 0
    for name, spec in expected_tensors(config).items():
        if len(spec.shape) != 2 or name in ("backbone.embeddings.weight",) or "conv1d" in name:
            continue
        if ".experts." in name:
            n += math.prod(spec.shape) * config.num_experts_per_tok / config.n_routed_experts
        elif name.endswith(".gate.weight"):
            continue
        else:
            n += math.prod(spec.shape)
    if config.tie_word_embeddings:
        n += config.vocab_size * config.hidden_size
    return int(n)
