"""metrale-jax: Nemotron-H hybrid models (Mamba-2 + attention + MLP/MoE) on JAX with Pallas kernels."""

from metrale_jax.config import ModelConfig, ModelLevers  # noqa: F401
from metrale_jax.errors import (  # noqa: F401
    CheckpointError, ConfigError, KernelUnavailableError, MetraleError, NonFiniteError, PoolExhaustedError, ShapeError,
    SlotError, WeightFormatError)
from metrale_jax.layers import (  # noqa: F401
    LayerCapabilities, NemotronMamba2Layer, NemotronSsmWeights, SsmPrefillBuffers,
    combine_capabilities)
from metrale_jax.layers import (  # noqa: F401
    NemotronAttentionLayer, NemotronAttentionWeights, NemotronMLPLayer, NemotronMlpWeights, NemotronMoELayer,
    NemotronMoeWeights)
from metrale_jax.model import Generation, NemotronH  # noqa: F401
from metrale_jax.layers.mtp import MtpCache, MtpStepWeights, NemotronMTP  # noqa: F401
from metrale_jax.builtin import builtin_model_dir, load_builtin  # noqa: F401
from metrale_jax.state import (  # noqa: F401
    CacheSlotState, KvPool, KvSlotState, ModelCache, SlotAllocator, SlotState, SsmPool)
from metrale_jax.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer  # noqa: F401
from metrale_jax.weights import (  # noqa: F401
    DenseWeight, Fp8Activations, Fp8PrefillWeight, Fp8Weight, Nvfp4Weight, Nvfp4WeightT, QuantizedWeight,
    StackedExperts, W4a4Weight, WeightQuantFormat, quantize_checkpoint, stack_experts)
from metrale_jax import sharding  # noqa: F401,E402
from metrale_jax.sharding import make_mesh  # noqa: F401,E402
from metrale_jax.runtime import Engine, Executables, PrefixCache, SamplingParams, SpeculativeConfig  # noqa: F401,E402

__version__ = "0.1.0"
