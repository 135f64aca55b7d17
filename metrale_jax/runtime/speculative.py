"""Speculative decoding: drafters and the in-graph acceptance rule.

A drafter proposes up to k-1 tokens after a sequence's context; the model verifies the pending token
plus the drafts in one multi-token step (steps.verify_step) and keeps the longest accepted run plus
one token of its own. Drafts here are deterministic (prompt lookup, or the MTP head's argmax), so the
exact speculative sampling rule reduces to: accept draft d with probability p(d); on the first rejection
draw from p with d removed; after a fully accepted run draw the bonus token from p. Greedy rows accept d
iff it is the argmax.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from metrale_jax.arguments import integer
from metrale_jax.errors import ConfigError
from metrale_jax.runtime.sampling import SALT_ACCEPT, SALT_RESIDUAL, filtered_logits, row_keys

METHODS = ("ngram", "mtp")
MAX_NGRAM = 64           # the longest n-gram looked up: the index keeps every n-gram length per token appended


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """method 'ngram' (prompt lookup) or 'mtp' (the checkpoint's multi-token-prediction layers);
    num_draft tokens proposed per step (the verify step runs num_draft + 1 rows per sequence);
    n-gram lengths tried from max_ngram down to min_ngram (1 <= min_ngram <= max_ngram <= MAX_NGRAM)."""

    method: str = "ngram"
    num_draft: int = 3
    max_ngram: int = 4
    min_ngram: int = 1

    def __post_init__(self):
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise ConfigError("speculative.method", f"expected one of {METHODS}, got {self.method!r:.60}")
        set_ = lambda name, value: object.__setattr__(self, name, value)
        set_("num_draft", integer("speculative.num_draft", self.num_draft, 1))
        set_("min_ngram", integer("speculative.min_ngram", self.min_ngram, 1, MAX_NGRAM, "MAX_NGRAM"))
        set_("max_ngram", integer("speculative.max_ngram", self.max_ngram, self.min_ngram, MAX_NGRAM,
                                  "from min_ngram to MAX_NGRAM"))


class NgramIndex:
    """One sequence's context with an index n-gram -> end of its latest earlier occurrence."""

    def __init__(self, context, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._index: dict[int, dict[tuple, int]] = {n: {} for n in range(min_n, max_n + 1)}
        for t in context:
            self.append(int(t))

    def append(self, token: int) -> None:
        """Add a token; the n-grams ending at the old end become lookup targets."""
        end = len(self.tokens)
        for n in range(self.min_n, min(self.max_n, end) + 1):
            self._index[n][tuple(self.tokens[end - n:end])] = end
        self.tokens.append(int(token))

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest matching
        suffix n-gram; [] when no suffix of length >= min_n occurred before."""
        if limit <= 0:
            return []
        L = len(self.tokens)
        for n in range(min(self.max_n, L), self.min_n - 1, -1):
            end = self._index[n].get(tuple(self.tokens[L - n:]))
            if end is not None:
                return self.tokens[end:end + limit]
        return []


class NgramDrafter:
    """Prompt-lookup drafting: continue the sequence the way its own context continued before."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def new_sequence(self, context) -> NgramIndex:
        return NgramIndex(context, self.config.min_ngram, self.config.max_ngram)


class MtpDrafter:
    """Drafting with the checkpoint's MTP head: greedy drafts computed on the device (steps.mtp_draft_step) from
    the MTP state (MtpCache) that prefill and verify keep up to date; the engine runs it per verify batch, so a
    sequence carries no host-side drafter (new_sequence gives None). One MTP step drafts every token
    recurrently, as vLLM runs Nemotron-H's MTP."""

    def __init__(self, model, config: SpeculativeConfig):
        n = model.config.num_nextn_predict_layers
        if not n:
            raise ConfigError("speculative.method", "'mtp' needs MTP layers, but this checkpoint has "
                                                    "num_nextn_predict_layers = 0; use method='ngram'")
        if getattr(model, "mtp", None) is None:
            raise ConfigError("speculative.method", f"'mtp' needs the MTP head's weights: the config has {n} MTP "
                                                    "step(s), but the checkpoint held no mtp.* tensors (or the "
                                                    "model is split over a mesh, which keeps no MTP head); use "
                                                    "method='ngram'")
        if n > 1:
            raise ConfigError("speculative.method", f"MTP drafting runs one MTP step recurrently; this checkpoint "
                                                    f"has num_nextn_predict_layers = {n}")
        self.config = config

    def new_sequence(self, context) -> None:
        return None


def make_drafter(model, config: SpeculativeConfig):
    return NgramDrafter(config) if config.method == "ngram" else MtpDrafter(model, config)


def accept_drafts(logits: jax.Array, tokens: jax.Array, num_draft: jax.Array, temperature: jax.Array,
                  top_p: jax.Array, seeds: jax.Array, counters: jax.Array, *, sampling: bool,
                  top_k: jax.Array | None = None, min_p: jax.Array | None = None):
    """Acceptance for one verify step.

    logits [n, k, V] (row j predicts the token after tokens[:, j]), tokens [n, k] (the pending token, then
    the drafts), num_draft [n] (real drafts per row, <= k-1), per-row sampling parameters (top_k / min_p: None
    is off; the target distribution is what sampling.filtered_logits keeps); counters [n] is the index of the
    first token this step emits.  Returns (out [n, k], accepted [n]): the step emits
    out[i, :accepted[i] + 1] and keeps the model state after row accepted[i].
    """
    n, k, V = logits.shape
    pred = jnp.argmax(logits, axis=-1).astype(jnp.int32)                       # [n, k]
    drafts = tokens[:, 1:]                                                     # [n, k-1]
    j = jnp.arange(k, dtype=jnp.int32)
    real = j[None, :-1] < num_draft[:, None]
    if not sampling:
        ok = (pred[:, :-1] == drafts) & real
        accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
        return pred, accepted
    per_row = lambda a: None if a is None else a[:, None]
    z = filtered_logits(logits, temperature[:, None], top_p[:, None], per_row(top_k), per_row(min_p))   # [n, k, V]
    logp = jax.nn.log_softmax(z, axis=-1)
    p_draft = jnp.exp(jnp.take_along_axis(logp[:, :-1], drafts[..., None], axis=-1)[..., 0])   # [n, k-1]
    idx = counters[:, None] + j[None, :]                                       # token index of each row
    seeds_k = jnp.broadcast_to(seeds[:, None], (n, k))
    u = jax.vmap(jax.random.uniform)(row_keys(seeds_k[:, :-1], idx[:, :-1], SALT_ACCEPT).reshape(-1))
    sampled_row = temperature[:, None] > 0
    ok = jnp.where(sampled_row, u.reshape(n, k - 1) < p_draft, pred[:, :-1] == drafts) & real
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    # the token at row j if the run stops there: the residual (draft removed) after a rejected draft,
    # the full distribution after the last real draft
    d_full = jnp.concatenate([drafts, jnp.zeros((n, 1), drafts.dtype)], axis=1)
    remove = (jnp.arange(V)[None, None, :] == d_full[..., None]) & (j[None, :] < num_draft[:, None])[..., None]
    zr = jnp.where(remove, -jnp.inf, z)
    zr = jnp.where(jnp.all(zr == -jnp.inf, axis=-1, keepdims=True), z, zr)
    drawn = jax.vmap(jax.random.categorical)(row_keys(seeds_k, idx, SALT_RESIDUAL).reshape(-1),
                                             zr.reshape(n * k, V)).reshape(n, k).astype(jnp.int32)
    cand = jnp.where(sampled_row, drawn, pred)
    out = jnp.where(j[None, :] < accepted[:, None], d_full, cand)
    return out, accepted
