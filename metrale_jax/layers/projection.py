"""Projection: one linear map (in_proj, out_proj, ...) holding the weight copies installed for it.

Each installed copy is an *arm*; a call picks the first arm, in the phase's fixed order, whose
weights are installed. Only the dense BF16 arm exists so far; the quantized arms plug into
`DECODE_ORDER` / `PREFILL_ORDER`.
"""

from __future__ import annotations

import jax
from flax import nnx

from metrale_jax.errors import KernelUnavailableError, ShapeError, WeightFormatError
from metrale_jax.weights.containers import DenseWeight, as_dense
from pallas_kernels import registry

DECODE_ORDER = ("bf16_native",)
PREFILL_ORDER = ("bf16_native",)
ARM_KERNELS = {"bf16_native": ("dense_matmul",)}


class Projection(nnx.Module):
    """y = x W^T with W [N, K]; `name` is used in every error."""

    def __init__(self, name: str, out_features: int, in_features: int, *, kernels: str | None = None):
        self.name = name
        self.out_features = out_features
        self.in_features = in_features
        self.kernels = kernels
        self.bf16_native: nnx.Param | None = nnx.data(None)

    # ---- installing arms -----------------------------------------------------------
    def set_dense(self, weight) -> None:
        w = as_dense(self.name, weight, (self.out_features, self.in_features))
        self._require_kernels("bf16_native")
        self.bf16_native = nnx.Param(w)

    def _require_kernels(self, arm: str) -> None:
        for kernel in ARM_KERNELS[arm]:
            if not registry.resolved(kernel, self.kernels):
                raise KernelUnavailableError(
                    f"{self.name}: arm {arm!r} needs kernel {kernel!r}, which did not resolve on this backend")

    def installed_arms(self) -> tuple[str, ...]:
        return tuple(a for a in ARM_KERNELS if getattr(self, a) is not None)

    def dense_ready(self) -> bool:
        return self.bf16_native is not None and all(registry.resolved(k, self.kernels)
                                                    for k in ARM_KERNELS["bf16_native"])

    def active_arm(self, phase: str, tokens: int) -> str:
        """The arm that serves a call of `tokens` rows in `phase` ('decode' or 'prefill')."""
        order = {"decode": DECODE_ORDER, "prefill": PREFILL_ORDER}.get(phase)
        if order is None:
            raise ValueError(f"{self.name}: phase must be 'decode' or 'prefill', got {phase!r}")
        for arm in order:
            if getattr(self, arm) is not None:
                return arm
        raise WeightFormatError(f"{self.name}: no weights installed")

    def dense_weight(self) -> DenseWeight:
        if self.bf16_native is None:
            raise WeightFormatError(f"{self.name}: no dense weights installed")
        return self.bf16_native.get_value()

    # ---- calling -------------------------------------------------------------------
    def __call__(self, x: jax.Array, *, phase: str = "prefill", out_dtype=None) -> jax.Array:
        """x [M, K] -> [M, N] in out_dtype (default x.dtype)."""
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ShapeError(f"{self.name}: input must be [M, {self.in_features}], got {tuple(x.shape)}")
        arm = self.active_arm(phase, x.shape[0])
        if arm == "bf16_native":
            matmul = registry.get("dense_matmul", self.kernels)
            return matmul(x, self.bf16_native.get_value().weight, out_dtype=out_dtype)
        raise WeightFormatError(f"{self.name}: arm {arm!r} has no implementation")
