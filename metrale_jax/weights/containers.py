"""Weight containers: pytrees that carry a projection's arrays and say what format they are in.

Every container is stored [N, K] (out, in) like an HF Linear unless its name says transposed, and
`dequantize()` gives the float32 (or requested dtype) matrix it stands for. Constructors check
nothing; `fp8_weight`, `nvfp4_weight`, ... build checked containers and raise WeightFormatError
naming the tensor on a wrong dtype or scale shape.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np

from metrale_jax.errors import WeightFormatError
from metrale_jax.weights import quant_formats as qf


class WeightQuantFormat(enum.Enum):
    """How a weight's numbers are stored (seed: WeightQuantFormat)."""

    DENSE = "dense"                      # BF16 / F16 / F32
    FP8_BLOCK_SCALED = "fp8_block_scaled"  # F8_E4M3 + f32 scale per 128x128 block
    FP8_PER_TENSOR = "fp8_per_tensor"      # F8_E4M3 + one f32 scale (ModelOpt FP8 as stored)
    FP8_PER_ROW = "fp8_per_row"            # F8_E4M3 + f32 scale per output row (pre-dequantized prefill copy)
    NVFP4 = "nvfp4"                        # packed E2M1 + E4M3 scale per 16 + f32 global scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseWeight:
    """A dense matrix stored [N, K] (out, in), as in the checkpoint."""

    weight: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    @property
    def dtype(self):
        return self.weight.dtype

    @property
    def format(self) -> WeightQuantFormat:
        return WeightQuantFormat.DENSE

    def dequantize(self, dtype=None) -> jax.Array:
        return self.weight if dtype is None else self.weight.astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """E4M3 weight [N, K] with its scale; the shape of `scale` follows `format`:
    FP8_BLOCK_SCALED [ceil(N/128), ceil(K/128)], FP8_PER_TENSOR [] (ModelOpt), FP8_PER_ROW [N].
    `input_scale` is the checkpoint's static activation scale (kept for reference; w8a16 ignores it)."""

    weight: jax.Array
    scale: jax.Array
    input_scale: jax.Array | None = None
    format: WeightQuantFormat = dataclasses.field(default=WeightQuantFormat.FP8_BLOCK_SCALED,
                                                  metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def full_scale(self) -> jax.Array:
        """The scale broadcast to [N, K]."""
        n, k = self.shape
        if self.format is WeightQuantFormat.FP8_BLOCK_SCALED:
            return qf.expand_block_scale(self.scale, n, k)
        if self.format is WeightQuantFormat.FP8_PER_ROW:
            return jnp.broadcast_to(self.scale[:, None], (n, k))
        return jnp.broadcast_to(self.scale.reshape(()), (n, k))

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.weight.astype(jnp.float32) * self.full_scale()).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Nvfp4Weight:
    """NVFP4 [N, K]: packed E2M1 uint8 [N, K/2] (low nibble = even k), E4M3 scale [N, K/16],
    f32 global scale (weight_scale_2). `input_scale`: static activation global scale (W4A4), or None."""

    packed: jax.Array
    scale: jax.Array
    global_scale: jax.Array
    input_scale: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2

    @property
    def format(self) -> WeightQuantFormat:
        return WeightQuantFormat.NVFP4

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return qf.dequantize_nvfp4(self.packed, self.scale, self.global_scale).astype(dtype)

    def transposed(self) -> Nvfp4WeightT:
        """The transposed prefill layout of the same numbers."""
        return Nvfp4WeightT(jnp.asarray(self.packed).T, jnp.asarray(self.scale).T, self.global_scale)


QuantizedWeight = Nvfp4Weight  # the seed's name for the layer's default NVFP4 weights


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Nvfp4WeightT:
    """NVFP4 in the transposed prefill layout: packed_t uint8 [K/2, N] (byte [j, n] holds k = 2j in
    its low nibble, 2j + 1 in its high one), scale_t E4M3 [K/16, N], f32 global scale. Rows of N are
    contiguous, which is the [K, N] operand layout the prefill GEMM feeds its matrix units."""

    packed_t: jax.Array
    scale_t: jax.Array
    global_scale: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed_t.shape[1], self.packed_t.shape[0] * 2

    @property
    def format(self) -> WeightQuantFormat:
        return WeightQuantFormat.NVFP4

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return qf.dequantize_nvfp4(self.packed_t.T, self.scale_t.T, self.global_scale).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class W4a4Weight:
    """Marks NVFP4 weights for the W4A4 arm: activations are quantized to NVFP4 (per 16 along K)
    on the fly, with the checkpoint's input_scale as global scale when present."""

    weight: Nvfp4Weight

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    @property
    def format(self) -> WeightQuantFormat:
        return WeightQuantFormat.NVFP4

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return self.weight.dequantize(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8PrefillWeight:
    """Pre-dequantized FP8 E4M3 copy for prefill: weight [N, K] with one f32 scale per row [N]
    (built once at load from NVFP4 / FP8 / BF16 weights, so prefill runs an FP8 GEMM with no
    per-tile dequantization)."""

    weight: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def format(self) -> WeightQuantFormat:
        return WeightQuantFormat.FP8_PER_ROW

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.weight.astype(jnp.float32) * self.scale[:, None]).astype(dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Share:
    """One device's share of a block-scaled FP8 weight whose tensor-parallel split (or row permutation) puts rows
    (columns) of 128-blocks with different scales into one 128-block of the share: `weight` holds the share padded
    so that every 128-block holds rows (columns) of one checkpoint block only, with that block's scale (padding:
    zero codes). Exactly the checkpoint's numbers; the projection gathers its input columns / output rows.
      rows: int32 [N], the padded row of each of the share's output rows (a row split), or None: the first N.
      cols: int32 [K_pad], the share's input column each padded column takes (K: a zero), or None (a row split).
    On a sharded model's global arrays (every device's share side by side) `logical` is the shape of all shares
    together; the gathers and `dequantize` are a device view's (one share)."""

    weight: Fp8Weight
    rows: jax.Array | None
    cols: jax.Array | None
    logical: tuple[int, int] = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int]:
        return self.logical

    @property
    def format(self) -> WeightQuantFormat:
        return WeightQuantFormat.FP8_BLOCK_SCALED

    @property
    def input_scale(self):
        return self.weight.input_scale

    def padded_input(self, x: jax.Array) -> jax.Array:
        """x [M, K] -> the padded share's input [M, K_pad] (x itself for a row split)."""
        if self.cols is None:
            return x
        return jnp.concatenate([x, jnp.zeros((x.shape[0], 1), x.dtype)], axis=1)[:, self.cols]

    def output(self, y: jax.Array) -> jax.Array:
        """The padded share's output [M, N_pad] -> [M, N] (y itself for a column split)."""
        return y[:, :self.logical[0]] if self.rows is None else y[:, self.rows]

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        w = self.weight.dequantize(jnp.float32)
        w = w[:self.logical[0]] if self.rows is None else w[self.rows]
        if self.cols is not None:
            n, k = self.logical
            w = jnp.zeros((n, k + 1), jnp.float32).at[:, self.cols].set(w)[:, :k]
        return w.astype(dtype)


# ---- checked constructors -------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackedExperts:
    """A layer's routed experts kept quantized: `member` is one container type (block-scaled Fp8Weight or
    Nvfp4Weight) whose arrays carry a leading expert axis [E, ...]; served by the grouped kernels."""

    member: Fp8Weight | Nvfp4Weight

    @property
    def shape(self) -> tuple[int, int, int]:
        lead = self.member.weight if isinstance(self.member, Fp8Weight) else self.member.packed
        n, k = lead.shape[1], lead.shape[2] * (1 if isinstance(self.member, Fp8Weight) else 2)
        return lead.shape[0], n, k

    @property
    def format(self) -> WeightQuantFormat:
        return self.member.format

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, e: int) -> Fp8Weight | Nvfp4Weight:
        """Expert e's own container (what its checkpoint tensors hold)."""
        return jax.tree.map(lambda a: a[e], self.member)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return jax.vmap(lambda m: m.dequantize(jnp.float32))(self.member).astype(dtype)


def stack_experts(name: str, members) -> StackedExperts:
    """Stack per-expert containers (all block-scaled FP8 or all NVFP4, one shape) after checking each."""
    return StackedExperts(jax.tree.map(lambda *a: jnp.stack(a), *check_expert_members(name, members)))


def check_expert_members(name: str, members) -> list:
    """Per-expert containers checked for stacking (one format, block-scaled FP8 or NVFP4, one shape; an input
    scale kept only when every expert has one): the members as they will be stacked, nothing read."""
    members = list(members)
    kinds = {(type(m), getattr(m, "format", None)) for m in members}
    if len(kinds) != 1:
        raise WeightFormatError(f"{name}: routed experts mix formats {sorted(k[0].__name__ for k in kinds)}; "
                                "stacked experts share one")
    first = members[0]
    for e, m in enumerate(members):
        if isinstance(m, Fp8Weight):
            check_fp8(f"{name}[{e}]", m, first.shape, formats=(WeightQuantFormat.FP8_BLOCK_SCALED,))
        elif isinstance(m, Nvfp4Weight):
            check_nvfp4(f"{name}[{e}]", m, first.shape)
        else:
            raise WeightFormatError(f"{name}[{e}]: stacked experts are block-scaled Fp8Weight or Nvfp4Weight, "
                                    f"got {type(m).__name__}")
    if any(m.input_scale is None for m in members):          # kept only when every expert has one
        members = [dataclasses.replace(m, input_scale=None) for m in members]
    return members


def as_dense(name: str, value, shape: tuple[int, ...] | None = None) -> DenseWeight:
    """Wrap an array (or pass a DenseWeight through), checking its shape and that it is floating."""
    w = value if isinstance(value, DenseWeight) else DenseWeight(jnp.asarray(value))
    if not jnp.issubdtype(w.weight.dtype, jnp.floating):
        raise WeightFormatError(f"{name}: expected a floating-point dense weight, got dtype {w.weight.dtype}")
    if shape is not None and tuple(w.weight.shape) != tuple(shape):
        raise WeightFormatError(f"{name}: expected shape {tuple(shape)}, got {tuple(w.weight.shape)}")
    return w


def _check(name: str, what: str, arr, dtype, shape) -> None:
    if arr is None:
        raise WeightFormatError(f"{name}: {what} is missing")
    if jnp.dtype(arr.dtype) != jnp.dtype(dtype):
        raise WeightFormatError(f"{name}: {what} must be {jnp.dtype(dtype).name}, got {jnp.dtype(arr.dtype).name}")
    if tuple(arr.shape) != tuple(shape):
        raise WeightFormatError(f"{name}: {what} must have shape {list(shape)}, got {list(arr.shape)}")


def check_fp8(name: str, w: Fp8Weight, shape: tuple[int, int] | None = None,
              formats: tuple[WeightQuantFormat, ...] = tuple(WeightQuantFormat)) -> Fp8Weight:
    """Check an Fp8Weight's tag, dtypes and scale shape; `formats` lists the tags the caller accepts."""
    if not isinstance(w, Fp8Weight):
        raise WeightFormatError(f"{name}: expected an Fp8Weight, got {type(w).__name__}")
    if w.format not in formats:
        raise WeightFormatError(f"{name}: FP8 weight tagged {w.format.name}; accepted here: "
                                f"{', '.join(f.name for f in formats)}")
    n, k = w.weight.shape if w.weight.ndim == 2 else (None, None)
    if n is None or (shape is not None and (n, k) != tuple(shape)):
        raise WeightFormatError(f"{name}: weight must have shape {list(shape) if shape else '[N, K]'}, "
                                f"got {list(w.weight.shape)}")
    _check(name, "weight", w.weight, jnp.float8_e4m3fn, (n, k))
    scale_shape = {WeightQuantFormat.FP8_BLOCK_SCALED: qf.block_grid(n, k),
                   WeightQuantFormat.FP8_PER_TENSOR: (), WeightQuantFormat.FP8_PER_ROW: (n,)}.get(w.format)
    if scale_shape is None:
        raise WeightFormatError(f"{name}: an Fp8Weight cannot be tagged {w.format.name}")
    what = {WeightQuantFormat.FP8_BLOCK_SCALED: "block scale [ceil(N/128), ceil(K/128)]",
            WeightQuantFormat.FP8_PER_TENSOR: "per-tensor scale", WeightQuantFormat.FP8_PER_ROW: "row scale"}
    _check(name, what[w.format], w.scale, jnp.float32, scale_shape)
    return w


def clear_zero_scale_blocks(w: Fp8Weight) -> Fp8Weight:
    """The same block-scaled weight with every zero-scale block holding zero codes and scale 1 (its dequantized
    values stay 0): the FP8 GEMM that rescales its accumulator by the ratio of consecutive block scales
    (w8a16_gemm_pipelined's Mosaic arm) needs nonzero scales. Traced weights pass unchanged."""
    if isinstance(w.scale, jax.core.Tracer) or not bool(jnp.any(w.scale == 0)):
        return w
    zero = w.scale == 0
    mask = qf.expand_block_scale(zero, *w.shape)                                   # [N, K]
    return dataclasses.replace(w, weight=jnp.where(mask, jnp.zeros_like(w.weight), w.weight),
                               scale=jnp.where(zero, jnp.ones_like(w.scale), w.scale))


def fp8_weight(name: str, weight, scale, fmt: WeightQuantFormat = WeightQuantFormat.FP8_BLOCK_SCALED,
               input_scale=None, shape: tuple[int, int] | None = None) -> Fp8Weight:
    w = Fp8Weight(jnp.asarray(weight), jnp.asarray(scale),
                  None if input_scale is None else jnp.asarray(input_scale), fmt)
    return check_fp8(name, w, shape)


def check_nvfp4(name: str, w: Nvfp4Weight, shape: tuple[int, int] | None = None) -> Nvfp4Weight:
    if not isinstance(w, Nvfp4Weight):
        raise WeightFormatError(f"{name}: expected an Nvfp4Weight, got {type(w).__name__}")
    if w.packed.ndim != 2:
        raise WeightFormatError(f"{name}: packed weight must be [N, K/2], got {list(w.packed.shape)}")
    n, k = w.shape
    if shape is not None and (n, k) != tuple(shape):
        raise WeightFormatError(f"{name}: packed weight must be {[shape[0], shape[1] // 2]} (K = {shape[1]}), "
                                f"got {list(w.packed.shape)}")
    if k % qf.NVFP4_GROUP:
        raise WeightFormatError(f"{name}: K = {k} is not a multiple of {qf.NVFP4_GROUP}")
    _check(name, "packed weight", w.packed, jnp.uint8, (n, k // 2))
    _check(name, "weight_scale (per 16 along K)", w.scale, jnp.float8_e4m3fn, (n, k // qf.NVFP4_GROUP))
    _check(name, "weight_scale_2 (global scale)", w.global_scale, jnp.float32, ())
    if w.input_scale is not None:
        _check(name, "input_scale", w.input_scale, jnp.float32, ())
    return w


def nvfp4_weight(name: str, packed, scale, global_scale, input_scale=None,
                 shape: tuple[int, int] | None = None) -> Nvfp4Weight:
    w = Nvfp4Weight(jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(global_scale).reshape(()),
                    None if input_scale is None else jnp.asarray(input_scale).reshape(()))
    return check_nvfp4(name, w, shape)


def check_nvfp4_t(name: str, w: Nvfp4WeightT, shape: tuple[int, int] | None = None) -> Nvfp4WeightT:
    if not isinstance(w, Nvfp4WeightT):
        raise WeightFormatError(f"{name}: expected an Nvfp4WeightT (transposed NVFP4), got {type(w).__name__}")
    if w.packed_t.ndim != 2:
        raise WeightFormatError(f"{name}: packed_t must be [K/2, N], got {list(w.packed_t.shape)}")
    n, k = w.shape
    if shape is not None and (n, k) != tuple(shape):
        raise WeightFormatError(f"{name}: packed_t must be {[shape[1] // 2, shape[0]]}, got {list(w.packed_t.shape)}")
    if k % qf.NVFP4_GROUP:
        raise WeightFormatError(f"{name}: K = {k} is not a multiple of {qf.NVFP4_GROUP}")
    _check(name, "packed_t", w.packed_t, jnp.uint8, (k // 2, n))
    _check(name, "scale_t", w.scale_t, jnp.float8_e4m3fn, (k // qf.NVFP4_GROUP, n))
    _check(name, "global scale", w.global_scale, jnp.float32, ())
    return w


def check_fp8_prefill(name: str, w: Fp8PrefillWeight, shape: tuple[int, int] | None = None) -> Fp8PrefillWeight:
    if not isinstance(w, Fp8PrefillWeight):
        raise WeightFormatError(f"{name}: expected an Fp8PrefillWeight, got {type(w).__name__}")
    if w.weight.ndim != 2 or (shape is not None and tuple(w.weight.shape) != tuple(shape)):
        raise WeightFormatError(f"{name}: weight must have shape {list(shape) if shape else '[N, K]'}, "
                                f"got {list(w.weight.shape)}")
    _check(name, "weight", w.weight, jnp.float8_e4m3fn, w.weight.shape)
    _check(name, "row scale", w.scale, jnp.float32, (w.weight.shape[0],))
    return w


# ---- conversions between containers -----------------------------------------------------------
def fp8_to_block_scaled(w: Fp8Weight) -> Fp8Weight:
    """Expand a per-tensor scale to the 128x128 block grid (exact: same numbers, same E4M3 codes).
    A per-row scale cannot be expressed on 128-row blocks without requantizing: see requantize_fp8_block."""
    if w.format is WeightQuantFormat.FP8_BLOCK_SCALED:
        return w
    if w.format is not WeightQuantFormat.FP8_PER_TENSOR:
        raise WeightFormatError(f"fp8_to_block_scaled: cannot expand a {w.format.name} scale exactly; "
                                "requantize with requantize_fp8_block")
    n, k = w.shape
    grid = jnp.broadcast_to(jnp.asarray(w.scale, jnp.float32).reshape(()), qf.block_grid(n, k))
    return Fp8Weight(w.weight, grid, w.input_scale, WeightQuantFormat.FP8_BLOCK_SCALED)


def quantize_fp8_block_weight(w) -> Fp8Weight:
    """Any container or array [N, K] -> block-scaled FP8 (dequantize, then quantize per 128x128)."""
    dense = np.asarray(w.dequantize(jnp.float32) if hasattr(w, "dequantize") else w, np.float32)
    q, s = qf.quantize_fp8_block(dense)
    return Fp8Weight(jnp.asarray(q), jnp.asarray(s), None, WeightQuantFormat.FP8_BLOCK_SCALED)


requantize_fp8_block = quantize_fp8_block_weight


def quantize_nvfp4_weight(w) -> Nvfp4Weight:
    """Any container or array [N, K] -> NVFP4 (ModelOpt's recipe: global amax/(6*448), E4M3 per 16)."""
    dense = np.asarray(w.dequantize(jnp.float32) if hasattr(w, "dequantize") else w, np.float32)
    packed, scale, g = qf.quantize_nvfp4(dense)
    return Nvfp4Weight(jnp.asarray(packed), jnp.asarray(scale), jnp.asarray(g))


def fp8_prefill_copy(w) -> Fp8PrefillWeight:
    """The pre-dequantized FP8 E4M3 prefill copy of any container or array [N, K]."""
    base = w.weight if isinstance(w, W4a4Weight) else w
    dense = np.asarray(base.dequantize(jnp.float32) if hasattr(base, "dequantize") else base, np.float32)
    q, s = qf.quantize_fp8_rows(dense)
    return Fp8PrefillWeight(jnp.asarray(q), jnp.asarray(s))
