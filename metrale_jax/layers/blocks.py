"""Small pieces the attention, MLP and MoE blocks share: optional-bias linear maps and parameter checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from metrale_jax.errors import ShapeError
from metrale_jax.layers.projection import Projection
from metrale_jax.weights.containers import DenseWeight, as_dense
from pallas_kernels import norm_fp8, registry
from pallas_kernels.triton_util import columns


def linear(proj: Projection, bias, x: jax.Array, phase: str) -> jax.Array:
    """proj(x) (+ bias, added to the float32 accumulator before the one rounding to x.dtype)."""
    if bias is None:
        return proj(x, phase=phase)
    y = proj(x, phase=phase, out_dtype=jnp.float32) + bias[...].astype(jnp.float32)
    return y.astype(x.dtype)


def input_rmsnorm(hidden: jax.Array, weight: jax.Array, *, eps: float, projections: tuple[Projection, ...],
                  phase: str, kernels: str | None):
    """A block's input RMSNorm in front of `projections` (which all read its output). In decode, where each of
    them rounds its activations to E4M3 per 128 columns itself (w8a8_gemv) and the fused norm takes the width, the
    norm hands them over quantized (norm_fp8): the same bits, one quantization fewer per step. Prefill and LoRA
    overlays (their low-rank term reads the unquantized rows) keep the bf16 norm."""
    width = hidden.shape[-1]
    if (phase == "decode" and all(p.input_quant(phase, hidden.shape[0]) == "blocks" and p.lora is None
                                  for p in projections)
            and registry.resolved("rmsnorm_fp8", kernels) and norm_fp8.supports(width, width, per_block=True)):
        return registry.get("rmsnorm_fp8", kernels)(hidden, weight, eps=eps, per_block=True)
    return registry.get("rmsnorm", kernels)(hidden, weight, eps=eps)


def reduced_linear(proj: Projection, bias, x: jax.Array, phase: str, axis: str) -> jax.Array:
    """`linear` on a tensor-parallel device: this device's partial proj(x) (x split by input column) in
    float32, summed over `axis` (the block's one all-reduce), then the bias once, then one rounding."""
    return plus_bias(jax.lax.psum(proj(x, phase=phase, out_dtype=jnp.float32), axis), bias).astype(x.dtype)


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

    def decode_rows(self, pool, rows, hidden: jax.Array):
        """The block loop's decode / verify: hidden [n*k, D], no pool."""
        return self(hidden, phase="decode"), pool, None

    def decode_multi_seq(self, hidden: jax.Array) -> jax.Array:
        """One token for each of N sequences.  hidden [N, D]."""
        return self(hidden, phase="decode")

    def prefill_replay_tail(self, hidden: jax.Array, cut: int):
        """The rows are the same however the prefill is split: (hidden out, no captured state)."""
        if not 0 <= cut <= hidden.shape[0]:
            raise ShapeError(f"cut: must lie in [0, {hidden.shape[0]}], got {cut}")
        return self(hidden), None
