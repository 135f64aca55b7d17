"""FP8 checkpoint tensors <-> Fp8Weight: ModelOpt FP8 (per-tensor `weight_scale`, `input_scale`) and
block FP8 (`weight_scale_inv` per 128x128 block, multiplied in).

Readers take a CheckpointReader-like object (.keys(), .info(name) -> (dtype, shape), .get(name)) and a
module prefix ("backbone.layers.0.mixer.in_proj"); they raise CheckpointError naming the tensor on a
wrong dtype or shape. Writers turn a dense [N, K] array into the tensors of one module.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from metrale_jax.errors import CheckpointError
from metrale_jax.weights import quant_formats as qf
from metrale_jax.weights.containers import Fp8Weight, WeightQuantFormat, fp8_to_block_scaled


def _has(reader, name: str) -> bool:
    return name in reader.keys() if not hasattr(reader, "__contains__") else name in reader


def expect(reader, name: str, dtypes: tuple[str, ...], shapes: tuple[tuple[int, ...], ...]):
    """The tensor `name` as numpy after checking its dtype and shape against the accepted ones."""
    if not _has(reader, name):
        raise CheckpointError(f"{name}: missing")
    dtype, shape = reader.info(name)
    if dtype not in dtypes:
        raise CheckpointError(f"{name}: dtype {dtype}, expected {' or '.join(dtypes)}")
    if tuple(shape) not in {tuple(s) for s in shapes}:
        raise CheckpointError(f"{name}: shape {list(shape)}, expected {' or '.join(str(list(s)) for s in shapes)}")
    return reader.get(name)


def weight_shape(reader, prefix: str, shape: tuple[int, int] | None, dtype: str) -> tuple[int, int]:
    """(N, K) of prefix.weight stored as `dtype` [N, K]; checked against `shape` when given."""
    name = f"{prefix}.weight"
    if not _has(reader, name):
        raise CheckpointError(f"{name}: missing")
    got_dtype, got = reader.info(name)
    if got_dtype != dtype or len(got) != 2:
        raise CheckpointError(f"{name}: {got_dtype}{list(got)}, expected {dtype} [N, K]")
    if shape is not None and tuple(got) != tuple(shape):
        raise CheckpointError(f"{name}: shape {list(got)}, expected {list(shape)}")
    return tuple(got)


def read_fp8_block(reader, prefix: str, shape: tuple[int, int] | None = None, *, host: bool = False) -> Fp8Weight:
    """Block FP8: F8_E4M3 weight [N, K] + F32 weight_scale_inv [ceil(N/128), ceil(K/128)]. host: the weight stays
    the reader's (memory-mapped) array, unread; the scale grid a host array."""
    n, k = weight_shape(reader, prefix, shape, "F8_E4M3")
    q = reader.get(f"{prefix}.weight")
    s = expect(reader, f"{prefix}.weight_scale_inv", ("F32",), (qf.block_grid(n, k),))
    if host:
        return Fp8Weight(q, np.asarray(s, np.float32), None, WeightQuantFormat.FP8_BLOCK_SCALED)
    return Fp8Weight(jnp.asarray(q), jnp.asarray(s, jnp.float32), None, WeightQuantFormat.FP8_BLOCK_SCALED)


def read_fp8_tensor(reader, prefix: str, shape: tuple[int, int] | None = None, *,
                    to_block: bool = False, host: bool = False) -> Fp8Weight:
    """ModelOpt FP8: F8_E4M3 weight [N, K] + F32 weight_scale (scalar, [] or [1]; a per-row [N] / [N, 1]
    scale is read as FP8_PER_ROW) + optional F32 input_scale. to_block=True expands a per-tensor scale
    to the 128x128 grid (exact), as the FP8-block arm needs. host: the weight stays the reader's (memory-mapped)
    array, unread; the scales host arrays."""
    n, k = weight_shape(reader, prefix, shape, "F8_E4M3")
    xp = np if host else jnp
    q = reader.get(f"{prefix}.weight")
    q = q if host else jnp.asarray(q)
    s = expect(reader, f"{prefix}.weight_scale", ("F32",), ((), (1,), (n,), (n, 1)))
    per_row = s.size == n and n > 1
    inp = None
    if _has(reader, f"{prefix}.input_scale"):
        inp = xp.asarray(expect(reader, f"{prefix}.input_scale", ("F32",), ((), (1,))), xp.float32).reshape(())
    if per_row:
        return Fp8Weight(q, xp.asarray(s, xp.float32).reshape(n), inp, WeightQuantFormat.FP8_PER_ROW)
    w = Fp8Weight(q, xp.asarray(s, xp.float32).reshape(()), inp, WeightQuantFormat.FP8_PER_TENSOR)
    return fp8_to_block_scaled(w) if to_block else w


def write_fp8_block(prefix: str, w: np.ndarray) -> dict[str, np.ndarray]:
    """Dense [N, K] -> {prefix.weight: F8_E4M3, prefix.weight_scale_inv: F32 [ceil(N/128), ceil(K/128)]}."""
    q, s = qf.quantize_fp8_block(np.asarray(w, np.float32))
    return {f"{prefix}.weight": q, f"{prefix}.weight_scale_inv": s}


def write_fp8_tensor(prefix: str, w: np.ndarray, input_amax: float | None = None) -> dict[str, np.ndarray]:
    """Dense [N, K] -> ModelOpt FP8 {weight, weight_scale []} (+ input_scale = amax / 448 when the activation
    amax is known; without calibration none is written)."""
    q, s = qf.quantize_fp8_tensor(np.asarray(w, np.float32))
    out = {f"{prefix}.weight": q, f"{prefix}.weight_scale": np.asarray(s, np.float32).reshape(())}
    if input_amax is not None:
        out[f"{prefix}.input_scale"] = np.asarray(max(input_amax, 1e-12) / qf.E4M3_MAX, np.float32).reshape(())
    return out
