"""The errors the kernels raise. The library's `errors` module re-exports these classes (the same objects), so
`except MetraleError` / `except ShapeError` anywhere in metrale-jax or its users catch what a kernel raises."""


class MetraleError(Exception):
    """Base of every error metrale-jax (the library and its kernels) raises on purpose."""


class ShapeError(MetraleError, ValueError):
    """An input array to an entry point has the wrong shape or dtype."""


class KernelUnavailableError(MetraleError, RuntimeError):
    """A kernel an arm or entry point needs did not resolve on this backend."""
