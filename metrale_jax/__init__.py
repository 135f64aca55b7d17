"""metrale-jax: Nemotron-H hybrid models (Mamba-2 + attention + MLP/MoE) on JAX with Pallas kernels."""

from metrale_jax.config import ModelConfig, ModelLevers  # noqa: F401
from metrale_jax.errors import (  # noqa: F401
    CheckpointError, ConfigError, KernelUnavailableError, MetraleError, PoolExhaustedError, ShapeError, SlotError,
    WeightFormatError)
from metrale_jax.layers import (  # noqa: F401
    LayerCapabilities, LayerSlotState, NemotronMamba2Layer, NemotronSsmWeights, SsmPrefillBuffers, StepStates,
    combine_capabilities)
from metrale_jax.layers import (  # noqa: F401
    NemotronAttentionLayer, NemotronAttentionWeights, NemotronMLPLayer, NemotronMlpWeights, NemotronMoELayer,
    NemotronMoeWeights)
from metrale_jax.model import Generation, NemotronH  # noqa: F401
from metrale_jax.state import (  # noqa: F401
    CacheSlotState, KvPool, KvSlotState, ModelCache, SlotAllocator, SlotState, SsmPool)
from metrale_jax.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer  # noqa: F401
from metrale_jax.weights import DenseWeight, WeightQuantFormat  # noqa: F401

__version__ = "0.1.0"
