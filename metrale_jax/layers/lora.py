"""LoRA overlays on a Projection: y = W x + scale_a * B_a (A_a x), a = the adapter of each row.

A `LoraOverlay` sits beside a projection's arms and never touches them: the base arm (BF16, FP8, NVFP4, ...) runs
exactly as without it, with a float32 output, and the low-rank path runs beside it in float32; the sum is rounded
once to the output dtype. It holds every adapter the model has loaded, stacked: A [S, R, K] and B [S, N, R]
(`LoraParam`: the only trainable state of a LoRA fine-tune), scale [S] float32; adapter index s + 1 is slot s
(index 0 means no adapter). An adapter that does not target this projection has zeros in its slot; ranks are
zero-padded to the largest R (exact: the padding adds zero products).

Which adapter each row uses (several adapters batched in one step, as vLLM's multi-LoRA batches them): a step
function scopes a per-slot table of adapter indices (`slot_adapters`), the block loop scopes each block's rows in
that block's own row order (`block_rows`: the Mamba prefill packs its rows), and a Projection with an overlay reads
its rows' indices (`row_adapters`). A row's low-rank product is masked to its own adapter (the other adapters'
columns are multiplied by exactly 0), so a row's result does not depend on which adapters the other rows use.
Outside any scope (a layer called on its own) the overlay adds nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from metrale_jax.errors import ShapeError

HIGHEST = jax.lax.Precision.HIGHEST

# the per-slot adapter table of the step being traced, and the per-row indices of the block being traced
_SLOT_TABLE: contextvars.ContextVar = contextvars.ContextVar("lora_slot_table", default=None)
_ROWS: contextvars.ContextVar = contextvars.ContextVar("lora_rows", default=None)


class LoraParam(nnx.Param):
    """A LoRA factor (A or B): `nnx.split(model, LoraParam, ...)` is a fine-tune's trainable state."""


class LoraScale(nnx.Variable):
    """The per-adapter scale (lora_alpha / r, or / sqrt(r) with rslora): not trained."""


class UnmergedWeight(nnx.Variable):
    """A projection's dense weights as they were before an adapter was merged into them (restored on unload)."""


class _Overlay(nnx.Module):
    """S adapters' a, b (LoraParam) and scale [S]. `merged`: the index of the adapter folded into the base weights
    (its term is skipped here), 0 for none; `unmerged`: the base weights from before that merge."""

    def __init__(self, a: jax.Array, b: jax.Array, scale: jax.Array):
        self.a = LoraParam(jnp.asarray(a, jnp.float32))
        self.b = LoraParam(jnp.asarray(b, jnp.float32))
        self.scale = LoraScale(jnp.asarray(scale, jnp.float32))
        self.merged = 0
        self.unmerged = nnx.data(None)

    @property
    def num_adapters(self) -> int:
        return self.a.shape[0]

    def _live_scales(self) -> jax.Array:
        """scale [S] with the merged adapter's entry 0 (its term is in the base weights)."""
        scale = self.scale[...]
        return scale.at[self.merged - 1].set(0.0) if self.merged else scale


class LoraOverlay(_Overlay):
    """The adapters of one projection [N, K]: a [S, R, K], b [S, N, R], scale [S]; `merged` / `unmerged` as
    `_Overlay`'s (the base weights before the merge)."""

    def delta(self, x: jax.Array, rows: jax.Array) -> jax.Array:
        """sum_s [rows == s + 1] scale_s B_s A_s x per row: x [M, K], rows [M] int -> [M, N] float32."""
        return low_rank(x, rows, self.a[...], self.b[...], self._live_scales())


class ExpertLoraOverlay(_Overlay):
    """The adapters of one stack of routed experts [E, N, K] (a MoE layer's up or down projections): a
    [S, E, R, K], b [S, E, N, R] (LoraParam), scale [S]; beside the grouped GEMM, never in its weights.
    `merged` / `unmerged` as `_Overlay`'s (the stack before the merge)."""

    def delta(self, x: jax.Array, group_sizes: jax.Array, rows: jax.Array) -> jax.Array:
        """Rows of x [M, K] sorted by expert (group_sizes [E]; rows past their sum join no group and get 0),
        rows [M] each row's adapter index -> [M, N] float32."""
        return expert_low_rank(x, group_sizes, rows, self.a[...], self.b[...], self._live_scales())


def _ragged(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Rows of x [M, K] sorted by group times that group's w [E, N, K] -> [M, N] float32."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))
    return jax.lax.ragged_dot_general(x, w, group_sizes, dims, precision=HIGHEST,
                                      preferred_element_type=jnp.float32)


def expert_low_rank(x: jax.Array, group_sizes: jax.Array, rows: jax.Array, a: jax.Array, b: jax.Array,
                    scale: jax.Array) -> jax.Array:
    """The masked low-rank product of grouped rows: every adapter's columns side by side (S*R per expert), each
    row's other adapters' columns zeroed between the two grouped matmuls. x [M, K], group_sizes [E], rows [M],
    a [S, E, R, K], b [S, E, N, R], scale [S] -> [M, N] float32."""
    S, E, R, K = a.shape
    N = b.shape[2]
    at = a.transpose(1, 0, 2, 3).reshape(E, S * R, K)                                         # [E, S*R, K]
    bt = b.transpose(1, 2, 0, 3).reshape(E, N, S * R)                                         # [E, N, S*R]
    xa = _ragged(x.astype(jnp.float32), at, group_sizes)                                      # [M, S*R]
    pick = jnp.where(rows[:, None] == jnp.arange(1, S + 1, dtype=rows.dtype)[None, :], scale[None, :], 0.0)
    return _ragged(xa * jnp.repeat(pick, R, axis=1), bt, group_sizes)                         # [M, N]


def low_rank(x: jax.Array, rows: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array) -> jax.Array:
    """The masked low-rank product: two matmuls over all adapters' columns, each row's other adapters' columns
    zeroed between them (x [M, K], rows [M] with 0 = none, a [S, R, K], b [S, N, R], scale [S]) -> [M, N] f32."""
    S, R, K = a.shape
    xa = jnp.einsum("mk,srk->msr", x.astype(jnp.float32), a, precision=HIGHEST)              # [M, S, R]
    pick = jnp.where(rows[:, None] == jnp.arange(1, S + 1, dtype=rows.dtype)[None, :], scale[None, :], 0.0)
    return jnp.einsum("msr,snr->mn", xa * pick[:, :, None], b, precision=HIGHEST)


# ---- which adapter each row uses ------------------------------------------------------------------
@contextlib.contextmanager
def slot_adapters(table: jax.Array | None) -> Iterator[None]:
    """Scope a step's per-slot adapter indices (table [num_slots] int32). None leaves the scope as it is (a
    step called by another that scoped a table, as the Engine's steps call the model's, keeps that table)."""
    if table is None:
        yield
        return
    token = _SLOT_TABLE.set(jnp.asarray(table, jnp.int32))
    try:
        yield
    finally:
        _SLOT_TABLE.reset(token)


@contextlib.contextmanager
def block_rows(rows, *, packed: bool) -> Iterator[None]:
    """Scope one block's per-row adapter indices from the step's slot table: PrefillRows [B, T] in the padded
    order (b * T + t), or packed (rows.src) for a block that packs its real rows (the Mamba prefill); DecodeRows
    n sequences x k rows, sequence-major. Nothing when no table is scoped."""
    table = _SLOT_TABLE.get()
    if table is None:
        yield
        return
    per_sequence = table[rows.slots]
    if getattr(rows, "valid", None) is not None:                       # PrefillRows
        idx = jnp.repeat(per_sequence, rows.valid.shape[1])
        idx = idx[rows.src] if packed else idx
    else:                                                              # DecodeRows
        idx = jnp.repeat(per_sequence, rows.k)
    token = _ROWS.set(idx)
    try:
        yield
    finally:
        _ROWS.reset(token)


def scoped_table() -> jax.Array | None:
    """The per-slot adapter table in scope (None outside any): what a mesh step passes into its shard_map."""
    return _SLOT_TABLE.get()


@contextlib.contextmanager
def head_rows(slots: jax.Array) -> Iterator[None]:
    """Scope the adapter index of each row given to the logits projection (lm_head) from the slot of each row
    (slots [M]); nothing when no table is scoped."""
    table = _SLOT_TABLE.get()
    if table is None:
        yield
        return
    token = _ROWS.set(table[slots])
    try:
        yield
    finally:
        _ROWS.reset(token)


def row_adapters(name: str, m: int) -> jax.Array | None:
    """The adapter index of each of a projection's m input rows in the current block, or None outside a scope.
    Rows past the scoped ones (a block's own padding rows, e.g. the Mamba decode's second row for a lone
    sequence, whose output it drops) get none."""
    idx = _ROWS.get()
    if idx is None:
        return None
    if idx.shape[0] > m:
        raise ShapeError(f"{name}: {m} input rows, but the block's rows carry {idx.shape[0]} adapter indices")
    return jnp.pad(idx, (0, m - idx.shape[0])) if idx.shape[0] < m else idx
