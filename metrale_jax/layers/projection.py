"""Projection: one linear map (in_proj, out_proj, q_proj, ...) holding the weight copies installed for it.

Each installed copy is an *arm*; a call takes the first arm of its phase's fixed order that is installed
(DESIGN.md, "Projection arms"):

  decode:  dense > fp8_native (w8a16_gemv; w8a8_gemv with fp8_decode_activations "e4m3") > w4a4 > nvfp4
           (w4a16_gemv, the default)
  prefill: dense > fp8_native (only if installed with prefill=True: w8a16_gemm_pipelined, else
           w8a16_gemm) > w4a4 > fp8_prefill (fp8_gemm_t) > nvfp4_t (w4a16_gemm_t, or w4a16_gemm_t_m128
           above 128 tokens when it resolved) > nvfp4 (w4a16_gemm)
  With fp8_activations "bf16" (ModelLevers.fp8_activations) the FP8 weights serve prefill weight-only: fp8_native
  with w8a16_gemm, also when installed decode-only, ahead of the E4M3-activation prefill copy.

Every kernel an arm needs must resolve when the arm is installed (KernelUnavailableError there, never at
the first token); every weight is checked at install (WeightFormatError naming the tensor).

A LoRA overlay (`lora`, layers/lora.py) runs beside whichever arm serves a call: the arm's float32 output plus
each row's low-rank term, rounded once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from metrale_jax.errors import ConfigError, KernelUnavailableError, ShapeError, WeightFormatError
from metrale_jax.layers.lora import row_adapters
from metrale_jax.weights.containers import (DenseWeight, Fp8PrefillWeight, Fp8Share, Fp8Weight, Nvfp4Weight,
                                            Nvfp4WeightT, W4a4Weight, WeightQuantFormat, as_dense, check_fp8,
                                            check_fp8_prefill, check_nvfp4, check_nvfp4_t, clear_zero_scale_blocks,
                                            fp8_to_block_scaled)
from metrale_jax.weights.quant_formats import Fp8Activations
from pallas_kernels import epilogues, registry
from pallas_kernels.split_partials import SplitPartials

DECODE_ORDER = ("dense", "fp8_native", "w4a4", "nvfp4")
PREFILL_ORDER = ("dense", "fp8_native", "w4a4", "fp8_prefill", "nvfp4_t", "nvfp4")
ARMS = ("dense", "fp8_native", "w4a4", "fp8_prefill", "nvfp4_t", "nvfp4")
# kernels each arm needs at install; an entry (a, b) means "a or b"
ARM_KERNELS = {
    "dense": ("dense_matmul",),
    "fp8_native": ("w8a16_gemv", ("w8a16_gemm_pipelined", "w8a16_gemm")),   # the prefill pair only with prefill=True
    "w4a4": ("w4a4_gemm",),
    "fp8_prefill": ("fp8_gemm_t",),
    "nvfp4_t": ("w4a16_gemm_t",),
    "nvfp4": ("w4a16_gemv", "w4a16_gemm"),
}
# kernels that quantize their activations to E4M3 (and so also take Fp8Activations): how
INPUT_QUANT = {"fp8_gemm_t": "rows", "w8a16_gemm_pipelined": "blocks", "w8a8_gemv": "blocks"}
EPILOGUE_KERNELS = ("w8a16_gemv", "w8a8_gemv", "w4a16_gemv")   # kernels that take `epilogue` (every arm of theirs)
UNREDUCED_KERNELS = ("w8a16_gemv", "w8a8_gemv", "w4a16_gemv")  # kernels that hand on split partials (unreduced)
PREFILL_ONLY_ARMS = ("fp8_prefill", "nvfp4_t")   # copies no decode call reads
M128_ABOVE = 128   # prefill tokens above which the transposed NVFP4 arm takes w4a16_gemm_t_m128
# the layer's own ("base") weights: the first installed of these (what ssm_weights() reports)
BASE_PRIORITY = ("nvfp4", "w4a4", "dense", "fp8_native")


class QuantWeight(nnx.Variable):
    """A projection's (non-trainable) weight container: quantized arrays plus their scales."""


class Projection(nnx.Module):
    """y = x W^T with W [N, K]; `name` (the checkpoint module name) is used in every error."""

    def __init__(self, name: str, out_features: int, in_features: int, *, kernels: str | None = None):
        self.name = name
        self.out_features = out_features
        self.in_features = in_features
        self.kernels = kernels
        self.fp8_activations = "e4m3"        # ModelLevers.fp8_activations, set by set_fp8_activations
        self.fp8_decode_activations = "bf16"  # ModelLevers.fp8_decode_activations (set_fp8_decode_activations)
        self.fp8_prefill_enabled = False
        for arm in ARMS:
            setattr(self, arm, nnx.data(None))
        self.lora = nnx.data(None)          # a LoraOverlay once an adapter targets this projection

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    # ---- installing arms -----------------------------------------------------------------------------
    def prepare(self, arm: str, weight, *, prefill: bool = True):
        """Check `weight` for `arm` (tag, dtypes, scale shapes, kernels) and return the container to install;
        raises WeightFormatError / KernelUnavailableError and installs nothing."""
        if arm == "dense":
            w = as_dense(self.name, weight, self.shape)
        elif arm == "fp8_native" and isinstance(weight, Fp8Share):      # a tensor-parallel device's padded share
            if weight.shape != self.shape:
                raise WeightFormatError(f"{self.name}: expected shape {self.shape}, got an FP8 share of {weight.shape}")
            w = Fp8Share(clear_zero_scale_blocks(check_fp8(self.name, weight.weight,
                                                           formats=(WeightQuantFormat.FP8_BLOCK_SCALED,))),
                         weight.rows, weight.cols, weight.logical)
        elif arm == "fp8_native":
            w = clear_zero_scale_blocks(check_fp8(self.name, weight, self.shape,
                                                  formats=(WeightQuantFormat.FP8_BLOCK_SCALED,)))
        elif arm == "nvfp4":
            w = check_nvfp4(self.name, weight, self.shape)
        elif arm == "w4a4":
            inner = weight.weight if isinstance(weight, W4a4Weight) else weight
            w = W4a4Weight(check_nvfp4(self.name, inner, self.shape))
        elif arm == "fp8_prefill":
            w = check_fp8_prefill(self.name, weight, self.shape)
        elif arm == "nvfp4_t":
            w = check_nvfp4_t(self.name, weight.transposed() if isinstance(weight, Nvfp4Weight) else weight,
                              self.shape)
        else:
            raise ValueError(f"{self.name}: unknown arm {arm!r} (arms: {ARMS})")
        kernels = ARM_KERNELS[arm]
        if arm == "fp8_native" and not prefill:
            kernels = kernels[:1]                  # decode-only mode needs w8a16_gemv alone
        self._require(arm, kernels)
        return w

    def install(self, arm: str, prepared, *, prefill: bool = True) -> None:
        """Install a container returned by `prepare` (two-step so a layer can check both of its
        projections before installing either)."""
        setattr(self, arm, nnx.Param(prepared) if arm == "dense" else QuantWeight(prepared))
        if arm == "fp8_native":
            self.fp8_prefill_enabled = bool(prefill)

    def set_dense(self, weight) -> None:
        """BF16 native arm (ahead of every other arm in both phases)."""
        self.install("dense", self.prepare("dense", weight))

    def set_fp8(self, weight: Fp8Weight, *, prefill: bool) -> None:
        """FP8 native arm: only FP8_BLOCK_SCALED weights with the exact [ceil(N/128), ceil(K/128)] f32 grid.
        prefill=False is decode-only mode: prefill then skips this arm."""
        self.install("fp8_native", self.prepare("fp8_native", weight, prefill=prefill), prefill=prefill)

    def set_nvfp4(self, weight: Nvfp4Weight) -> None:
        """The default NVFP4 arm (w4a16_gemv / w4a16_gemm)."""
        self.install("nvfp4", self.prepare("nvfp4", weight))

    def set_w4a4(self, weight: W4a4Weight | Nvfp4Weight) -> None:
        """W4A4 arm: NVFP4 weights, activations quantized to NVFP4 on the fly."""
        self.install("w4a4", self.prepare("w4a4", weight))

    def set_fp8_prefill(self, weight: Fp8PrefillWeight) -> None:
        """Pre-dequantized FP8 E4M3 prefill copy (fp8_gemm_t)."""
        self.install("fp8_prefill", self.prepare("fp8_prefill", weight))

    def set_nvfp4_t(self, weight: Nvfp4WeightT | Nvfp4Weight) -> None:
        """Transposed NVFP4 prefill copy (w4a16_gemm_t; w4a16_gemm_t_m128 above 128 tokens if it resolved).
        An Nvfp4Weight is transposed here."""
        self.install("nvfp4_t", self.prepare("nvfp4_t", weight))

    def arm_for(self, weight) -> str:
        """The arm a container's type names (arrays and DenseWeight: dense)."""
        for cls, arm in ((W4a4Weight, "w4a4"), (Nvfp4Weight, "nvfp4"), (Nvfp4WeightT, "nvfp4_t"),
                         (Fp8PrefillWeight, "fp8_prefill"), (Fp8Weight, "fp8_native"), (Fp8Share, "fp8_native")):
            if isinstance(weight, cls):
                return arm
        if isinstance(weight, DenseWeight) or hasattr(weight, "shape"):
            return "dense"
        raise WeightFormatError(f"{self.name}: cannot install a {type(weight).__name__} as a weight")

    def set_weight(self, weight, *, fp8_prefill: bool = True) -> str:
        """Install any container in the arm its type names; returns the arm. A per-tensor FP8 scale is
        expanded (exactly) to the 128x128 block grid first. Arrays are taken as dense weights."""
        arm = self.arm_for(weight)
        if arm == "fp8_native" and isinstance(weight, Fp8Weight) and weight.format is WeightQuantFormat.FP8_PER_TENSOR:
            weight = fp8_to_block_scaled(check_fp8(self.name, weight, self.shape))
        self.install(arm, self.prepare(arm, weight, prefill=fp8_prefill), prefill=fp8_prefill)
        return arm

    def _require(self, arm: str, kernels) -> None:
        for need in kernels:
            options = need if isinstance(need, tuple) else (need,)
            if not any(registry.resolved(k, self.kernels) for k in options):
                raise KernelUnavailableError(
                    f"{self.name}: arm {arm!r} needs kernel {' or '.join(map(repr, options))}, which did not "
                    f"resolve on this backend (kernels={self.kernels or registry.default_mode()!r})")

    # ---- what is installed -------------------------------------------------------------------------------
    def installed_arms(self) -> tuple[str, ...]:
        return tuple(a for a in ARMS if getattr(self, a) is not None)

    def arm_weight(self, arm: str):
        v = getattr(self, arm)
        if v is None:
            raise WeightFormatError(f"{self.name}: arm {arm!r} is not installed")
        return v.get_value()

    def base_weight(self):
        """The layer's own weights: the first installed of nvfp4, w4a4, dense, fp8_native."""
        for arm in BASE_PRIORITY:
            if getattr(self, arm) is not None:
                return self.arm_weight(arm)
        raise WeightFormatError(f"{self.name}: no weights installed")

    def dense_ready(self) -> bool:
        return self.dense is not None and registry.resolved("dense_matmul", self.kernels)

    def dense_weight(self) -> DenseWeight:
        if self.dense is None:
            raise WeightFormatError(f"{self.name}: no dense weights installed (arms: {self.installed_arms()})")
        return self.dense.get_value()

    def set_fp8_activations(self, mode: str) -> None:
        """ModelLevers.fp8_activations for this projection: "e4m3" (the default dispatch) or "bf16" (FP8 weights
        serve prefill through w8a16_gemm, which must then resolve: KernelUnavailableError here otherwise)."""
        if mode not in ("e4m3", "bf16"):
            raise ConfigError("fp8_activations", f"{self.name}: expected 'e4m3' or 'bf16', got {mode!r}")
        if mode == "bf16" and self.fp8_native is not None and not registry.resolved("w8a16_gemm", self.kernels):
            raise KernelUnavailableError(f"{self.name}: fp8_activations 'bf16' serves FP8 prefill with w8a16_gemm, "
                                         f"which does not resolve here (kernels={self.kernels!r})")
        self.fp8_activations = mode

    def set_fp8_decode_activations(self, mode: str) -> None:
        """ModelLevers.fp8_decode_activations for this projection: "bf16" (w8a16_gemv) or "e4m3" (FP8 weights decode
        through w8a8_gemv, which must then resolve: KernelUnavailableError here otherwise)."""
        if mode not in ("bf16", "e4m3"):
            raise ConfigError("fp8_decode_activations", f"{self.name}: expected 'bf16' or 'e4m3', got {mode!r}")
        if mode == "e4m3" and self.fp8_native is not None and not registry.resolved("w8a8_gemv", self.kernels):
            raise KernelUnavailableError(f"{self.name}: fp8_decode_activations 'e4m3' decodes FP8 weights with "
                                         f"w8a8_gemv, which does not resolve here (kernels={self.kernels!r})")
        self.fp8_decode_activations = mode

    # ---- dispatch ------------------------------------------------------------------------------------
    def active_arm(self, phase: str, tokens: int) -> str:
        """The arm that serves a call of `tokens` rows in `phase` ('decode' or 'prefill')."""
        order = {"decode": DECODE_ORDER, "prefill": PREFILL_ORDER}.get(phase)
        if order is None:
            raise ValueError(f"{self.name}: phase must be 'decode' or 'prefill', got {phase!r}")
        for arm in order:
            if getattr(self, arm) is None:
                continue
            if arm == "fp8_native" and phase == "prefill" and not self.fp8_prefill_enabled \
                    and self.fp8_activations == "e4m3":
                continue                       # decode-only FP8 mode (with bf16 activations it serves prefill too)
            return arm
        raise WeightFormatError(f"{self.name}: no weights installed for {phase} (arms: {self.installed_arms()})")

    def active_kernel(self, phase: str, tokens: int) -> str:
        """The registry kernel that serves a call (the arm's kernel for this phase and token count)."""
        arm = self.active_arm(phase, tokens)
        decode = phase == "decode"
        if arm == "dense":
            return "dense_matmul"
        if arm == "fp8_native":
            if decode:
                e4m3 = self.fp8_decode_activations == "e4m3" and not isinstance(self.arm_weight(arm), Fp8Share)
                return "w8a8_gemv" if e4m3 else "w8a16_gemv"
            if self.fp8_activations == "bf16":
                return "w8a16_gemm"            # weight-only: the activations stay as they come
            return "w8a16_gemm_pipelined" if registry.resolved("w8a16_gemm_pipelined", self.kernels) else "w8a16_gemm"
        if arm == "w4a4":
            return "w4a4_gemm"
        if arm == "fp8_prefill":
            return "fp8_gemm_t"
        if arm == "nvfp4_t":
            big = tokens > M128_ABOVE and registry.resolved("w4a16_gemm_t_m128", self.kernels)
            return "w4a16_gemm_t_m128" if big else "w4a16_gemm_t"
        return "w4a16_gemv" if decode else "w4a16_gemm"

    def input_quant(self, phase: str, tokens: int) -> str | None:
        """How the kernel serving this call quantizes bf16 activations to E4M3 itself ("rows": one scale per
        row, fp8_gemm_t; "blocks": per row per 128 columns, w8a16_gemm_pipelined); both also take
        Fp8Activations from a producer that quantized them already (norm_fp8), per row or per a multiple of
        128 columns. None: the kernel takes unquantized x only."""
        return INPUT_QUANT.get(self.active_kernel(phase, tokens))

    def hands_on_partials(self, phase: str, tokens: int) -> bool:
        """Whether a call can return its split-K partials unreduced (`partials`): a decode GEMV of the layer's own
        weights (no tensor-parallel share) with no LoRA overlay."""
        if phase != "decode" or self.lora is not None:
            return False
        arm = self.active_arm(phase, tokens)
        return (self.active_kernel(phase, tokens) in UNREDUCED_KERNELS
                and not isinstance(self.arm_weight(arm), Fp8Share))

    def partials(self, x: jax.Array | Fp8Activations, *, phase: str) -> SplitPartials:
        """The float32 split-K partials of this call (pallas_kernels/split_partials.py), for a consumer that adds
        them itself (norms.add_rmsnorm); their sum in split order, rounded, is `self(x, phase=phase)` bit for
        bit. Only where `hands_on_partials` (else ShapeError)."""
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ShapeError(f"{self.name}: input must be [M, {self.in_features}], got {tuple(x.shape)}")
        if not self.hands_on_partials(phase, x.shape[0]):
            raise ShapeError(f"{self.name}: a {phase} call of {x.shape[0]} rows cannot hand on split partials (arm "
                             f"{self.active_arm(phase, x.shape[0])!r}, LoRA {self.lora is not None})")
        arm = self.active_arm(phase, x.shape[0])
        fn = registry.get(self.active_kernel(phase, x.shape[0]), self.kernels)
        return _run_arm(fn, arm, self.arm_weight(arm), x, phase, jnp.float32, unreduced=True)

    # ---- calling -----------------------------------------------------------------------------------------
    def __call__(self, x: jax.Array | Fp8Activations, *, phase: str = "prefill", out_dtype=None,
                 epilogue: str | None = None) -> jax.Array:
        """x [M, K] (or Fp8Activations where `input_quant` says so) -> [M, N] in out_dtype (default x.dtype).
        epilogue: an elementwise function (pallas_kernels.epilogues) applied to the float32 result before the
        cast: inside the kernel where the kernel takes it (EPILOGUE_KERNELS on the layer's own weights), else
        after a float32 call; the same bits either way."""
        epilogues.check(self.name, epilogue)
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ShapeError(f"{self.name}: input must be [M, {self.in_features}], got {tuple(x.shape)}")
        arm = self.active_arm(phase, x.shape[0])
        kernel = self.active_kernel(phase, x.shape[0])
        if isinstance(x, Fp8Activations) and kernel not in INPUT_QUANT:
            raise ShapeError(f"{self.name}: input is E4M3 (Fp8Activations) but {kernel} ({phase}, arm {arm}) takes "
                             f"unquantized activations")
        fn = registry.get(kernel, self.kernels)
        w = self.arm_weight(arm)
        out_dtype = out_dtype or x.dtype
        rows = None if self.lora is None else row_adapters(self.name, x.shape[0])
        if rows is None and (epilogue is None or (kernel in EPILOGUE_KERNELS and not isinstance(w, Fp8Share))):
            return _run_arm(fn, arm, w, x, phase, out_dtype, **({} if epilogue is None else dict(epilogue=epilogue)))
        y = _run_arm(fn, arm, w, x, phase, jnp.float32)
        if rows is not None:
            y = y + self.lora.delta(x.dequantize() if isinstance(x, Fp8Activations) else x, rows)
        return epilogues.apply(y, epilogue).astype(out_dtype)


def _run_arm(fn, arm: str, w, x, phase: str, out_dtype, **epilogue) -> jax.Array:
    """The arm's kernel `fn` on its weight container `w` (epilogue, or unreduced: only to the EPILOGUE_KERNELS)."""
    if arm == "dense":
        return fn(x, w.weight, out_dtype=out_dtype)
    if arm == "fp8_native" and isinstance(w, Fp8Share):
        if isinstance(x, Fp8Activations) and w.cols is not None:
            raise ShapeError("an FP8 share split by input column takes unquantized activations")
        return w.output(fn(w.padded_input(x), w.weight.weight, w.weight.scale, out_dtype=out_dtype))
    if arm == "fp8_native":
        return fn(x, w.weight, w.scale, out_dtype=out_dtype, **epilogue)
    if arm == "w4a4":
        n = w.weight
        return fn(x, n.packed, n.scale, n.global_scale, n.input_scale, out_dtype=out_dtype, decode=phase == "decode")
    if arm == "fp8_prefill":
        return fn(x, w.weight, w.scale, out_dtype=out_dtype)
    if arm == "nvfp4_t":
        return fn(x, w.packed_t, w.scale_t, w.global_scale, out_dtype=out_dtype)
    return fn(x, w.packed, w.scale, w.global_scale, out_dtype=out_dtype, **epilogue)


def arm_reference(weight, x: jax.Array, *, out_dtype=None) -> jax.Array:
    """What any arm computes, from its container alone: dequantize to float32, then x @ W^T in float32
    (activation quantization of the FP8-matrix-unit and W4A4 arms not included). For tests and tools."""
    w = weight.dequantize(jnp.float32)
    y = jax.lax.dot_general(x.astype(jnp.float32), w, (((1,), (1,)), ((), ())),
                            precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x.dtype)
