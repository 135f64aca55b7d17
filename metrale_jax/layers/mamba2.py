"""NemotronMamba2Layer: residual + Mamba-2 mixer(RMSNorm(x)), with the seed's entry points.

Mixer: in_proj -> (z, xBC, dt); causal conv1d + silu on xBC -> (x, B, C); SSD scan (prefill) or the
recurrent update (decode) with dt = softplus(dt + dt_bias) clamped to time_step_limit and
A = -exp(A_log); y = rmsnorm_group(y * silu(z)) * w; out_proj. Every entry point is a pure function
of (layer weights, SsmPool, inputs) and returns the new pool; nothing is updated in place.
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
from metrale_jax.layers.blocks import (close_block, close_block_across_devices, gated_rmsnorm_across_devices,
                                      open_block, rows_of, settled)
from metrale_jax.layers.capabilities import LayerCapabilities
from metrale_jax.layers.checks import (check_array, check_layer_index, check_one_slot, check_slots, host_integers,
                                       positive_int, start_positions, static_int)
from metrale_jax.layers.projection import Projection
from metrale_jax.state.ssm_pool import SlotState, SsmPool
from metrale_jax.weights.containers import DenseWeight, as_dense
from metrale_jax.weights.quant_formats import FP8_BLOCK
from pallas_kernels import norm_fp8, registry


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NemotronSsmWeights:
    """The Mamba-2 mixer's weights as the checkpoint holds them (seed: NemotronSsmWeights)."""

    in_proj: Any                     # [I + conv_dim + H, D]: DenseWeight, Nvfp4Weight, W4a4Weight or Fp8Weight
    out_proj: Any                    # [D, I]
    conv1d_weight: jax.Array         # [conv_dim, K]
    conv1d_bias: jax.Array | None    # [conv_dim]
    dt_bias: jax.Array               # [H]
    A_log: jax.Array                 # [H]
    D: jax.Array                     # [H]
    norm_weight: jax.Array           # [I]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SsmPrefillBuffers:
    """What prefill phase 1 stages for phase 2 (the scan) and phase 3 (gated norm + out_proj)."""

    z: jax.Array                  # [T, I]  gate
    xbc: jax.Array                # [T, conv_dim]  after conv1d + silu
    dt: jax.Array                 # [T, H]  raw (before dt_bias / softplus)
    y: jax.Array | None = None    # [T, H, P]  scan output, set by phase 2


class NemotronMamba2Layer(LayerCapabilities, nnx.Module):
    """A Nemotron-H Mamba-2 block (pattern character M)."""

    is_ssm_layer = True
    uses_ssm_pool = True
    supports_replay_tail_split = True
    pool_field = "ssm"
    block_kind = "mamba"
    # mesh axis out_proj's partial sums are reduced over; set on a tensor-parallel device view (sharding.py)
    tp_axis: str | None = None
    # global channels of a gated-norm group when such a group is split over the devices (sharding.DeviceShare)
    norm_group: int | None = None

    def __init__(self, input_norm, ssm: NemotronSsmWeights, config: ModelConfig, layer_idx: int, *,
                 pool_layer: int | None = None, levers: ModelLevers | None = None):
        check_layer_index(config, layer_idx, "M")
        levers = levers or ModelLevers()
        self._config = config                     # shown once, by the model (LayerCapabilities.config)
        self.layer_idx = layer_idx
        self.pool_layer = config.mamba_layer_ids.index(layer_idx) if pool_layer is None else pool_layer
        self.chunk_size = levers.ssm_chunk_size(config)
        self.kernels = levers.kernels
        self.gated_norm_quant = levers.gated_norm_quant
        c = config
        name = f"backbone.layers.{layer_idx}"
        H, I, C, K, D = c.mamba_num_heads, c.d_inner, c.conv_dim, c.conv_kernel, c.hidden_size
        self.input_norm = nnx.Param(_vector(f"{name}.norm.weight", input_norm, D))
        self.conv1d_weight = nnx.Param(_tensor(f"{name}.mixer.conv1d.weight", ssm.conv1d_weight, (C, K)))
        if c.use_conv_bias and ssm.conv1d_bias is None:
            raise WeightFormatError(f"{name}.mixer.conv1d.bias: missing, but use_conv_bias is true")
        self.conv1d_bias = (None if ssm.conv1d_bias is None else
                            nnx.Param(_vector(f"{name}.mixer.conv1d.bias", ssm.conv1d_bias, C)))
        self.dt_bias = nnx.Param(_vector(f"{name}.mixer.dt_bias", ssm.dt_bias, H))
        self.A_log = nnx.Param(_vector(f"{name}.mixer.A_log", ssm.A_log, H))
        self.D = nnx.Param(_vector(f"{name}.mixer.D", ssm.D, H))
        self.norm_weight = nnx.Param(_vector(f"{name}.mixer.norm.weight", ssm.norm_weight, I))
        self.in_proj = Projection(f"{name}.mixer.in_proj", c.in_proj_dim, D, kernels=self.kernels)
        self.out_proj = Projection(f"{name}.mixer.out_proj", D, I, kernels=self.kernels)
        # the layer's own projections: each container installs in the arm its type names (BF16 dense, NVFP4
        # default w4a16, W4A4, block-scaled FP8 native; an FP8 default honours native_fp8_ssm=decode)
        fp8_prefill = levers.native_fp8_ssm != "decode"
        prepared = [(p, p.arm_for(w), w) for p, w in ((self.in_proj, ssm.in_proj), (self.out_proj, ssm.out_proj))]
        prepared = [(p, arm, p.prepare(arm, w, prefill=fp8_prefill)) for p, arm, w in prepared]
        for p, arm, w in prepared:
            p.install(arm, w, prefill=fp8_prefill)

    # ---- weights (seed names) ----------------------------------------------------------
    def _install_pair(self, arm: str, in_proj, out_proj, **kw) -> None:
        """Check both projections' weights (and kernels) before installing either; None skips one."""
        ready = [(p, p.prepare(arm, w, **kw)) for p, w in ((self.in_proj, in_proj), (self.out_proj, out_proj))
                 if w is not None]
        for p, w in ready:
            p.install(arm, w, **kw)

    def set_bf16_weights(self, in_proj, out_proj) -> None:
        """Install dense projections; decode and prefill then use the dense arm ahead of any other."""
        self._install_pair("dense", in_proj, out_proj)

    def bf16_native_ready(self) -> bool:
        return self.in_proj.dense_ready() and self.out_proj.dense_ready()

    def set_fp8_weights(self, in_proj, out_proj, prefill: bool) -> None:
        """Install native block-scaled FP8 projections (Fp8Weight tagged FP8_BLOCK_SCALED, scale exactly
        [ceil(N/128), ceil(K/128)] f32; anything else is a WeightFormatError naming the tensor). Decode then
        uses w8a16_gemv; with prefill, prefill uses w8a16_gemm_pipelined (or w8a16_gemm) ahead of the
        NVFP4 / W4A4 arms; prefill=False is decode-only mode. A kernel that did not resolve is a
        KernelUnavailableError here, never at the first token."""
        self._install_pair("fp8_native", in_proj, out_proj, prefill=prefill)

    def set_prefill_weights(self, in_proj_t, out_proj_t) -> None:
        """Install transposed NVFP4 copies (Nvfp4WeightT, or an Nvfp4Weight to transpose): prefill then uses
        w4a16_gemm_t (w4a16_gemm_t_m128 above 128 tokens) instead of w4a16_gemm, unless an earlier arm applies."""
        self._install_pair("nvfp4_t", in_proj_t, out_proj_t)

    def set_fp8_prefill_weights(self, in_proj, out_proj) -> None:
        """Install pre-dequantized FP8 E4M3 copies (Fp8PrefillWeight) for prefill (fp8_gemm_t): after the
        native and W4A4 arms, before the transposed NVFP4 one."""
        self._install_pair("fp8_prefill", in_proj, out_proj)

    def ssm_weights(self) -> NemotronSsmWeights:
        """The mixer's weights; in_proj / out_proj are the layer's own containers (NVFP4, W4A4, BF16 or
        FP8, whichever it was built with), e.g. for the loader to build transposed or FP8 prefill copies."""
        return NemotronSsmWeights(
            in_proj=self.in_proj.base_weight(), out_proj=self.out_proj.base_weight(),
            conv1d_weight=self.conv1d_weight[...],
            conv1d_bias=None if self.conv1d_bias is None else self.conv1d_bias[...],
            dt_bias=self.dt_bias[...], A_log=self.A_log[...], D=self.D[...], norm_weight=self.norm_weight[...])

    checkpoint_weights = ssm_weights          # what every block kind answers (the model's state_dict)

    def active_arm(self, phase: str, tokens: int) -> dict[str, str]:
        return {"in_proj": self.in_proj.active_arm(phase, tokens),
                "out_proj": self.out_proj.active_arm(phase, tokens)}

    # ---- slots -------------------------------------------------------------------------
    def alloc_state(self, allocator, pool: SsmPool):
        """A zeroed slot for a new sequence: (slot, new pool)."""
        return allocator.alloc(pool)

    def release_state(self, allocator, slot: int) -> None:
        allocator.release(slot)

    # ---- shared pieces -----------------------------------------------------------------
    def _kernel(self, name: str):
        return registry.get(name, self.kernels)

    def _fp8_input(self, proj, norm: str, phase: str, tokens: int, width: int, group: int) -> dict | None:
        """Keyword arguments of the fused E4M3 norm `norm` (norm_fp8) when `proj`'s arm quantizes its activations
        and the norm can hand them over quantized: the arm's own quantization (rows / 128-column blocks) or, for
        the gated norm, what levers.gated_norm_quant says (one scale per row per norm group); None: the norm runs
        in bf16 and the arm quantizes."""
        kind = proj.input_quant(phase, tokens)
        if kind is None or not registry.resolved(norm, self.kernels):
            return None
        if norm == "gated_rmsnorm_fp8":
            # a norm group split over devices (norm_group): the bf16 norm across them, the arm quantizes
            if (self.norm_group is not None or self.gated_norm_quant == "off"
                    or (self.gated_norm_quant == "group" and group % FP8_BLOCK)):
                return None
            kind = "group" if self.gated_norm_quant == "group" else kind
        kw = dict(per_block=kind == "blocks") | (dict(per_group=True) if kind == "group" else {})
        # the reference path takes the route the kernels take at these widths, so both compute, and differentiate,
        # the same thing: a fused norm's E4M3 output passes its cotangent back through E4M3 (float8 dtype), the
        # arm's own quantization straight through in float32 (formats.straight_through)
        return kw if norm_fp8.supports(width, group, **kw) else None

    def _project_in(self, hidden, phase: str) -> tuple[jax.Array, jax.Array]:
        """RMSNorm + in_proj.  hidden [T, D] (or a PendingResidual, layers/blocks.py) -> (hidden as an array,
        zxbcdt [T, I + conv_dim + H])."""
        D, eps = self.config.hidden_size, self.config.layer_norm_epsilon
        quant = self._fp8_input(self.in_proj, "rmsnorm_fp8", phase, rows_of(hidden).shape[0], D, D)
        hidden, h = open_block(hidden, self.input_norm[...], eps=eps, kernels=self.kernels, fp8=quant)
        return hidden, self.in_proj(h, phase=phase)

    def _split_in(self, zxbcdt: jax.Array):
        I, C = self.config.d_inner, self.config.conv_dim
        return zxbcdt[:, :I], zxbcdt[:, I:I + C], zxbcdt[:, I + C:]

    def _split_xbc(self, xbc: jax.Array):
        """xbc [..., conv_dim] -> x [..., H, P], B [..., G, N], C [..., G, N]."""
        c = self.config
        I, GN, lead = c.d_inner, c.n_groups * c.ssm_state_size, xbc.shape[:-1]
        x = xbc[..., :I].reshape(*lead, c.mamba_num_heads, c.mamba_head_dim)
        B = xbc[..., I:I + GN].reshape(*lead, c.n_groups, c.ssm_state_size)
        C = xbc[..., I + GN:].reshape(*lead, c.n_groups, c.ssm_state_size)
        return x, B, C

    def _ssm_args(self, *, a_log: bool = False) -> dict:
        """The scan's / state update's per-head arguments; a_log: A_log in place of A (the state-update kernels
        compute A = -exp(A_log) themselves, so a decode step launches nothing for it)."""
        rates = (dict(A=None, A_log=self.A_log[...]) if a_log else
                 dict(A=-jnp.exp(self.A_log[...].astype(jnp.float32))))
        return rates | dict(D=self.D[...], dt_bias=self.dt_bias[...], dt_limit=tuple(self.config.time_step_limit))

    def _project_out(self, y: jax.Array, z: jax.Array, hidden: jax.Array, phase: str,
                     z_col: int | None = None, hand_on: bool = False):
        """Gated group norm + out_proj + residual.  y [T, H, P], z [T, I] (or its columns from z_col on),
        hidden [T, D] -> [T, D] (hand_on: maybe a PendingResidual, layers/blocks.py)."""
        c = self.config
        quant = self._fp8_input(self.out_proj, "gated_rmsnorm_fp8", phase, y.shape[0], c.d_inner,
                                c.gated_norm_group_size)
        kw = dict(group_size=c.gated_norm_group_size, eps=c.layer_norm_epsilon, out_dtype=hidden.dtype)
        y = y.reshape(y.shape[0], c.d_inner)
        if self.norm_group is not None:
            g = gated_rmsnorm_across_devices(y, z, self.norm_weight[...], axis=self.tp_axis, z_col=z_col,
                                             **(kw | dict(group_size=self.norm_group)))
        elif quant:
            z = z if z_col is None else z[:, z_col:z_col + c.d_inner]
            g = self._kernel("gated_rmsnorm_fp8")(y, z, self.norm_weight[...], **quant, **kw)
        else:
            g = self._kernel("gated_rmsnorm")(y, z, self.norm_weight[...], z_col=z_col, **kw)
        if self.tp_axis is not None:
            return close_block_across_devices(hidden, self.out_proj(g, phase=phase, out_dtype=jnp.float32), None,
                                              self.tp_axis, phase, hand_on)
        return close_block(hidden, self.out_proj, g, phase, hand_on)

    def _pool_rows(self, pool: SsmPool, skip_padding_slot: bool) -> dict:
        """The decode kernels' row arguments for slots of this layer on the flattened [layers * slots] pool: the
        layer's first row (row_offset, added in the kernels) and, with skip_padding_slot, the row of its padding
        slot (a lone sequence's partner, a part-filled bucket's rows in the model's steps)."""
        first = self.pool_layer * pool.num_slots
        return dict(row_offset=first, skip_row=first + pool.padding_slot if skip_padding_slot else None)

    def _conv(self):
        return self.conv1d_weight[...], None if self.conv1d_bias is None else self.conv1d_bias[...]

    def _check_hidden(self, hidden: jax.Array, name: str = "hidden") -> None:
        check_array(name, hidden, (None, self.config.hidden_size), floating=True)

    def _check_pool(self, pool: SsmPool) -> None:
        c = self.config
        if not isinstance(pool, SsmPool):
            raise ShapeError(f"pool: expected an SsmPool, got {type(pool).__name__}")
        if self.pool_layer >= pool.num_layers:
            raise ShapeError(f"pool: has {pool.num_layers} layers; this layer uses row {self.pool_layer}")
        check_array("pool.conv_state", pool.conv_state, (None, None, c.conv_dim, c.conv_kernel - 1), floating=True)
        check_array("pool.ssm_state", pool.ssm_state,
                    (None, None, c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size), floating=True)

    def _start_states(self, pool: SsmPool, slots: jax.Array, starts: jax.Array):
        """Initial conv / ssm states per sequence: the slot's state if it continues, else zeros."""
        cont = starts > 0
        conv = jnp.where(cont[:, None, None], pool.conv_state[self.pool_layer, slots], 0)
        ssm = jnp.where(cont[:, None, None, None], pool.ssm_state[self.pool_layer, slots], 0)
        return conv, ssm

    def _write(self, pool: SsmPool, slots: jax.Array, conv: jax.Array, ssm: jax.Array) -> SsmPool:
        l = self.pool_layer
        return SsmPool(pool.conv_state.at[l, slots].set(conv.astype(pool.conv_state.dtype)),
                       pool.ssm_state.at[l, slots].set(ssm.astype(pool.ssm_state.dtype)))

    # ---- the block loop (layers/stack.py) -----------------------------------------------
    def prefill_rows(self, pool: SsmPool, rows, hidden: jax.Array):
        """hidden [B, T, D] of PrefillRows, its real rows packed for the varlen prefill. Returns (hidden, pool,
        captured): with rows.cuts, the state at each row's cut (conv [B, C, K-1], ssm [B, H, P, N]), else None."""
        B, T, D = hidden.shape
        x = hidden.reshape(B * T, D)[rows.src]
        starts = 0 if rows.starts is None else rows.starts
        if rows.cuts is None:
            out, pool = self.prefill_varlen(pool, rows.slots, x, rows.cu, starts)
            captured = None
        else:
            out, pool, captured = self.prefill_varlen_split(pool, rows.slots, x, rows.cu, starts, rows.cuts,
                                                            rows.padding_slot)
        return jnp.where(rows.valid[..., None], out[rows.dst], hidden), pool, captured

    def decode_rows(self, pool: SsmPool, rows, hidden: jax.Array):
        """hidden [n*k, D] of DecodeRows -> (hidden, pool, SlotState with rows.verify else None)."""
        if rows.verify:
            return self.decode_verify_multi(pool, rows.slots, hidden, rows.k, skip_padding_slot=True, hand_on=True)
        if rows.k != 1:
            raise ShapeError(f"rows: a decode step takes one token per sequence, got k={rows.k} (verify=False)")
        hidden, pool = self.decode_multi_seq(pool, rows.slots, hidden, skip_padding_slot=True, hand_on=True)
        return hidden, pool, None

    # ---- decode ------------------------------------------------------------------------
    def decode(self, pool: SsmPool, slot, hidden: jax.Array) -> tuple[jax.Array, SsmPool]:
        """One token of one sequence.  hidden [D] or [1, D] -> same shape."""
        squeeze = hidden.ndim == 1
        h = hidden[None] if squeeze else hidden
        if h.shape[0] != 1:
            raise ShapeError(f"hidden: decode takes one token ([D] or [1, D]), got {tuple(hidden.shape)}")
        self._check_pool(pool)
        out, pool = self.decode_multi_seq(pool, check_one_slot("slot", slot, pool.num_slots), h)
        return (out[0] if squeeze else out), pool

    def decode_multi_seq(self, pool: SsmPool, slots: jax.Array, hidden: jax.Array, *,
                         skip_padding_slot: bool = False, hand_on: bool = False) -> tuple[jax.Array, SsmPool]:
        """One token for each of N sequences.  slots [N], hidden [N, D] -> ([N, D], pool).
        skip_padding_slot: the pool's padding slot holds no sequence (the model's steps pad their batches with
        it), so the conv and state kernels neither read nor write it (rows naming it give padding). In the block
        loop (hand_on) the stream may come in and go out as a PendingResidual (layers/blocks.py)."""
        rows = rows_of(hidden)
        self._check_hidden(rows)
        self._check_pool(pool)
        slots = check_slots("slots", slots, rows.shape[0], pool.num_slots)
        if rows.shape[0] == 1:
            out, pool = self.decode_multi_seq(*_pad_one(pool, slots, settled(hidden)),
                                              skip_padding_slot=skip_padding_slot)
            return out[:1], pool
        hidden, zxbcdt = self._project_in(hidden, "decode")           # [N, I + conv_dim + H], read in place
        I, dt_col = self.config.d_inner, self.config.d_inner + self.config.conv_dim
        w, b = self._conv()
        conv, ssm = _flat(pool.conv_state), _flat(pool.ssm_state)
        at = self._pool_rows(pool, skip_padding_slot)                    # slots' rows of this layer's block
        xbc, conv = self._kernel("causal_conv1d_update")(conv, slots, zxbcdt, w, b, x_col=I, **at)
        y, ssm = self._kernel("state_update_xbc")(ssm, slots, xbc, zxbcdt, dt_col=dt_col, **at,
                                                  **self._ssm_args(a_log=True))
        pool = SsmPool(conv.reshape(pool.conv_state.shape), ssm.reshape(pool.ssm_state.shape))
        return self._project_out(y, zxbcdt, hidden, "decode", z_col=0, hand_on=hand_on), pool

    def decode_verify_multi(self, pool: SsmPool, slots: jax.Array, hidden: jax.Array, k: int, *,
                            skip_padding_slot: bool = False,
                            hand_on: bool = False) -> tuple[jax.Array, SsmPool, SlotState]:
        """k consecutive tokens for each of n sequences in one sweep; rows sequence-major (r = i*k + j).
        slots [n], hidden [n*k, D] -> ([n*k, D], pool, state after every token); skip_padding_slot and hand_on as
        `decode_multi_seq`'s."""
        rows = rows_of(hidden)
        self._check_hidden(rows)
        self._check_pool(pool)
        k = positive_int("k", k)
        if rows.shape[0] % k:
            raise ShapeError(f"hidden: {rows.shape[0]} rows is not a multiple of k={k}")
        n = rows.shape[0] // k
        slots = check_slots("slots", slots, n, pool.num_slots)
        if n == 1:
            out, pool, steps = self.decode_verify_multi(*_pad_one(pool, slots, settled(hidden)), k,
                                                        skip_padding_slot=skip_padding_slot)
            return out[:k], pool, jax.tree.map(lambda a: a[:1], steps)
        hidden, zxbcdt = self._project_in(hidden, "decode")           # [n*k, I + conv_dim + H], read in place
        I, dt_col = self.config.d_inner, self.config.d_inner + self.config.conv_dim
        w, b = self._conv()
        conv, ssm = _flat(pool.conv_state), _flat(pool.ssm_state)
        packed = zxbcdt.reshape(n, k, -1)
        at = self._pool_rows(pool, skip_padding_slot)
        xbc, conv_steps, conv = self._kernel("causal_conv1d_update_multi")(conv, slots, packed, w, b, x_col=I, **at)
        y, ssm_steps, ssm = self._kernel("state_update_multi_xbc")(ssm, slots, xbc, packed, dt_col=dt_col, **at,
                                                                   **self._ssm_args(a_log=True))
        pool = SsmPool(conv.reshape(pool.conv_state.shape), ssm.reshape(pool.ssm_state.shape))
        out = self._project_out(y.reshape(n * k, *y.shape[2:]), zxbcdt, hidden, "decode", z_col=0, hand_on=hand_on)
        return out, pool, SlotState(conv=conv_steps, ssm=ssm_steps)

    def decode_batched(self, pool: SsmPool, slot, hidden: jax.Array) -> tuple[jax.Array, SsmPool, SlotState]:
        """K consecutive tokens of one sequence.  hidden [K, D] -> ([K, D], pool, per-token states)."""
        self._check_hidden(hidden)
        self._check_pool(pool)
        return self.decode_verify_multi(pool, check_one_slot("slot", slot, pool.num_slots), hidden,
                                        k=hidden.shape[0])

    # ---- split prefill -----------------------------------------------------------------
    def prefill_phase1_proj_batched(self, hidden_stacked: jax.Array) -> jax.Array:
        """Norm + in_proj over all stacked requests in one GEMM.  [T, D] -> zxbcdt [T, in_proj_dim]."""
        self._check_hidden(hidden_stacked, "hidden_stacked")
        return self._project_in(hidden_stacked, "prefill")[1]

    def prefill_phase1_conv1d(self, pool: SsmPool, slots: jax.Array, zxbcdt: jax.Array, cu_seqlens: jax.Array,
                              seq_len_starts: jax.Array) -> tuple[SsmPrefillBuffers, SsmPool]:
        """Each request's conv1d from its own conv state (or zeros when it starts at 0); advances the
        conv states.  zxbcdt [T, in_proj_dim] packed by cu_seqlens [S+1]."""
        self._check_pool(pool)
        check_array("zxbcdt", zxbcdt, (None, self.config.in_proj_dim), floating=True)
        _check_tokens("zxbcdt", zxbcdt.shape[0])
        cu_seqlens = _cu(cu_seqlens, zxbcdt.shape[0])
        S = cu_seqlens.shape[0] - 1
        slots = check_slots("slots", slots, S, pool.num_slots)
        starts = start_positions("seq_len_starts", seq_len_starts, S)
        z, xbc, dt = self._split_in(zxbcdt)
        w, b = self._conv()
        conv0, _ = self._start_states(pool, slots, starts)
        xbc, conv_final = self._kernel("causal_conv1d")(xbc, w, b, initial_states=conv0.astype(xbc.dtype),
                                                        cu_seqlens=cu_seqlens)
        l = self.pool_layer
        pool = SsmPool(pool.conv_state.at[l, slots].set(conv_final.astype(pool.conv_state.dtype)), pool.ssm_state)
        return SsmPrefillBuffers(z=z, xbc=xbc, dt=dt), pool

    def prefill_phase1(self, pool: SsmPool, slots: jax.Array, hidden: jax.Array, cu_seqlens: jax.Array,
                       seq_len_starts: jax.Array | int = 0) -> tuple[SsmPrefillBuffers, SsmPool]:
        """Phase 1: norm + in_proj (one GEMM over all requests) + each request's conv."""
        self._check_pool(pool)
        self._check_hidden(hidden)
        _check_tokens("hidden", hidden.shape[0])
        zxbcdt = self.prefill_phase1_proj_batched(hidden)
        return self.prefill_phase1_conv1d(pool, slots, zxbcdt, _cu(cu_seqlens, hidden.shape[0]), seq_len_starts)

    def prefill_ssd_scan(self, pool: SsmPool, slots: jax.Array, bufs: SsmPrefillBuffers, cu_seqlens: jax.Array,
                         seq_len_starts: jax.Array | int = 0, *, return_chunk_states: bool = False):
        """Phase 2: one varlen SSD scan over every request (seed: the GDN recurrence, here Mamba-2 SSD).
        Returns (buffers with y, pool with final states, chunk-boundary states or None)."""
        self._check_pool(pool)
        _check_bufs(bufs)
        cu_seqlens = _cu(cu_seqlens, bufs.xbc.shape[0])
        S = cu_seqlens.shape[0] - 1
        slots = check_slots("slots", slots, S, pool.num_slots)
        starts = start_positions("seq_len_starts", seq_len_starts, S)
        x, B, C = self._split_xbc(bufs.xbc)
        _, ssm0 = self._start_states(pool, slots, starts)
        out = self._kernel("ssd_scan")(x, bufs.dt, B=B, C=C, chunk_size=self.chunk_size, initial_states=ssm0,
                                       cu_seqlens=cu_seqlens, return_chunk_states=return_chunk_states,
                                       **self._ssm_args())
        l = self.pool_layer
        pool = SsmPool(pool.conv_state, pool.ssm_state.at[l, slots].set(out.final_states.astype(pool.ssm_state.dtype)))
        return dataclasses.replace(bufs, y=out.y), pool, out.chunk_states

    def prefill_ssd_scan_batched(self, pool: SsmPool, slots: jax.Array, bufs: SsmPrefillBuffers, chunk_len: int,
                                 seq_len_starts: jax.Array | int = 0):
        """Phase 2 for equal-length streams lying back to back (len(slots) streams of chunk_len tokens)."""
        chunk_len = positive_int("chunk_len", chunk_len)
        _check_bufs(bufs)
        if np.ndim(slots) != 1:
            raise ShapeError(f"slots: expected a vector [S], got shape {list(np.shape(slots))}")
        cu = jnp.arange(len(slots) + 1, dtype=jnp.int32) * chunk_len
        if bufs.xbc.shape[0] != len(slots) * chunk_len:
            raise ShapeError(f"bufs: {bufs.xbc.shape[0]} tokens, expected {len(slots)} x {chunk_len}")
        return self.prefill_ssd_scan(pool, slots, bufs, cu, seq_len_starts)

    # the seed engine's names for phase 2 (its GDN recurrence is Mamba-2's SSD scan here)
    prefill_gdn_full = prefill_ssd_scan
    prefill_gdn_full_batched = prefill_ssd_scan_batched

    def prefill_phase3(self, hidden: jax.Array, bufs: SsmPrefillBuffers) -> jax.Array:
        """Phase 3: gated norm with z, out_proj, residual.  hidden [T, D] -> [T, D]."""
        _check_bufs(bufs)
        self._check_hidden(hidden)
        if bufs.y is None:
            raise ShapeError("bufs.y: phase 2 (prefill_ssd_scan) has not run on these buffers")
        return self._project_out(bufs.y, bufs.z, hidden, "prefill")

    # ---- prefill -----------------------------------------------------------------------
    def prefill_varlen(self, pool: SsmPool, slots: jax.Array, hidden: jax.Array, cu_seqlens: jax.Array,
                       seq_len_starts: jax.Array | int = 0, *, return_chunk_states: bool = False):
        """Packed requests: slots [S], hidden [T, D] packed by cu_seqlens [S+1]; a request continues
        from its slot's state when its seq_len_start > 0.  Returns (hidden [T, D], pool[, chunk states])."""
        bufs, pool = self.prefill_phase1(pool, slots, hidden, cu_seqlens, seq_len_starts)
        bufs, pool, chunks = self.prefill_ssd_scan(pool, slots, bufs, _cu(cu_seqlens, hidden.shape[0]),
                                                   seq_len_starts, return_chunk_states=return_chunk_states)
        out = self.prefill_phase3(hidden, bufs)
        return (out, pool, chunks) if return_chunk_states else (out, pool)

    def prefill_varlen_split(self, pool: SsmPool, slots: jax.Array, hidden: jax.Array, cu_seqlens: jax.Array,
                             seq_len_starts, cuts: jax.Array, padding_slot: int):
        """`prefill_varlen` with each request split at its cut (the replay-tail capture of a batch).

        Request b continues slot slots[b] from seq_len_starts[b] and is cut after cuts[b] of its tokens
        (0 <= cut <= length): rows from the cut get the bits a prefill starting there gives. The projections
        run once over all rows; the conv and the scan run twice, heads (each from its slot's state) then tails
        (each a prefill starting at its cut from the state its head left in the slot); each half's other
        segments go to the padding slot. Returns (hidden [T, D], pool, SlotState at the cuts: conv
        [S, C, K-1], ssm [S, H, P, N])."""
        S = slots.shape[0]
        l = self.pool_layer
        starts = start_positions("seq_len_starts", seq_len_starts, S)
        pad = jnp.full((S,), padding_slot, jnp.int32)
        zero = jnp.zeros((S,), jnp.int32)
        cu = _cu(cu_seqlens, hidden.shape[0])
        cu2 = jnp.concatenate([_interleave(cu[:-1], cu[:-1] + cuts), cu[-1:]])      # segment 2b head, 2b+1 tail
        head_slots, tail_slots = _interleave(slots, pad), _interleave(pad, slots)
        head_starts, tail_starts = _interleave(starts, zero), _interleave(zero, starts + cuts)
        p = jnp.arange(hidden.shape[0], dtype=jnp.int32)
        tail = (jnp.searchsorted(cu2, p, side="right") - 1) % 2 == 1                # [T]
        zxbcdt = self.prefill_phase1_proj_batched(hidden)
        head, pool = self.prefill_phase1_conv1d(pool, head_slots, zxbcdt, cu2, head_starts)
        conv_cut = pool.conv_state[l, slots]
        tail_bufs, pool = self.prefill_phase1_conv1d(pool, tail_slots, zxbcdt, cu2, tail_starts)
        bufs = SsmPrefillBuffers(z=head.z, xbc=jnp.where(tail[:, None], tail_bufs.xbc, head.xbc), dt=head.dt)
        head_y, pool, _ = self.prefill_ssd_scan(pool, head_slots, bufs, cu2, head_starts)
        ssm_cut = pool.ssm_state[l, slots]
        tail_y, pool, _ = self.prefill_ssd_scan(pool, tail_slots, bufs, cu2, tail_starts)
        y = jnp.where(tail[:, None, None], tail_y.y, head_y.y)
        out = self.prefill_phase3(hidden, dataclasses.replace(bufs, y=y))
        return out, pool, SlotState(conv=conv_cut, ssm=ssm_cut)

    def prefill(self, pool: SsmPool, slot, hidden: jax.Array, seq_len_start=0) -> tuple[jax.Array, SsmPool]:
        """T tokens of one sequence at positions seq_len_start.. .  hidden [T, D] -> ([T, D], pool)."""
        self._check_hidden(hidden)
        self._check_pool(pool)
        slots = check_one_slot("slot", slot, pool.num_slots)
        return self.prefill_varlen(pool, slots, hidden, None, start_positions("seq_len_start", seq_len_start, 1))

    def prefill_replay_tail(self, pool: SsmPool, slot, hidden: jax.Array, cut: int,
                            seq_len_start=0) -> tuple[jax.Array, SsmPool, SlotState]:
        """Prefill split at row `cut`: rows from the cut get the bits a prefill starting there gives,
        and the state at the cut is captured (for the prefix cache)."""
        self._check_hidden(hidden)
        self._check_pool(pool)
        T = hidden.shape[0]
        cut = static_int("cut", cut, 0, T)
        slot = check_one_slot("slot", slot, pool.num_slots)
        start = start_positions("seq_len_start", seq_len_start, 1)[0]
        parts = []
        if cut > 0:
            head, pool = self.prefill(pool, slot, hidden[:cut], start)
            parts.append(head)
        slots = jnp.reshape(jnp.asarray(slot, jnp.int32), (1,))
        conv, ssm = self._start_states(pool, slots, jnp.reshape(start + cut, (1,)))
        captured = SlotState(conv=conv[0], ssm=ssm[0])
        if cut < T:
            tail, pool = self.prefill(pool, slot, hidden[cut:], start + cut)
            parts.append(tail)
        return jnp.concatenate(parts, axis=0), pool, captured


# ---- helpers -----------------------------------------------------------------------------
def _flat(pool_array: jax.Array) -> jax.Array:
    """[layers, slots, ...] -> [layers * slots, ...]: the row-indexed form the decode kernels update in place."""
    return pool_array.reshape(-1, *pool_array.shape[2:])


def _interleave(a: jax.Array, b: jax.Array) -> jax.Array:
    """[a0, b0, a1, b1, ...] of two equal-length vectors."""
    return jnp.stack([a, b], axis=1).reshape(-1)


def _pad_one(pool: SsmPool, slots: jax.Array, hidden: jax.Array):
    """A lone sequence padded with a second one in the padding slot: XLA compiles a batch of one
    with its batch axis simplified away, which can change rounding; two rows keep every row's bits
    independent of the batch it came in."""
    return (pool, jnp.concatenate([slots, jnp.full((1,), pool.padding_slot, jnp.int32)]),
            jnp.concatenate([hidden, hidden], axis=0))


def _vector(name: str, value, n: int) -> jax.Array:
    return _tensor(name, value, (n,))


def _tensor(name: str, value, shape: tuple[int, ...]) -> jax.Array:
    arr = value.weight if isinstance(value, DenseWeight) else jnp.asarray(value)
    return as_dense(name, arr, shape).weight


def _cu(cu_seqlens, T: int) -> jax.Array:
    """cu_seqlens as int32 [S+1]; known values (checks.host_integers) run from 0 to at most T without decreasing
    (rows past cu_seqlens[-1] are padding, as the kernels take them)."""
    if cu_seqlens is None:
        return jnp.array([0, T], jnp.int32)
    cu = jnp.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.shape[0] < 2 or not jnp.issubdtype(cu.dtype, jnp.integer):
        raise ShapeError(f"cu_seqlens: expected an integer vector [S+1] with S >= 1, got {cu.dtype}{list(cu.shape)}")
    host = host_integers("cu_seqlens", cu_seqlens)
    if host is not None and (host[0] != 0 or host[-1] > T or (np.diff(host) < 0).any()):
        raise ShapeError(f"cu_seqlens: expected offsets from 0, never decreasing, to at most the {T} tokens "
                         f"(rows past the last are padding), got {host.tolist()!s:.80}")
    return cu.astype(jnp.int32)



def _check_tokens(name: str, T: int) -> None:
    if T < 1:
        raise ShapeError(f"{name}: a prefill takes at least one token, got {T}")


def _check_bufs(bufs) -> None:
    if not isinstance(bufs, SsmPrefillBuffers):
        raise ShapeError(f"bufs: expected SsmPrefillBuffers (prefill_phase1's), got {type(bufs).__name__}")
