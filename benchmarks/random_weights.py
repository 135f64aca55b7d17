"""Random Nemotron-H weights drawn on the device(s) for the benchmarks, by metrale_jax.init's rules, straight onto
their shards (a layer's routed experts stacked), and the matmul parameter count of the FLOP estimates. Shared by
bench_runtime, bench_e2e_decode and bench_tp."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from metrale_jax import sharding
from metrale_jax.config import ModelConfig
from metrale_jax.init import draw, init_rule
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
        gen = _generator(init_rule(name, shape, config), tuple(shape), jnp.dtype(dt),
                         None if rows is None else tuple(rows.tolist()), target, config)
        out[name] = gen(jax.random.fold_in(key, i))
    return out


@functools.lru_cache(maxsize=None)
def _generator(rule, shape, dtype, rows, target, config):
    """A compiled draw per (rule, shape, dtype, row order, sharding): a few dozen for a whole model."""
    def gen(key):
        x = draw(rule, shape, key, config)
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
