"""NemotronMLPLayer: residual + down_proj(relu(up_proj(RMSNorm(x)))^2); no gate.

`Relu2MLP` (the two projections alone) is shared with the MoE layer's shared experts. The layer is
stateless: every row is computed on its own, so decode and prefill are the same call.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from metrale_jax.config import ModelConfig, ModelLevers
from metrale_jax.errors import WeightFormatError
from metrale_jax.layers.blocks import (PendingResidual, StatelessRows, close_block, close_block_across_devices,
                                      input_rmsnorm, linear, optional_param, param, rows_of, value_of)
from metrale_jax.layers.capabilities import LayerCapabilities
from metrale_jax.layers.checks import check_array, check_layer_index
from metrale_jax.layers.projection import Projection
from pallas_kernels.epilogues import relu2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NemotronMlpWeights:
    """An MLP's weights as the checkpoint holds them (biases only with mlp_bias)."""

    up_proj: Any                       # [I, D]
    down_proj: Any                     # [D, I]
    up_bias: jax.Array | None = None   # [I]
    down_bias: jax.Array | None = None  # [D]


class Relu2MLP(nnx.Module):
    """down_proj(relu(up_proj(x))^2) with optional biases; `name` prefixes every tensor name."""

    def __init__(self, name: str, hidden_size: int, intermediate_size: int, weights: NemotronMlpWeights, *,
                 bias: bool, kernels: str | None = None):
        self.name = name
        given = (weights.up_bias is not None, weights.down_bias is not None)
        if given != (bias, bias):
            raise WeightFormatError(f"{name}: biases given {given} (up, down), but mlp_bias is {bias}")
        self.up_proj = Projection(f"{name}.up_proj", intermediate_size, hidden_size, kernels=kernels)
        self.down_proj = Projection(f"{name}.down_proj", hidden_size, intermediate_size, kernels=kernels)
        self.up_proj.set_weight(weights.up_proj)          # each container in the arm its type names
        self.down_proj.set_weight(weights.down_proj)
        self.up_bias = optional_param(f"{name}.up_proj.bias", weights.up_bias, (intermediate_size,))
        self.down_bias = optional_param(f"{name}.down_proj.bias", weights.down_bias, (hidden_size,))

    def weights(self) -> NemotronMlpWeights:
        return NemotronMlpWeights(self.up_proj.base_weight(), self.down_proj.base_weight(),
                                  up_bias=value_of(self.up_bias), down_bias=value_of(self.down_bias))

    def bf16_native_ready(self) -> bool:
        return self.up_proj.dense_ready() and self.down_proj.dense_ready()

    def __call__(self, x: jax.Array, *, phase: str = "prefill") -> jax.Array:
        """x [T, D] -> [T, D] in x.dtype; relu^2 is applied to the float32 accumulator."""
        return linear(self.down_proj, self.down_bias, self.act(x, phase), phase)

    def partial_sum(self, x: jax.Array, *, phase: str = "prefill") -> jax.Array:
        """Tensor parallel: this device's share of down_proj(act) in float32 [T, D], without the down bias
        (the caller sums the shares over the mesh axis and adds the bias once)."""
        return self.down_proj(self.act(x, phase), phase=phase, out_dtype=jnp.float32)

    def act(self, x: jax.Array, phase: str) -> jax.Array:
        """relu(up_proj(x) + up_bias)^2 [T, I] in x.dtype, relu^2 on the float32 sum (without a bias, in the
        up_proj kernel's epilogue where it takes one: no separate elementwise kernel)."""
        if self.up_bias is None:
            return self.up_proj(x, phase=phase, out_dtype=x.dtype, epilogue="relu2")
        u = self.up_proj(x, phase=phase, out_dtype=jnp.float32) + self.up_bias[...].astype(jnp.float32)
        return relu2(u).astype(x.dtype)


class NemotronMLPLayer(StatelessRows, LayerCapabilities, nnx.Module):
    """A Nemotron-H MLP block (pattern character -)."""

    supports_replay_tail_split = True
    block_kind = "mlp"
    # mesh axis down_proj's partial sums are reduced over; set on a tensor-parallel device view (sharding.py)
    tp_axis: str | None = None

    def __init__(self, input_norm, mlp: NemotronMlpWeights, config: ModelConfig, layer_idx: int, *,
                 levers: ModelLevers | None = None):
        check_layer_index(config, layer_idx, "-")
        levers = levers or ModelLevers()
        self._config = config                     # shown once, by the model (LayerCapabilities.config)
        self.layer_idx = layer_idx
        self.kernels = levers.kernels
        name = f"backbone.layers.{layer_idx}"
        D = config.hidden_size
        self.input_norm = param(f"{name}.norm.weight", input_norm, (D,))
        self.mlp = Relu2MLP(f"{name}.mixer", D, config.intermediate_size, mlp, bias=config.mlp_bias,
                            kernels=self.kernels)

    def bf16_native_ready(self) -> bool:
        return self.mlp.bf16_native_ready()

    def mlp_weights(self) -> NemotronMlpWeights:
        return self.mlp.weights()

    checkpoint_weights = mlp_weights          # what every block kind answers (the model's state_dict)

    def __call__(self, hidden: jax.Array | PendingResidual, *, phase: str = "prefill", hand_on: bool = False):
        """hidden [T, D] -> hidden + mlp(norm(hidden)), rows independent. In the block loop's decode the stream
        may come in and (hand_on) go out as a PendingResidual (layers/blocks.py)."""
        check_array("hidden", rows_of(hidden), (None, self.config.hidden_size), floating=True)
        hidden, x = input_rmsnorm(hidden, self.input_norm[...], eps=self.config.layer_norm_epsilon,
                                  projections=(self.mlp.up_proj,), phase=phase, kernels=self.kernels)
        if self.tp_axis is not None:
            return close_block_across_devices(hidden, self.mlp.partial_sum(x, phase=phase), self.mlp.down_bias,
                                              self.tp_axis, phase, hand_on)
        return close_block(hidden, self.mlp.down_proj, self.mlp.act(x, phase), phase, hand_on, bias=self.mlp.down_bias)
