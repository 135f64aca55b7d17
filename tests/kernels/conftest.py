"""Kernel tests run the Pallas kernels compiled on a GPU and in interpret mode elsewhere."""

import jax
import pytest


@pytest.fixture(scope="session")
def interpret() -> bool:
    return jax.default_backend() != "gpu"
