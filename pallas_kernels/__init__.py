"""Kernels of metrale-jax: each module holds a jnp reference and, where written, its Pallas kernel.

Importing this package registers every kernel with `pallas_kernels.registry`.
"""

# the kernel modules register their arms on import
from pallas_kernels import attention, conv1d, dense, fp8_gemm, grouped, norm_fp8, norms, ssd, state_update  # noqa: F401
from pallas_kernels import w4a4, w4a16, w8a16  # noqa: F401
from pallas_kernels import ssd_mgpu  # noqa: F401  (the Mosaic GPU arm of ssd_scan)
from pallas_kernels import mgpu_gemv_w4, mgpu_gemv_w8  # noqa: F401  (the Mosaic GPU arms of the decode GEMVs)
from pallas_kernels import mgpu_gemm, mgpu_gemm_nvfp4  # noqa: F401  (the Mosaic GPU arms of the prefill GEMMs)
from pallas_kernels.registry import get, report, resolve, resolved  # noqa: F401
