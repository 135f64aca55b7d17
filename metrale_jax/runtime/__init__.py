"""Compiled executables (the seed's graphs) and the serving engine."""

from metrale_jax.runtime.executables import Executables, bucket  # noqa: F401
