"""Compiled executables (the seed's graphs) and the serving engine.

The engine, prefix cache and speculative pieces import the model, which imports this package for
`bucket`; they are loaded on first use to keep that import acyclic.
"""

from metrale_jax.runtime.executables import Executables, bucket, pick_bucket  # noqa: F401

_LAZY = {
    "Engine": "metrale_jax.runtime.engine",
    "DataParallelEngine": "metrale_jax.runtime.engine_dp",
    "Request": "metrale_jax.runtime.request",
    "PrefixCache": "metrale_jax.runtime.prefix_cache",
    "PrefixHit": "metrale_jax.runtime.prefix_cache",
    "SpeculativeConfig": "metrale_jax.runtime.speculative",
    "SamplingParams": "metrale_jax.runtime.sampling_params",
    "NgramDrafter": "metrale_jax.runtime.speculative",
    "MtpDrafter": "metrale_jax.runtime.speculative",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
