"""Small pieces the blocks share: a block's opening (input RMSNorm) and closing (residual add), optional-bias
linear maps and parameter checks.

In decode a block may close with its output projection's split-K partials not yet added (`PendingResidual`;
where the projection has none to hand on, e.g. a dense arm, or on a tensor-parallel device after the all-reduce,
its float32 output as one partial): the next block opens by adding them to the residual stream and normalising
the sum in one kernel (norms.add_rmsnorm), where the plain order takes two (the partials' sum + residual add, the
norm). The same bits either way; `settled` adds them alone where no norm follows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from metrale_jax.errors import ShapeError
from metrale_jax.layers.projection import Projection
from metrale_jax.weights.containers import DenseWeight, as_dense
from pallas_kernels import norm_fp8, registry
from pallas_kernels.split_partials import SplitPartials, chain_sum, of_output
from pallas_kernels.triton_util import columns


def linear(proj: Projection, bias, x: jax.Array, phase: str) -> jax.Array:
    """proj(x) (+ bias, added to the float32 accumulator before the one rounding to x.dtype)."""
    if bias is None:
        return proj(x, phase=phase)
    y = proj(x, phase=phase, out_dtype=jnp.float32) + bias[...].astype(jnp.float32)
    return y.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class PendingResidual:
    """The residual stream after a decode block whose output projection handed on its split-K partials (on a
    tensor-parallel device: its all-reduced output, one partial): hidden + (the partials' sum in split order,
    rounded to hidden's dtype).  hidden [M, D], partials [S, R >= M, D]."""
    hidden: jax.Array
    partials: SplitPartials


def settled(hidden: jax.Array | PendingResidual) -> jax.Array:
    """The residual stream as an array (a PendingResidual's partials added: what the block would have returned)."""
    if not isinstance(hidden, PendingResidual):
        return hidden
    h = hidden.hidden
    return h + chain_sum(hidden.partials, h.shape[0]).astype(h.dtype)


def rows_of(hidden: jax.Array | PendingResidual) -> jax.Array:
    """The array that fixes the stream's shape and dtype (for argument checks)."""
    return hidden.hidden if isinstance(hidden, PendingResidual) else hidden


def open_block(hidden: jax.Array | PendingResidual, weight: jax.Array, *, eps: float, kernels: str | None,
               fp8: dict | None = None) -> tuple[jax.Array, jax.Array]:
    """(the residual stream as an array, the block's normalised input) for a stream [M, D] or a PendingResidual.
    fp8: rmsnorm_fp8's keyword arguments where the norm hands its output on quantized; else the plain RMSNorm.
    A pending residual add is fused into either (add_rmsnorm, add_rmsnorm_fp8) where that kernel resolves, else
    the stream is settled first: the same bits."""
    if isinstance(hidden, PendingResidual):
        fused = "add_rmsnorm" if fp8 is None else "add_rmsnorm_fp8"
        if registry.resolved(fused, kernels):
            return registry.get(fused, kernels)(hidden.hidden, hidden.partials, weight, eps=eps, **(fp8 or {}))
    hidden = settled(hidden)
    if fp8 is not None:
        return hidden, registry.get("rmsnorm_fp8", kernels)(hidden, weight, eps=eps, **fp8)
    return hidden, registry.get("rmsnorm", kernels)(hidden, weight, eps=eps)


def close_block(hidden: jax.Array, proj: Projection, x: jax.Array, phase: str, hand_on: bool,
                bias=None) -> jax.Array | PendingResidual:
    """hidden + proj(x) (+ bias, added to the float32 accumulator). With hand_on in decode, a PendingResidual: the
    projection's split partials where its GEMV hands them on, else its float32 output (+ bias) as one partial
    (a dense arm, a LoRA overlay, ...): the next norm rounds and adds it, the same bits."""
    if not (hand_on and phase == "decode"):
        return hidden + linear(proj, bias, x, phase)
    if bias is None and proj.hands_on_partials(phase, x.shape[0]):
        return PendingResidual(hidden, proj.partials(x, phase=phase))
    return PendingResidual(hidden, of_output(plus_bias(proj(x, phase=phase, out_dtype=jnp.float32), bias)))


def close_block_across_devices(hidden: jax.Array, partial: jax.Array, bias, axis: str, phase: str,
                               hand_on: bool) -> jax.Array | PendingResidual:
    """hidden + (all-reduce of partial + bias) on a tensor-parallel device: partial [M, D] this device's float32
    share of the block's last projection (x split by input column), summed over `axis` (the block's one
    all-reduce), the bias added once, rounded once to hidden's dtype. With hand_on in decode, a PendingResidual
    holding the sum as one partial, so the next norm adds it (the same bits)."""
    y = plus_bias(jax.lax.psum(partial, axis), bias)
    if hand_on and phase == "decode":
        return PendingResidual(hidden, of_output(y))
    return hidden + y.astype(hidden.dtype)


def input_rmsnorm(hidden: jax.Array | PendingResidual, weight: jax.Array, *, eps: float,
                  projections: tuple[Projection, ...], phase: str, kernels: str | None):
    """A block's input RMSNorm in front of `projections` (which all read its output): (stream, normalised rows),
    as `open_block`. In decode, where each of them rounds its activations to E4M3 per 128 columns itself
    (w8a8_gemv) and the fused norm takes the width, the norm hands them over quantized (norm_fp8): the same bits,
    one quantization fewer per step. Prefill and LoRA overlays (their low-rank term reads the unquantized rows)
    keep the bf16 norm."""
    rows = rows_of(hidden)
    width = rows.shape[-1]
    quantized = (phase == "decode" and all(p.input_quant(phase, rows.shape[0]) == "blocks" and p.lora is None
                                           for p in projections)
                 and registry.resolved("rmsnorm_fp8", kernels) and norm_fp8.supports(width, width, per_block=True))
    return open_block(hidden, weight, eps=eps, kernels=kernels, fp8=dict(per_block=True) if quantized else None)


def gated_rmsnorm_across_devices(y: jax.Array, z: jax.Array, weight: jax.Array, *, group_size: int, eps: float,
                                 axis: str, z_col: int | None = None, out_dtype=None) -> jax.Array:
    """The Mamba-2 gated group norm rmsnorm_group(y * silu(z)) * weight on a tensor-parallel device that holds
    channels [d*W, (d+1)*W) of the global width, where a group of `group_size` global channels may be split over
    devices: each group's sum of squares is summed over `axis` (one all-reduce of [..., groups] floats).
    y [..., W], z [..., W] (or its columns [z_col, z_col + W)), weight [W] (this device's channels)."""
    W = y.shape[-1]
    z = columns(z, z_col, W)
    h = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))                # [..., W]
    groups = -(-W * jax.lax.axis_size(axis) // group_size)
    gid = (jax.lax.axis_index(axis) * W + jnp.arange(W)) // group_size              # [W] global group per channel
    sums = jnp.zeros((*h.shape[:-1], groups), jnp.float32).at[..., gid].add(h * h)  # [..., groups]
    var = jax.lax.psum(sums, axis)[..., gid] / group_size                           # [..., W]
    return (h * jax.lax.rsqrt(var + eps) * weight.astype(jnp.float32)).astype(out_dtype or y.dtype)


def plus_bias(y: jax.Array, bias) -> jax.Array:
    """A float32 accumulator y + an optional bias Param (in float32)."""
    return y if bias is None else y + bias[...].astype(jnp.float32)


def param(name: str, value, shape: tuple[int, ...]) -> nnx.Param:
    """An nnx.Param from an array (or DenseWeight), checking its shape and that it is floating."""
    arr = value.weight if isinstance(value, DenseWeight) else jnp.asarray(value)
    return nnx.Param(as_dense(name, arr, shape).weight)


def optional_param(name: str, value, shape: tuple[int, ...]):
    """`param` for an optional tensor (a bias): None stays None (declared as data for the pytree)."""
    return nnx.data(None if value is None else param(name, value, shape))


def value_of(p):
    """The array of an optional Param, or None."""
    return None if p is None else p[...]


class StatelessRows:
    """Entry points of a block whose rows are independent (MLP, MoE): decoding and a replay-tail split are
    the plain call, and there is no state to capture."""

    def prefill_rows(self, pool, rows, hidden: jax.Array):
        """The block loop's prefill (layers/stack.py): hidden [B, T, D], no pool."""
        B, T, D = hidden.shape
        return self(hidden.reshape(B * T, D), phase="prefill").reshape(B, T, D), pool, None

    def decode_rows(self, pool, rows, hidden: jax.Array | PendingResidual):
        """The block loop's decode / verify: hidden [n*k, D] (or pending), no pool; may hand on its residual."""
        return self(hidden, phase="decode", hand_on=True), pool, None

    def decode_multi_seq(self, hidden: jax.Array) -> jax.Array:
        """One token for each of N sequences.  hidden [N, D]."""
        return self(hidden, phase="decode")

    def prefill_replay_tail(self, hidden: jax.Array, cut: int):
        """The rows are the same however the prefill is split: (hidden out, no captured state)."""
        if not 0 <= cut <= hidden.shape[0]:
            raise ShapeError(f"cut: must lie in [0, {hidden.shape[0]}], got {cut}")
        return self(hidden), None
