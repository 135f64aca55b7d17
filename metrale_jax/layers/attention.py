"""NemotronAttentionLayer: residual + causal GQA attention(RMSNorm(x)), KV in a slot-indexed KvPool.

Nemotron-H attention has no positional rotation: q/k/v projections, softmax(q k^T * head_dim**-0.5)
in float32 under a causal mask, o_proj. Every entry point is a pure function of (layer weights,
KvPool, inputs) and returns the new pool. Keys and values are stored in the pool's dtype and every
path attends to keys in that dtype, so prefill and decode see the same numbers. A step of one token per
sequence attends through the `decode_attention` kernel, which reads the positions each sequence holds in the pool
in place and, in decode, writes the step's keys and values itself (the other paths scatter them first and gather
the slot's whole max_len and mask: `pallas_kernels.attention.attend`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from metrale_jax.config import ModelConfig, ModelLevers
from metrale_jax.errors import ShapeError, WeightFormatError
from metrale_jax.layers.blocks import (close_block, close_block_across_devices, input_rmsnorm, linear, optional_param,
                                      param, rows_of, value_of)
from metrale_jax.layers.capabilities import LayerCapabilities
from metrale_jax.layers.checks import (check_array, check_layer_index, check_one_slot, check_slots, host_integers,
                                       positive_int, start_positions, static_int)
from metrale_jax.layers.projection import Projection
from metrale_jax.state.kv_pool import KvPool
from pallas_kernels import registry
from pallas_kernels.attention import attend
from pallas_kernels.split_partials import SplitPartials


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NemotronAttentionWeights:
    """The attention mixer's weights as the checkpoint holds them (biases only with attention_bias)."""

    q_proj: Any                     # [H * hd, D]
    k_proj: Any                     # [KVH * hd, D]
    v_proj: Any                     # [KVH * hd, D]
    o_proj: Any                     # [D, H * hd]
    q_bias: jax.Array | None = None  # [H * hd]
    k_bias: jax.Array | None = None  # [KVH * hd]
    v_bias: jax.Array | None = None  # [KVH * hd]
    o_bias: jax.Array | None = None  # [D]


class NemotronAttentionLayer(LayerCapabilities, nnx.Module):
    """A Nemotron-H attention block (pattern character *)."""

    supports_replay_tail_split = True
    pool_field = "kv"
    block_kind = "attention"
    # mesh axis o_proj's partial sums are reduced over; set on a tensor-parallel device view (sharding.py)
    tp_axis: str | None = None

    def __init__(self, input_norm, attn: NemotronAttentionWeights, config: ModelConfig, layer_idx: int, *,
                 pool_layer: int | None = None, levers: ModelLevers | None = None):
        check_layer_index(config, layer_idx, "*")
        levers = levers or ModelLevers()
        c = config
        self._config = config                     # shown once, by the model (LayerCapabilities.config)
        self.layer_idx = layer_idx
        self.pool_layer = c.attention_layer_ids.index(layer_idx) if pool_layer is None else pool_layer
        self.kernels = levers.kernels
        self.scale = c.head_dim ** -0.5
        name = f"backbone.layers.{layer_idx}"
        D, H, KVH, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.input_norm = param(f"{name}.norm.weight", input_norm, (D,))
        self.q_proj = Projection(f"{name}.mixer.q_proj", H * hd, D, kernels=self.kernels)
        self.k_proj = Projection(f"{name}.mixer.k_proj", KVH * hd, D, kernels=self.kernels)
        self.v_proj = Projection(f"{name}.mixer.v_proj", KVH * hd, D, kernels=self.kernels)
        self.o_proj = Projection(f"{name}.mixer.o_proj", D, H * hd, kernels=self.kernels)
        biases = (attn.q_bias, attn.k_bias, attn.v_bias, attn.o_bias)
        if c.attention_bias and any(b is None for b in biases):
            raise WeightFormatError(f"{name}.mixer: attention_bias is true, but q/k/v/o biases are missing")
        if not c.attention_bias and any(b is not None for b in biases):
            raise WeightFormatError(f"{name}.mixer: biases given, but attention_bias is false")
        self.q_bias = optional_param(f"{name}.mixer.q_proj.bias", attn.q_bias, (H * hd,))
        self.k_bias = optional_param(f"{name}.mixer.k_proj.bias", attn.k_bias, (KVH * hd,))
        self.v_bias = optional_param(f"{name}.mixer.v_proj.bias", attn.v_bias, (KVH * hd,))
        self.o_bias = optional_param(f"{name}.mixer.o_proj.bias", attn.o_bias, (D,))
        self.set_weights(attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)

    # ---- weights -------------------------------------------------------------------------
    def set_weights(self, q_proj, k_proj, v_proj, o_proj) -> None:
        """Install each container in the arm its type names (Projection.set_weight: dense -> BF16 native,
        FP8 -> native FP8 with a per-tensor scale expanded to the block grid, NVFP4 -> w4a16)."""
        for proj, w in zip(self._projections(), (q_proj, k_proj, v_proj, o_proj)):
            proj.set_weight(w)

    def set_bf16_weights(self, q_proj, k_proj, v_proj, o_proj) -> None:
        for proj, w in zip(self._projections(), (q_proj, k_proj, v_proj, o_proj)):
            proj.set_dense(w)

    def _projections(self) -> tuple[Projection, ...]:
        return self.q_proj, self.k_proj, self.v_proj, self.o_proj

    def bf16_native_ready(self) -> bool:
        return all(p.dense_ready() for p in self._projections())

    def attention_weights(self) -> NemotronAttentionWeights:
        return NemotronAttentionWeights(
            *(p.base_weight() for p in self._projections()), q_bias=value_of(self.q_bias),
            k_bias=value_of(self.k_bias), v_bias=value_of(self.v_bias), o_bias=value_of(self.o_bias))

    checkpoint_weights = attention_weights          # what every block kind answers (the model's state_dict)

    def active_arm(self, phase: str, tokens: int) -> dict[str, str]:
        return {p.name.rsplit(".", 1)[-1]: p.active_arm(phase, tokens) for p in self._projections()}

    # ---- slots ---------------------------------------------------------------------------
    def alloc_state(self, allocator, pool: KvPool):
        """A zeroed slot for a new sequence: (slot, new pool)."""
        return allocator.alloc(pool)

    def release_state(self, allocator, slot: int) -> None:
        allocator.release(slot)

    # ---- core ----------------------------------------------------------------------------
    def _check_pool(self, pool: KvPool) -> None:
        c = self.config
        if not isinstance(pool, KvPool):
            raise ShapeError(f"pool: expected a KvPool, got {type(pool).__name__}")
        if self.pool_layer >= pool.num_layers:
            raise ShapeError(f"pool: has {pool.num_layers} layers; this layer uses row {self.pool_layer}")
        check_array("pool.k", pool.k, (None, None, None, c.num_key_value_heads, c.head_dim))
        check_array("pool.v", pool.v, tuple(pool.k.shape))

    def _run(self, pool: KvPool, slots: jax.Array, hidden, lengths: jax.Array, starts, phase: str, B: int, T: int,
             hand_on: bool = False):
        """hidden [B*T, D] (or a PendingResidual, layers/blocks.py): rows t < lengths[b] at positions
        starts[b] + t, row b*T + t.  starts None: new sequences that attend only to their own rows; else the rows
        also attend to the slot's cached prefix. Returns ([B*T, D] or, with hand_on, maybe pending; the pool). The
        new keys and values go into the pool by a scatter, or in decode (one token per row) by the decode
        attention kernel itself."""
        c = self.config
        H, KVH, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        hidden, x = input_rmsnorm(hidden, self.input_norm[...], eps=c.layer_norm_epsilon,
                                  projections=(self.q_proj, self.k_proj, self.v_proj), phase=phase,
                                  kernels=self.kernels)
        base = jnp.zeros((B,), jnp.int32) if starts is None else starts
        l, L = self.pool_layer, pool.max_len
        if phase == "decode" and T == 1:     # one token per row (every row valid): the kernel appends it itself
            q = linear(self.q_proj, self.q_bias, x, phase).reshape(B, KVH, H // KVH, hd)
            new_kv = tuple(self._new_keys_or_values(proj, bias, x, pool)
                           for proj, bias in ((self.k_proj, self.k_bias), (self.v_proj, self.v_bias)))
            o, pk, pv = registry.get("decode_attention", self.kernels)(                   # o [B, KVH, G, hd]
                q, pool.k, pool.v, slots, base + lengths, layer=l, scale=self.scale, out_dtype=hidden.dtype,
                new_kv=new_kv)
            return self._close(hidden, o.reshape(B, H * hd), phase, hand_on), KvPool(pk, pv)
        q = linear(self.q_proj, self.q_bias, x, phase).reshape(B, T, KVH, H // KVH, hd)
        k = linear(self.k_proj, self.k_bias, x, phase).reshape(B, T, KVH, hd).astype(pool.k.dtype)
        v = linear(self.v_proj, self.v_bias, x, phase).reshape(B, T, KVH, hd).astype(pool.v.dtype)
        t = jnp.arange(T, dtype=jnp.int32)
        pos = base[:, None] + t[None, :]                                          # [B, T]
        valid = t[None, :] < lengths[:, None]
        wpos = jnp.where(valid & (pos < L), pos, L)                               # out of range: dropped
        pk = pool.k.at[l, slots[:, None], wpos].set(k, mode="drop")
        pv = pool.v.at[l, slots[:, None], wpos].set(v, mode="drop")
        if starts is None:
            o = attend(q, k, v, pos, t, lengths, self.scale)                     # [B, T, KVH, G, hd]
        elif T == 1:                         # one token per row: the positions each row holds, read in the pool
            o = registry.get("decode_attention", self.kernels)(q[:, 0], pk, pv, slots, base + lengths, layer=l,
                                                                scale=self.scale, out_dtype=hidden.dtype)[:, None]
        else:
            o = attend(q, pk[l, slots], pv[l, slots], pos, jnp.arange(L, dtype=jnp.int32), base + lengths,
                       self.scale)
        return self._close(hidden, o.astype(hidden.dtype).reshape(B * T, H * hd), phase, hand_on), KvPool(pk, pv)

    @staticmethod
    def _new_keys_or_values(proj, bias, x, pool: KvPool) -> jax.Array | SplitPartials:
        """A decode step's keys (or values) for the decode attention kernel: k_proj's (v_proj's) split-K partials
        where its GEMV hands them on and the pool's dtype is its output dtype (the kernel sums and rounds them
        once: the same bits, no sum launch), else its output [B, KVH, hd] in the pool's dtype."""
        if bias is None and pool.k.dtype == x.dtype and proj.hands_on_partials("decode", x.shape[0]):
            return proj.partials(x, phase="decode")
        return linear(proj, bias, x, "decode").reshape(x.shape[0], *pool.k.shape[3:]).astype(pool.k.dtype)

    def _close(self, hidden: jax.Array, o: jax.Array, phase: str, hand_on: bool):
        """hidden + o_proj(o) (+ o_bias), o [B*T, H*hd]: the block's output (or, with hand_on, maybe pending)."""
        if self.tp_axis is not None:
            return close_block_across_devices(hidden, self.o_proj(o, phase=phase, out_dtype=jnp.float32), self.o_bias,
                                              self.tp_axis, phase, hand_on)
        return close_block(hidden, self.o_proj, o, phase, hand_on, bias=self.o_bias)

    def _check(self, pool: KvPool, hidden: jax.Array, name: str = "hidden") -> None:
        check_array(name, hidden, (None, None, self.config.hidden_size), floating=True)
        self._check_pool(pool)

    # ---- prefill -------------------------------------------------------------------------
    def prefill_batched(self, pool: KvPool, slots: jax.Array, hidden: jax.Array, lengths: jax.Array,
                        seq_len_starts: jax.Array | None = None) -> tuple[jax.Array, KvPool]:
        """Right-padded requests: slots [B], hidden [B, T, D], lengths [B].  seq_len_starts None: new
        sequences at position 0 (attending to their own rows only); else [B] (or a scalar) positions to
        continue from, attending to the slot's cached prefix.  Padded rows write nothing."""
        self._check(pool, hidden)
        B = hidden.shape[0]
        slots = check_slots("slots", slots, B, pool.num_slots)
        known = host_integers("lengths", lengths)
        lengths = jnp.asarray(lengths)
        check_array("lengths", lengths, (B,), integer=True)
        if known is not None and ((known < 0) | (known > hidden.shape[1])).any():
            raise ShapeError(f"lengths: expected each in [0, {hidden.shape[1]}] (hidden's T), "
                             f"got {known.tolist()!s:.80}")
        starts = None if seq_len_starts is None else start_positions("seq_len_starts", seq_len_starts, B)
        _check_span("seq_len_starts", 0 if seq_len_starts is None else seq_len_starts, known, pool.max_len)
        B, T, D = hidden.shape
        out, pool = self._run(pool, slots, hidden.reshape(B * T, D), lengths.astype(jnp.int32), starts, "prefill",
                              B, T)
        return out.reshape(B, T, D), pool

    def prefill(self, pool: KvPool, slot, hidden: jax.Array, seq_len_start=0) -> tuple[jax.Array, KvPool]:
        """T tokens of one sequence at positions seq_len_start.. .  hidden [T, D] -> ([T, D], pool)."""
        check_array("hidden", hidden, (None, self.config.hidden_size), floating=True)
        self._check_pool(pool)
        slots = check_one_slot("slot", slot, pool.num_slots)
        start = start_positions("seq_len_start", seq_len_start, 1)
        _check_span("seq_len_start", seq_len_start, np.array([hidden.shape[0]]), pool.max_len)
        out, pool = self.prefill_batched(pool, slots, hidden[None], jnp.array([hidden.shape[0]], jnp.int32), start)
        return out[0], pool

    def prefill_replay_tail(self, pool: KvPool, slot, hidden: jax.Array, cut: int, seq_len_start=0):
        """Prefill split at row `cut`: the tail runs as a prefill starting there (its keys come from the
        pool).  Returns (hidden [T, D], pool, None): the KV prefix needs no separate capture."""
        T = hidden.shape[0]
        cut = static_int("cut", cut, 0, T)
        start = start_positions("seq_len_start", seq_len_start, 1)[0]
        parts = []
        for lo, hi in ((0, cut), (cut, T)):
            if hi > lo:
                part, pool = self.prefill(pool, slot, hidden[lo:hi], start + lo)
                parts.append(part)
        return jnp.concatenate(parts, axis=0), pool, None

    # ---- the block loop (layers/stack.py) -------------------------------------------------
    def prefill_rows(self, pool: KvPool, rows, hidden: jax.Array):
        """hidden [B, T, D] of PrefillRows -> (hidden, pool, None)."""
        hidden, pool = self.prefill_batched(pool, rows.slots, hidden, rows.lengths, rows.starts)
        return hidden, pool, None

    def decode_rows(self, pool: KvPool, rows, hidden):
        """hidden [n*k, D] of DecodeRows (or pending) -> (hidden, maybe handed on as pending; pool, None)."""
        hidden, pool = self.decode_verify_multi(pool, rows.slots, hidden, rows.positions, rows.k, hand_on=True)
        return hidden, pool, None

    # ---- decode --------------------------------------------------------------------------
    def decode_verify_multi(self, pool: KvPool, slots: jax.Array, hidden: jax.Array, positions: jax.Array,
                            k: int, *, hand_on: bool = False) -> tuple[jax.Array, KvPool]:
        """k consecutive tokens for each of n sequences, rows sequence-major (r = i*k + j), sequence i's
        first row at positions[i].  slots [n], hidden [n*k, D] -> ([n*k, D], pool). In the block loop
        (hand_on) the stream may come in and go out as a PendingResidual (layers/blocks.py)."""
        rows = rows_of(hidden)
        check_array("hidden", rows, (None, self.config.hidden_size), floating=True)
        self._check_pool(pool)
        k = positive_int("k", k)
        if rows.shape[0] % k:
            raise ShapeError(f"hidden: {rows.shape[0]} rows is not a multiple of k={k}")
        n = rows.shape[0] // k
        slots = check_slots("slots", slots, n, pool.num_slots)
        _check_span("positions", positions, np.full((n,), k), pool.max_len)
        positions = start_positions("positions", positions, n)
        return self._run(pool, slots, hidden, jnp.full((n,), k, jnp.int32), positions, "decode", n, k, hand_on)

    def decode_multi_seq(self, pool: KvPool, slots: jax.Array, hidden: jax.Array,
                         positions: jax.Array) -> tuple[jax.Array, KvPool]:
        """One token for each of N sequences at its own position.  slots [N], hidden [N, D], positions [N]."""
        return self.decode_verify_multi(pool, slots, hidden, positions, 1)

    def decode(self, pool: KvPool, slot, hidden: jax.Array, position) -> tuple[jax.Array, KvPool]:
        """One token of one sequence at `position`.  hidden [D] or [1, D] -> same shape."""
        squeeze = hidden.ndim == 1
        h = hidden[None] if squeeze else hidden
        if h.shape[0] != 1:
            raise ShapeError(f"hidden: decode takes one token ([D] or [1, D]), got {tuple(hidden.shape)}")
        self._check_pool(pool)
        slots, positions = check_one_slot("slot", slot, pool.num_slots), start_positions("position", position, 1)
        _check_span("position", position, np.ones((1,), np.int64), pool.max_len)
        out, pool = self.decode_multi_seq(pool, slots, h, positions)
        return (out[0] if squeeze else out), pool



def _check_span(name: str, starts, lengths, max_len: int) -> None:
    """Rows at positions starts.. starts + lengths fit the pool's max_len, where both are known on the host: a key
    past max_len would be dropped by the scatter and missing from every later attention."""
    known = host_integers(name, starts)
    if known is None or lengths is None:
        return
    ends = np.broadcast_to(known, np.shape(lengths)).astype(np.int64) + lengths
    if ends.size and ends.max() > max_len:
        raise ShapeError(f"{name}: rows up to position {int(ends.max()) - 1} do not fit the pool's max_len "
                         f"{max_len}")
