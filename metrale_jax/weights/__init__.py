"""Weight containers, checkpoint reading and quantizing."""

from metrale_jax.weights.containers import (  # noqa: F401
    DenseWeight, Fp8PrefillWeight, Fp8Weight, Nvfp4Weight, Nvfp4WeightT, QuantizedWeight, StackedExperts,
    W4a4Weight, WeightQuantFormat, as_dense, stack_experts)
from metrale_jax.weights.quant_formats import Fp8Activations  # noqa: F401
from metrale_jax.weights.quant_config import QuantConfig, load_linear, read_quant_config  # noqa: F401
from metrale_jax.weights.quantize import quantize_checkpoint  # noqa: F401
