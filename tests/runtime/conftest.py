"""Shared fixtures for the runtime tests: one tiny model with every block kind (f32) and one registry of
executables, so that engines on the same cache shapes reuse each other's compiles."""

import jax
import jax.numpy as jnp
import pytest

from metrale_jax.config import ModelConfig
from metrale_jax.model import NemotronH
from metrale_jax.runtime import Engine, Executables

CFG = ModelConfig.from_hf(dict(
    vocab_size=96, hidden_size=32, hybrid_override_pattern="M*E-", mamba_num_heads=4, mamba_head_dim=8,
    ssm_state_size=8, n_groups=2, chunk_size=8, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=48, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=24, n_group=4, topk_group=2, moe_latent_size=16, routed_scaling_factor=2.5))
V = CFG.vocab_size
EOS = V - 1          # prompts draw from [0, EOS): a generated EOS stops a request
# a faster, less optimising XLA compile on the CPU: these tests time nothing
FAST_COMPILE = ({"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
                if jax.default_backend() == "cpu" else None)
ENGINE = dict(max_slots=4, max_len=64, batch_buckets=(4,), token_buckets=(8, 64), eos_ids=[EOS])


@pytest.fixture(scope="session")
def model():
    return NemotronH.from_config(CFG, jax.random.key(3), dtype=jnp.float32)


@pytest.fixture(scope="session")
def exe():
    return Executables(compiler_options=FAST_COMPILE)


@pytest.fixture(scope="session")
def make_engine(model, exe):
    """Engine(model, **ENGINE, **overrides) sharing the session's executables."""
    def make(**overrides):
        kw = {**ENGINE, "executables": exe, **overrides}
        return Engine(kw.pop("model", model), **kw)
    return make
