"""Shared fixtures for the runtime tests: one tiny model with every block kind (f32) and one registry of
executables, so that engines on the same cache shapes reuse each other's compiles."""

import jax
import jax.numpy as jnp
import pytest

from tests.tiny_models import ALL_KINDS
from metrale_jax.model import NemotronH
from metrale_jax.runtime import Engine, Executables

CFG = ALL_KINDS
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
