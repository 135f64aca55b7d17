"""How a checkpoint's tensors become blocks: the dtype each tensor is kept in, the quantization a set of weight
containers implies, and the arms a Mamba-2 layer's projections get for their formats and the levers."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax.numpy as jnp

from metrale_jax.config import ModelConfig, ModelLevers
from metrale_jax.errors import ConfigError, KernelUnavailableError
from metrale_jax.layers.mamba2 import NemotronMamba2Layer
from metrale_jax.weights.checkpoint import is_quantized, model_tensors
from metrale_jax.weights.containers import (DenseWeight, Fp8Weight, Nvfp4Weight, StackedExperts, W4a4Weight,
                                            WeightQuantFormat, fp8_prefill_copy, fp8_to_block_scaled,
                                            quantize_nvfp4_weight)
from metrale_jax.weights.quant_config import QuantConfig
from metrale_jax.weights.quant_formats import NVFP4_GROUP
from pallas_kernels import mgpu_gemm_nvfp4, registry


def cast_tensors(config: ModelConfig, tensors: Mapping[str, object], dtype) -> dict[str, object]:
    """Every tensor in the model dtype, except those the table keeps in float32 (no copy when it already is);
    quantized containers stay as they are, a DenseWeight is cast like an array."""
    f32 = {n for n, s in model_tensors(config, tensors).items() if s.keep_f32}
    out: dict[str, object] = {}
    for n, v in tensors.items():
        if is_quantized(v):
            out[n] = v
        else:
            arr = v.weight if isinstance(v, DenseWeight) else v
            out[n] = jnp.asarray(arr).astype(jnp.float32 if n in f32 else dtype)
    return out


def infer_quant_config(tensors: Mapping[str, object], quantized: Sequence[str]) -> QuantConfig | None:
    """The QuantConfig of containers given without one: 'none' for dense weights, the one format they share,
    or None when they mix formats (such a model runs, but cannot be saved)."""
    methods = {quant_method(tensors[n]) for n in quantized}
    if len(methods) > 1:
        return None
    return QuantConfig(methods.pop() if methods else "none")


def quant_method(w) -> str:
    w = w.member if isinstance(w, StackedExperts) else w
    if isinstance(w, (Nvfp4Weight, W4a4Weight)):
        return "nvfp4"
    return "fp8" if w.format is WeightQuantFormat.FP8_PER_TENSOR else "fp8_block"


def nvfp4_prefill_copy_pays(shape: tuple[int, int], dtype, kernels: str, platform: str | None = None) -> bool:
    """Whether an NVFP4 projection [N, K] gets a transposed prefill copy (w4a16_gemm_t). Not where the plain-layout
    GEMM (w4a16_gemm) resolves to its Mosaic arm and takes the shape: that arm serves prefill from the layer's own
    weights at least as fast (on the H200 at the 8B shapes; benchmarks/notes/quant_prefill.md) and the copy would
    cost another 0.56 N K bytes. Elsewhere the plain GEMM is Triton's (8x slower)."""
    try:
        plain = registry.resolve("w4a16_gemm", kernels, platform).impl == "mosaic"
    except KernelUnavailableError:
        return True
    return not (plain and mgpu_gemm_nvfp4.supports_shape(*shape, dtype, dtype))


def mamba_layer(norm, w, config: ModelConfig, i: int, levers: ModelLevers, dtype) -> NemotronMamba2Layer:
    """A Mamba-2 layer with the arms its projections' formats call for (each projection on its own):
      dense           BF16 native.
      NVFP4           the default w4a16 arm (decode), and for prefill the plain Mosaic w4a16_gemm on Hopper or
                      else a transposed copy (w4a16_gemm_t; `nvfp4_prefill_copy_pays`).
      FP8 (block, or per-tensor expanded to the block grid), by levers.native_fp8_ssm:
        full          native FP8 for decode and prefill (w8a16_gemv / w8a16_gemm_pipelined).
        decode        native FP8 for decode only + a pre-dequantized FP8 E4M3 prefill copy (fp8_gemm_t).
        off           requantized to NVFP4 (the double quantization FP8 -> NVFP4 that native FP8 avoids) and
                      then served as NVFP4 (decode w4a16_gemv, prefill w4a16_gemm_t).
      With levers.fp8_activations 'bf16', full and decode both serve prefill weight-only from the native FP8
      weights (w8a16_gemm; NemotronH.__init__ sets every projection's mode): no E4M3 prefill copy is made."""
    mode = levers.native_fp8_ssm
    names = ("in_proj", "out_proj")
    projs = {k: getattr(w, k) for k in names}
    fp8 = {k: fp8_to_block_scaled(v) for k, v in projs.items() if isinstance(v, Fp8Weight)}
    projs.update(fp8)
    if mode == "off":
        for k, v in fp8.items():
            if v.shape[1] % NVFP4_GROUP:
                raise ConfigError("native_fp8_ssm", f"'off' requantizes backbone.layers.{i}.mixer.{k} to NVFP4, "
                                                    f"but its K = {v.shape[1]} is not a multiple of {NVFP4_GROUP}; "
                                                    "use 'decode' or 'full'")
            projs[k] = quantize_nvfp4_weight(v)
    layer = NemotronMamba2Layer(norm, dataclasses.replace(w, **projs), config, i, levers=levers)
    if fp8 and mode == "decode" and levers.fp8_activations == "e4m3":   # bf16: fp8_native serves prefill itself
        layer.set_fp8_prefill_weights(*(fp8_prefill_copy(fp8[k]) if k in fp8 else None for k in names))
    nvfp4 = {k: v for k, v in projs.items()
             if isinstance(v, Nvfp4Weight) and nvfp4_prefill_copy_pays(v.shape, dtype, levers.kernels)}
    if nvfp4:
        layer.set_prefill_weights(*(nvfp4[k].transposed() if k in nvfp4 else None for k in names))
    return layer
