"""NVFP4 checkpoint tensors <-> Nvfp4Weight (ModelOpt layout).

prefix.weight U8 [N, K/2] (E2M1 codes, low nibble = even element), prefix.weight_scale F8_E4M3 [N, K/16],
prefix.weight_scale_2 F32 [] (global), optional prefix.input_scale F32 [] (W4A4 activation global scale).
w = e2m1 * weight_scale * weight_scale_2.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from metrale_jax.errors import CheckpointError
from metrale_jax.weights import quant_formats as qf
from metrale_jax.weights.containers import Nvfp4Weight
from metrale_jax.weights.fp8 import _has, expect, weight_shape


def read_nvfp4(reader, prefix: str, shape: tuple[int, int] | None = None, *, host: bool = False) -> Nvfp4Weight:
    """`shape` is the dense (N, K); the packed weight must be [N, K/2]. host: the packed codes and group scales
    stay the reader's (memory-mapped) arrays, unread; the global scales host arrays."""
    packed_shape = None if shape is None else (shape[0], shape[1] // 2)
    n, half = weight_shape(reader, prefix, packed_shape, "U8")
    k = 2 * half
    if k % qf.NVFP4_GROUP:
        raise CheckpointError(f"{prefix}.weight: K = {k} is not a multiple of {qf.NVFP4_GROUP}")
    groups = k // qf.NVFP4_GROUP
    name = f"{prefix}.weight_scale"
    if _has(reader, name) and tuple(reader.info(name)[1]) != (n, groups):
        raise CheckpointError(f"{name}: shape {list(reader.info(name)[1])}, expected {[n, groups]} (one E4M3 scale "
                              f"per 16 along K, linear layout; swizzled or padded scale layouts are not read)")
    s = expect(reader, name, ("F8_E4M3",), ((n, groups),))
    g = expect(reader, f"{prefix}.weight_scale_2", ("F32",), ((), (1,)))
    xp = np if host else jnp
    inp = None
    if _has(reader, f"{prefix}.input_scale"):
        inp = xp.asarray(expect(reader, f"{prefix}.input_scale", ("F32",), ((), (1,))), xp.float32).reshape(())
    packed = reader.get(f"{prefix}.weight")
    if host:
        return Nvfp4Weight(packed, s, np.asarray(g, np.float32).reshape(()), inp)
    return Nvfp4Weight(jnp.asarray(packed), jnp.asarray(s), jnp.asarray(g, jnp.float32).reshape(()), inp)


def write_nvfp4(prefix: str, w: np.ndarray, input_amax: float | None = None) -> dict[str, np.ndarray]:
    """Dense [N, K] (K % 16 == 0) -> ModelOpt NVFP4 tensors (+ input_scale = amax / (6 * 448) when the
    activation amax is known)."""
    packed, scale, g = qf.quantize_nvfp4(np.asarray(w, np.float32))
    out = {f"{prefix}.weight": packed, f"{prefix}.weight_scale": scale,
           f"{prefix}.weight_scale_2": np.asarray(g, np.float32).reshape(())}
    if input_amax is not None:
        out[f"{prefix}.input_scale"] = qf.nvfp4_global_scale(input_amax).reshape(())
    return out
