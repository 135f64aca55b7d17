"""Layers of the Nemotron-H stack and their capability flags."""

from metrale_jax.layers.capabilities import LayerCapabilities, ModelCapabilities, combine_capabilities  # noqa: F401
from metrale_jax.layers.mamba2 import (  # noqa: F401
    NemotronMamba2Layer, NemotronSsmWeights, SsmPrefillBuffers)
from metrale_jax.layers.projection import Projection  # noqa: F401
from metrale_jax.layers.attention import NemotronAttentionLayer, NemotronAttentionWeights  # noqa: F401
from metrale_jax.layers.mlp import NemotronMLPLayer, NemotronMlpWeights, Relu2MLP  # noqa: F401
from metrale_jax.layers.moe import NemotronMoELayer, NemotronMoeWeights  # noqa: F401
