"""NemotronMoELayer: residual + MoE(RMSNorm(x)): routed relu^2 experts plus shared experts.

Router (float32): scores = sigmoid(x W_gate^T); e_score_correction_bias is added only to choose:
the top `topk_group` of `n_group` expert groups (a group's score is the sum of its two best) and
then the top `num_experts_per_tok` experts inside them. The chosen experts' weights are the plain
scores, normalised when norm_topk_prob (denominator + 1e-20), times routed_scaling_factor.
Routed experts see fc1_latent_proj(x) when the config has a latent size, and fc2_latent_proj maps
their weighted sum back; the shared experts see x itself. Exact: no capacity limit, no dropping;
the experts run as two grouped GEMMs (jax.lax.ragged_dot_general) over the token-expert pairs
sorted by expert, so a token's result does not depend on the other tokens in the batch. Experts kept
quantized (StackedExperts: block FP8 or NVFP4) run on the grouped kernels w8a16_grouped / w4a16_grouped,
which must resolve when the experts are installed. LoRA adapters on the routed experts (experts_up_lora /
experts_down_lora, layers/lora.py ExpertLoraOverlay) run beside the grouped GEMMs on the same sorted rows, each
pair on its token's adapter; the expert weights are never touched.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from metrale_jax.config import ModelConfig, ModelLevers
from metrale_jax.errors import ConfigError, WeightFormatError
from metrale_jax.layers.blocks import (PendingResidual, StatelessRows, linear, open_block, optional_param, param,
                                      plus_bias, rows_of, value_of)
from metrale_jax.layers.capabilities import LayerCapabilities
from metrale_jax.layers.checks import check_array, check_layer_index
from metrale_jax.layers.lora import row_adapters
from metrale_jax.layers.mlp import NemotronMlpWeights, Relu2MLP, relu2
from metrale_jax.layers.projection import Projection, QuantWeight
from metrale_jax.weights.containers import Fp8Weight, StackedExperts
from pallas_kernels import registry

HIGHEST = jax.lax.Precision.HIGHEST


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NemotronMoeWeights:
    """The MoE mixer's weights as the checkpoint holds them, the experts stacked along axis 0."""

    gate: jax.Array                       # [E, D] router (kept in float32)
    e_score_correction_bias: jax.Array    # [E] (float32)
    experts_up: jax.Array                 # [E, I, Din]   Din = moe_latent_size or D
    experts_down: jax.Array               # [E, Din, I]
    shared: NemotronMlpWeights | None = None   # [Is, D] / [D, Is]; None when n_shared_experts == 0
    fc1_latent_proj: Any = None           # [Din, D]
    fc2_latent_proj: Any = None           # [D, Din]
    fc1_latent_bias: jax.Array | None = None
    fc2_latent_bias: jax.Array | None = None


def route(logits: jax.Array, correction_bias: jax.Array, *, n_group: int, topk_group: int, top_k: int,
          norm_topk_prob: bool, routed_scaling_factor: float) -> tuple[jax.Array, jax.Array]:
    """Group-limited top-k over sigmoid scores.  logits [T, E] float32 -> (experts [T, k] int32,
    weights [T, k] float32)."""
    T, E = logits.shape
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + correction_bias.astype(jnp.float32)
    if n_group > 1 and topk_group < n_group:
        per_group = E // n_group
        grouped = choice.reshape(T, n_group, per_group)
        group_score = jax.lax.top_k(grouped, min(2, per_group))[0].sum(-1)             # [T, n_group]
        _, keep = jax.lax.top_k(group_score, topk_group)                                # [T, topk_group]
        group_mask = jnp.zeros((T, n_group), bool).at[jnp.arange(T)[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(group_mask, per_group, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, top_k)                                          # [T, k]
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return experts.astype(jnp.int32), weights * routed_scaling_factor


def grouped_kernel(experts: StackedExperts) -> str:
    """The registry name of the grouped kernel that serves quantized experts."""
    return "w8a16_grouped" if isinstance(experts.member, Fp8Weight) else "w4a16_grouped"


def _grouped_matmul(x: jax.Array, w, group_sizes: jax.Array, kernels: str | None) -> jax.Array:
    """Rows of x [M, K] sorted by group, times that group's w [E, N, K] (stored out, in) -> [M, N] f32;
    w a dense stack or StackedExperts."""
    if isinstance(w, StackedExperts):
        m, fn = w.member, registry.get(grouped_kernel(w), kernels)
        if isinstance(m, Fp8Weight):
            return fn(x, m.weight, m.scale, group_sizes)
        return fn(x, m.packed, m.scale, m.global_scale, group_sizes)
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))
    return jax.lax.ragged_dot_general(x, w.astype(x.dtype), group_sizes, dims, preferred_element_type=jnp.float32)


def routed_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, up, down,
                   kernels: str | None = None, lora=None) -> jax.Array:
    """sum_j weights[t, j] * down_e(relu(up_e(x_t))^2) over the chosen e = experts[t, j].
    x [T, Din], experts / weights [T, k], up [E, I, Din], down [E, Din, I] (dense or StackedExperts)
    -> [T, Din] float32. A pair whose expert id is E (one held by another device) joins no group: its rows
    come out 0. lora: (up overlay or None, down overlay or None, rows [T] each token's adapter index): each
    expert's low-rank terms added to its grouped GEMMs' float32 outputs (layers/lora.py)."""
    T, k = experts.shape
    E = up.shape[0]
    flat = experts.reshape(-1)                                    # [T*k] pair p = t*k + j
    order = jnp.argsort(flat, stable=True)                        # pairs sorted by expert
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    xs = x[order // k]                                            # [T*k, Din]
    u = _grouped_matmul(xs, up, sizes, kernels)                   # [T*k, I] f32
    if lora is not None and lora[0] is not None:
        u = u + lora[0].delta(xs, sizes, lora[2][order // k])
    h = relu2(u).astype(x.dtype)                                  # [T*k, I]
    o = _grouped_matmul(h, down, sizes, kernels)                  # [T*k, Din] f32
    if lora is not None and lora[1] is not None:
        o = o + lora[1].delta(h, sizes, lora[2][order // k])
    back = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    o = o[back].reshape(T, k, -1)                                 # back to (token, choice) order
    return jnp.einsum("tk,tkd->td", weights.astype(jnp.float32), o, precision=HIGHEST)


def _experts(name: str, value, shape: tuple[int, int, int], kernels: str | None):
    """A layer's routed experts: an nnx.Param holding the dense stack, or a QuantWeight holding
    StackedExperts (whose grouped kernel must resolve now, not at the first token)."""
    if not isinstance(value, StackedExperts):
        return param(name, value, shape)
    if tuple(value.shape) != tuple(shape):
        raise WeightFormatError(f"{name}: stacked experts must be {list(shape)}, got {list(value.shape)}")
    registry.resolve(grouped_kernel(value), kernels)
    return QuantWeight(value)


def _read(v):
    return v.get_value() if isinstance(v, QuantWeight) else v[...]


class NemotronMoELayer(StatelessRows, LayerCapabilities, nnx.Module):
    """A Nemotron-H MoE block (pattern character E)."""

    supports_replay_tail_split = True
    block_kind = "moe"
    # mesh axis the expert-parallel partial sums are reduced over; set on a device view (sharding.py)
    tp_axis: str | None = None

    def __init__(self, input_norm, moe: NemotronMoeWeights, config: ModelConfig, layer_idx: int, *,
                 levers: ModelLevers | None = None, expert_shards: int = 1):
        """expert_shards: the routed experts are split in that many equal parts and this layer holds one
        (expert parallelism: a device view holds E / tp experts; the router still sees all E)."""
        check_layer_index(config, layer_idx, "E")
        levers = levers or ModelLevers()
        c = config
        self._config = config                     # shown once, by the model (LayerCapabilities.config)
        self.layer_idx = layer_idx
        self.kernels = levers.kernels
        name = f"backbone.layers.{layer_idx}"
        D, E, I = c.hidden_size, c.n_routed_experts, c.moe_intermediate_size
        Din = c.moe_latent_size or D
        if expert_shards < 1 or E % expert_shards:
            raise ConfigError("n_routed_experts", f"{E} is not divisible into expert_shards={expert_shards}")
        El = E // expert_shards
        self.input_norm = param(f"{name}.norm.weight", input_norm, (D,))
        self.gate = nnx.Param(param(f"{name}.mixer.gate.weight", moe.gate, (E, D))[...].astype(jnp.float32))
        self.e_score_correction_bias = nnx.Param(param(
            f"{name}.mixer.gate.e_score_correction_bias", moe.e_score_correction_bias, (E,))[...].astype(jnp.float32))
        self.experts_up = _experts(f"{name}.mixer.experts.*.up_proj.weight", moe.experts_up, (El, I, Din),
                                   self.kernels)
        self.experts_down = _experts(f"{name}.mixer.experts.*.down_proj.weight", moe.experts_down, (El, Din, I),
                                     self.kernels)
        self.experts_up_lora = nnx.data(None)       # ExpertLoraOverlay once an adapter targets the routed experts
        self.experts_down_lora = nnx.data(None)
        if c.n_shared_experts:
            if moe.shared is None:
                raise WeightFormatError(f"{name}.mixer.shared_experts: missing, but n_shared_experts is "
                                        f"{c.n_shared_experts}")
            self.shared_experts = nnx.data(Relu2MLP(f"{name}.mixer.shared_experts", D,
                                                    c.moe_shared_expert_intermediate_size, moe.shared,
                                                    bias=c.mlp_bias, kernels=self.kernels))
        else:
            if moe.shared is not None:
                raise WeightFormatError(f"{name}.mixer.shared_experts: given, but n_shared_experts is 0")
            self.shared_experts = nnx.data(None)
        latent = (moe.fc1_latent_proj, moe.fc2_latent_proj)
        if c.moe_latent_size is None:
            if any(p is not None for p in latent):
                raise WeightFormatError(f"{name}.mixer.fc1/fc2_latent_proj: given, but moe_latent_size is null")
            self.fc1_latent_proj = nnx.data(None)
            self.fc2_latent_proj = nnx.data(None)
        else:
            if any(p is None for p in latent):
                raise WeightFormatError(f"{name}.mixer.fc1/fc2_latent_proj: missing, but moe_latent_size is "
                                        f"{c.moe_latent_size}")
            self.fc1_latent_proj = nnx.data(Projection(f"{name}.mixer.fc1_latent_proj", Din, D, kernels=self.kernels))
            self.fc2_latent_proj = nnx.data(Projection(f"{name}.mixer.fc2_latent_proj", D, Din, kernels=self.kernels))
            self.fc1_latent_proj.set_weight(moe.fc1_latent_proj)     # each container in the arm its type names
            self.fc2_latent_proj.set_weight(moe.fc2_latent_proj)
        biases = (moe.fc1_latent_bias, moe.fc2_latent_bias)
        want_bias = c.mlp_bias and c.moe_latent_size is not None
        if any((b is not None) != want_bias for b in biases):
            raise WeightFormatError(f"{name}.mixer.fc1/fc2_latent_proj.bias: given {[b is not None for b in biases]}, "
                                    f"expected {want_bias} (mlp_bias and moe_latent_size)")
        self.fc1_latent_bias = optional_param(f"{name}.mixer.fc1_latent_proj.bias", moe.fc1_latent_bias, (Din,))
        self.fc2_latent_bias = optional_param(f"{name}.mixer.fc2_latent_proj.bias", moe.fc2_latent_bias, (D,))

    def moe_weights(self) -> NemotronMoeWeights:
        own = lambda p: None if p is None else p.base_weight()
        return NemotronMoeWeights(
            gate=self.gate[...], e_score_correction_bias=self.e_score_correction_bias[...],
            experts_up=_read(self.experts_up), experts_down=_read(self.experts_down),
            shared=None if self.shared_experts is None else self.shared_experts.weights(),
            fc1_latent_proj=own(self.fc1_latent_proj), fc2_latent_proj=own(self.fc2_latent_proj),
            fc1_latent_bias=value_of(self.fc1_latent_bias), fc2_latent_bias=value_of(self.fc2_latent_bias))

    checkpoint_weights = moe_weights          # what every block kind answers (the model's state_dict)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Router on normalised rows x [T, D]: (experts [T, k] int32, weights [T, k] float32)."""
        c = self.config
        logits = jnp.einsum("td,ed->te", x.astype(jnp.float32), self.gate[...], precision=HIGHEST)
        return route(logits, self.e_score_correction_bias[...], n_group=c.n_group, topk_group=c.topk_group,
                     top_k=c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob,
                     routed_scaling_factor=c.routed_scaling_factor)

    def _expert_lora(self, tokens: int):
        """(up overlay, down overlay, each token's adapter index [T]) for routed_experts, or None when no adapter
        targets the routed experts or no adapter table is in scope."""
        if self.experts_up_lora is None and self.experts_down_lora is None:
            return None
        rows = row_adapters(f"backbone.layers.{self.layer_idx}.mixer.experts", tokens)
        return None if rows is None else (self.experts_up_lora, self.experts_down_lora, rows)

    def mixer(self, x: jax.Array, *, phase: str = "prefill") -> jax.Array:
        """The MoE on normalised rows.  x [T, D] -> [T, D] in x.dtype."""
        if self.tp_axis is not None:
            return self._mixer_expert_parallel(x, phase)
        experts, weights = self.route(x)
        xl = x if self.fc1_latent_proj is None else linear(self.fc1_latent_proj, self.fc1_latent_bias, x, phase)
        y = routed_experts(xl, experts, weights, _read(self.experts_up), _read(self.experts_down),
                           self.kernels, self._expert_lora(x.shape[0])).astype(x.dtype)
        if self.fc2_latent_proj is not None:
            y = linear(self.fc2_latent_proj, self.fc2_latent_bias, y, phase)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x, phase=phase)
        return y

    def _mixer_expert_parallel(self, x: jax.Array, phase: str) -> jax.Array:
        """`mixer` on one device of a mesh axis: the replicated router chooses among all E experts; this
        device adds the contributions of the E/tp experts it holds (pairs routed elsewhere get weight 0 and
        no group) and its share of the shared experts, and one psum over the axis sums the shares."""
        experts, weights = self.route(x)
        xl = x if self.fc1_latent_proj is None else linear(self.fc1_latent_proj, self.fc1_latent_bias, x, phase)
        El = _read(self.experts_up).shape[0]
        local = experts - jax.lax.axis_index(self.tp_axis) * El
        mine = (local >= 0) & (local < El)
        y = routed_experts(xl, jnp.where(mine, local, El), jnp.where(mine, weights, 0.0), _read(self.experts_up),
                           _read(self.experts_down), self.kernels, self._expert_lora(x.shape[0]))   # [T, Din] f32
        if self.fc2_latent_proj is not None:
            y = self.fc2_latent_proj(y.astype(x.dtype), phase=phase, out_dtype=jnp.float32)
        if self.shared_experts is not None:
            y = y + self.shared_experts.partial_sum(x, phase=phase)
        y = jax.lax.psum(y, self.tp_axis)
        y = plus_bias(y, self.fc2_latent_bias)
        if self.shared_experts is not None:
            y = plus_bias(y, self.shared_experts.down_bias)
        return y.astype(x.dtype)

    def __call__(self, hidden: jax.Array | PendingResidual, *, phase: str = "prefill",
                 hand_on: bool = False) -> jax.Array:
        """hidden [T, D] -> hidden + moe(norm(hidden)), rows independent. A pending residual from the block
        before is added in the input norm (layers/blocks.py); the output is always an array (hand_on has nothing
        to hand on: the experts' sum is not one projection's)."""
        check_array("hidden", rows_of(hidden), (None, self.config.hidden_size), floating=True)
        hidden, x = open_block(hidden, self.input_norm[...], eps=self.config.layer_norm_epsilon, kernels=self.kernels)
        return hidden + self.mixer(x, phase=phase)
