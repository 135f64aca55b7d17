"""Kernels of metrale-jax: each module holds a jnp reference and, where written, its Pallas kernel.

Importing this package registers every kernel with `pallas_kernels.registry`.
"""

from pallas_kernels import conv1d, dense, norms, ssd, state_update  # noqa: F401  (registration)
from pallas_kernels.registry import get, report, resolve, resolved  # noqa: F401
