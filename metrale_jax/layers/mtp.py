"""NemotronMTP: Nemotron-H's multi-token-prediction (MTP) head, which drafts tokens for speculative decoding.

One MTP step is a short stack of the ordinary blocks (pattern `mtp_hybrid_override_pattern`, default "*E":
attention then MoE). Its first block takes x = eh_proj([enorm(embed(tok_{t+1})), hnorm(h_t)]) (that order),
h_t being the main model's final-normed (norm_f) hidden state at position t; its last block ends with
final_layernorm. The result g_t goes through the main model's lm_head (a draft of tok_{t+2}) and is the next
step's h when drafting recurrently. Embeddings and lm_head are the main model's. num_nextn_predict_layers
steps of these blocks are named mtp.layers.{j} in the checkpoint (j = step * len(pattern) + block), as vLLM's
nemotron_h_mtp loads them. The attention blocks keep keys/values of the pair (h_t, tok_{t+1}) at position t
in their own slot-indexed pool (MtpCache), so the MTP attends over the whole sequence like the main model.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from metrale_jax.config import ModelConfig, ModelLevers
from metrale_jax.errors import ConfigError, ShapeError
from metrale_jax.layers.attention import NemotronAttentionLayer
from metrale_jax.layers.blocks import param
from metrale_jax.layers.mlp import NemotronMLPLayer
from metrale_jax.layers.moe import NemotronMoELayer
from metrale_jax.layers.projection import Projection
from metrale_jax.layers.stack import DecodeRows, PrefillRows, run_blocks
from metrale_jax.state.kv_pool import KvPool
from pallas_kernels import registry

MTP_BLOCKS = {"*": NemotronAttentionLayer, "E": NemotronMoELayer, "-": NemotronMLPLayer}


def mtp_view(config: ModelConfig) -> ModelConfig:
    """The config with the MTP blocks (steps x mtp pattern) as its layer pattern: the ordinary block classes
    build MTP block j as layer j of this view (their weights are named mtp.layers.{j} in a checkpoint)."""
    n = config.num_nextn_predict_layers
    if n < 1:
        raise ConfigError("num_nextn_predict_layers", f"the model has no MTP layers (got {n})")
    bad = sorted(set(config.mtp_hybrid_override_pattern) - set(MTP_BLOCKS))
    if bad:
        raise ConfigError("mtp_hybrid_override_pattern", f"MTP blocks {bad} are not supported; an MTP step is "
                                                         f"built of attention (*), MoE (E) and MLP (-) blocks")
    return dataclasses.replace(config, hybrid_override_pattern=config.mtp_hybrid_override_pattern * n,
                               num_nextn_predict_layers=0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MtpStepWeights:
    """The weights around one MTP step's blocks: enorm, hnorm [D] and eh_proj [D, 2D] before its first block,
    final_layernorm [D] after its last."""

    enorm: jax.Array
    hnorm: jax.Array
    eh_proj: object
    final_layernorm: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MtpCache:
    """The MTP's per-slot state: kv (its attention blocks' keys/values, KvPool [L, S, max_len, KVH, hd]) and
    hidden [S, D], the main model's final-normed hidden state at each slot's last position (the h of the next
    pair). Keys/values at a slot's positions >= seq_len - 1 are scratch: every path writes a position before
    it reads it."""

    kv: KvPool
    hidden: jax.Array

    @classmethod
    def for_config(cls, config: ModelConfig, max_slots: int, max_len: int, dtype=jnp.bfloat16) -> MtpCache:
        return cls(KvPool.for_config(mtp_view(config), max_slots, max_len, dtype),
                   jnp.zeros((max_slots + 1, config.hidden_size), dtype))


class _StepEnds(nnx.Module):
    def __init__(self, first: str, last: str, w: MtpStepWeights, D: int, kernels):
        self.enorm = param(f"{first}.enorm.weight", w.enorm, (D,))
        self.hnorm = param(f"{first}.hnorm.weight", w.hnorm, (D,))
        self.eh_proj = Projection(f"{first}.eh_proj", D, 2 * D, kernels=kernels)
        self.eh_proj.set_weight(w.eh_proj)
        self.final_layernorm = param(f"{last}.final_layernorm.weight", w.final_layernorm, (D,))


class NemotronMTP(nnx.Module):
    """The MTP blocks of a Nemotron-H checkpoint: blocks[j] = (input norm, mixer weights) of mtp.layers.{j},
    steps[s] the weights around step s. Entry points run one step over rows and return (g, new KvPool)."""

    def __init__(self, config: ModelConfig, blocks, steps, *, levers: ModelLevers | None = None):
        levers = levers or ModelLevers()
        view = mtp_view(config)
        self._config = config                     # shown once, by the model
        self.kernels = levers.kernels
        self.per_step = len(config.mtp_hybrid_override_pattern)
        if len(blocks) != view.num_hidden_layers or len(steps) != config.num_nextn_predict_layers:
            raise ShapeError(f"MTP: expected {view.num_hidden_layers} blocks and {config.num_nextn_predict_layers} "
                             f"step(s), got {len(blocks)} and {len(steps)}")
        self.layers = nnx.List([MTP_BLOCKS[kind](norm, w, view, j, levers=levers)
                                for j, (kind, (norm, w)) in enumerate(zip(view.hybrid_override_pattern, blocks))])
        P, D = self.per_step, config.hidden_size
        self.ends = nnx.List([_StepEnds(f"mtp.layers.{s * P}", f"mtp.layers.{s * P + P - 1}", w, D, self.kernels)
                              for s, w in enumerate(steps)])

    @property
    def config(self) -> ModelConfig:
        return self._config

    @property
    def num_steps(self) -> int:
        return len(self.ends)

    def step_weights(self) -> list[MtpStepWeights]:
        return [MtpStepWeights(e.enorm[...], e.hnorm[...], e.eh_proj.base_weight(), e.final_layernorm[...])
                for e in self.ends]

    def _norm(self, x: jax.Array, w) -> jax.Array:
        return registry.get("rmsnorm", self.kernels)(x, w[...], eps=self.config.layer_norm_epsilon)

    def _fuse(self, s: int, emb: jax.Array, hidden: jax.Array, phase: str) -> jax.Array:
        """Step s's first-block input: eh_proj([enorm(emb), hnorm(hidden)]).  emb, hidden [N, D] -> [N, D]."""
        e = self.ends[s]
        x = jnp.concatenate([self._norm(emb, e.enorm), self._norm(hidden.astype(emb.dtype), e.hnorm)], axis=-1)
        return e.eh_proj(x, phase=phase)

    def _blocks(self, s: int):
        return self.layers[s * self.per_step:(s + 1) * self.per_step]

    def prefill(self, kv: KvPool, slots, emb: jax.Array, hidden: jax.Array, lengths, starts, step: int = 0):
        """Right-padded rows: emb = embed(tok_{t+1}), hidden = h_t, both [B, T, D], row t of b at position
        starts[b] + t, rows t < lengths[b] real (padded rows write nothing).  Returns (g [B, T, D], kv)."""
        B, T, D = hidden.shape
        x = self._fuse(step, emb.reshape(B * T, D), hidden.reshape(B * T, D), "prefill").reshape(B, T, D)
        rows = PrefillRows.make(slots, lengths, T, starts, padding_slot=kv.padding_slot)
        x, cache, _ = run_blocks(self._blocks(step), rows, MtpCache(kv, None), x)
        return self._norm(x, self.ends[step].final_layernorm), cache.kv

    def rows(self, kv: KvPool, slots, emb: jax.Array, hidden: jax.Array, positions, k: int, step: int = 0):
        """k consecutive pairs for each of n sequences (rows sequence-major, emb / hidden [n*k, D]), sequence
        i's first at positions[i] (k = 1: one drafting step).  Returns (g [n*k, D], kv)."""
        x = self._fuse(step, emb, hidden, "decode")
        x, cache, _ = run_blocks(self._blocks(step), DecodeRows(slots, positions, k), MtpCache(kv, None), x)
        return self._norm(x, self.ends[step].final_layernorm), cache.kv
