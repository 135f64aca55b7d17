"""Kernels of metrale-jax: each module holds a jnp reference and, where written, its Pallas kernel.

Importing this package registers every kernel with `pallas_kernels.registry`.
"""

from pallas_kernels import conv1d, dense, fp8_gemm, grouped, norm_fp8, norms, ssd, state_update, w4a4, w4a16, w8a16  # noqa: F401,E501  (registration)
from pallas_kernels import ssd_mgpu  # noqa: F401,E402  (registration of the Mosaic GPU arm of ssd_scan)
from pallas_kernels import mgpu_gemv  # noqa: F401,E402  (registration of the Mosaic GPU arms of the decode GEMVs)
from pallas_kernels import mgpu_gemm  # noqa: F401,E402  (registration of the Mosaic GPU arms of the FP8 prefill GEMMs)
from pallas_kernels import mgpu_gemm_nvfp4  # noqa: F401,E402  (registration of the Mosaic GPU arms of the NVFP4 prefill GEMMs)
from pallas_kernels.registry import get, report, resolve, resolved  # noqa: F401
