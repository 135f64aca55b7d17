"""Weight containers: pytrees that carry a projection's arrays and say what format they are in."""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp

from metrale_jax.errors import WeightFormatError


class WeightQuantFormat(enum.Enum):
    """How a weight's numbers are stored (seed: WeightQuantFormat)."""

    DENSE = "dense"                      # BF16 / F16 / F32
    FP8_BLOCK_SCALED = "fp8_block_scaled"  # F8_E4M3 + f32 scale per 128x128 block
    FP8_PER_TENSOR = "fp8_per_tensor"      # F8_E4M3 + one f32 scale (ModelOpt FP8 as stored)
    NVFP4 = "nvfp4"                        # packed E2M1 + E4M3 scale per 16 + f32 global scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseWeight:
    """A dense matrix stored [N, K] (out, in), as in the checkpoint."""

    weight: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    @property
    def dtype(self):
        return self.weight.dtype

    @property
    def format(self) -> WeightQuantFormat:
        return WeightQuantFormat.DENSE

    def dequantize(self, dtype=None) -> jax.Array:
        return self.weight if dtype is None else self.weight.astype(dtype)


def as_dense(name: str, value, shape: tuple[int, ...] | None = None) -> DenseWeight:
    """Wrap an array (or pass a DenseWeight through), checking its shape and that it is floating."""
    w = value if isinstance(value, DenseWeight) else DenseWeight(jnp.asarray(value))
    if not jnp.issubdtype(w.weight.dtype, jnp.floating):
        raise WeightFormatError(f"{name}: expected a floating-point dense weight, got dtype {w.weight.dtype}")
    if shape is not None and tuple(w.weight.shape) != tuple(shape):
        raise WeightFormatError(f"{name}: expected shape {tuple(shape)}, got {tuple(w.weight.shape)}")
    return w
