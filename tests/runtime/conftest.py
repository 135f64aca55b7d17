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


def shared_prefix_prompt(rng, bases: list[list[int]], index: int) -> list[int]:
    """The index-th prompt of a mixed workload: the bases in full first, then at least half of a random base,
    each with up to 11 fresh tokens after it, so that prefix-cache hits come with every seed."""
    if index < len(bases):
        base, keep = bases[index], len(bases[index])
    else:
        base = bases[rng.integers(0, len(bases))]
        keep = rng.integers(len(base) // 2, len(base) + 1)
    return base[:keep] + rng.integers(0, EOS, rng.integers(0, 12)).tolist()


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
