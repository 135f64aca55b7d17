"""The Engine's speculative decoding: the drafter (n-gram prompt lookup, the MTP head, or the caller's), MTP drafts
on the device, and the verify step with write-on-accept (steps.verify_sampled), read back at once: the next
step's drafts need the tokens it accepted."""

from __future__ import annotations

import functools

import numpy as np

from metrale_jax.arguments import is_int, shown
from metrale_jax.errors import ConfigError
from metrale_jax.runtime import steps
from metrale_jax.runtime.executables import pick_bucket
from metrale_jax.runtime.request import Request, logprobs_bucket, lp_arrays
from metrale_jax.runtime.speculative import SpeculativeConfig, make_drafter


def _groups(items: list, size: int):
    return [items[i:i + size] for i in range(0, len(items), size)]


def checked_drafts(drafts, limit: int, vocab_size: int) -> list[int]:
    """A drafter's propose(limit) as token ids, checked before they reach the device: at most limit of them (none
    for limit <= 0), each in [0, vocab_size); else a ConfigError naming the drafter (a draft past the limit would
    write the cache past the request's length, an id outside the vocabulary could be emitted as a token)."""
    n = max(limit, 0)
    if isinstance(drafts, (list, tuple, np.ndarray)) and len(drafts) <= n and all(
            is_int(t) and 0 <= t < vocab_size
            for t in drafts):
        return [int(t) for t in drafts]
    raise ConfigError("drafter", f"propose({limit}) must return a list of at most {n} token ids in "
                                 f"[0, {vocab_size}), got {shown(drafts)}")


class Speculation:
    """Engine methods for speculative decoding (the engine's model, caps, cache, sampling, mtp, executables)."""

    def _make_drafter(self, speculative: SpeculativeConfig | None, drafter):
        """The drafter speculative decoding uses (the config's, or the one given), or None without speculation;
        refused when a layer declines rollback."""
        if speculative is None:
            if drafter is not None:
                raise ConfigError("drafter", "a drafter needs speculative=SpeculativeConfig(...) (num_draft)")
            return None
        if not isinstance(speculative, SpeculativeConfig):
            raise ConfigError("speculative", f"expected a SpeculativeConfig, got {type(speculative).__name__}")
        if speculative.num_draft >= self.max_len:        # a verify step runs num_draft + 1 tokens per row
            raise ConfigError("speculative.num_draft", f"expected an integer in [1, {self.max_len - 1}] (below the "
                                                       f"engine's max_len), got {speculative.num_draft}")
        if self.caps.rollback_unsupported:
            raise ConfigError("speculative", "a layer declines rollback (decode_rollback_unsupported); "
                                             "speculative decoding commits an earlier state")
        return make_drafter(self.model, speculative) if drafter is None else drafter

    def _speculate(self, reqs: list[Request]) -> None:
        nd_max = self.speculative.num_draft
        limits = {r.rid: min(nd_max, r.max_new_tokens - len(r.tokens) - 1) for r in reqs}
        if self.mtp is None:
            V = self.model.config.vocab_size
            drafts = {r.rid: checked_drafts(r.drafter.propose(limits[r.rid]), limits[r.rid], V) for r in reqs}
            if not any(drafts.values()):
                return self._decode(reqs)
        elif max(limits.values()) <= 0:
            return self._decode(reqs)                  # each emits its last token: the MTP state is not needed
        k = nd_max + 1
        for group in _groups(reqs, self.verify_buckets[-1]):
            n = pick_bucket(len(group), self.verify_buckets, "verify batch")
            slots = [r.slot for r in group] + [self.pad] * (n - len(group))
            if self.mtp is not None:
                drafts = self._mtp_drafts(group, slots, limits)
            tokens = np.zeros((n, k), np.int32)
            num_draft = np.zeros(n, np.int32)
            for i, r in enumerate(group):
                d = drafts[r.rid]
                tokens[i, 0] = r.pending
                tokens[i, 1:1 + len(d)] = d
                tokens[i, 1 + len(d):] = tokens[i, len(d)]          # filler rows: never accepted
                num_draft[i] = len(d)
            sampling = any(r.temperature > 0 for r in group)
            nlp = logprobs_bucket(group)
            live = np.arange(n) < len(group)
            inputs = self._devs(np.array(slots, np.int32), tokens, num_draft, live)
            out, accepted, lp = self._verify(sampling, nlp, *inputs, slots=slots[:len(group)])
            out, accepted = np.asarray(out), np.asarray(accepted)
            lp = None if lp is None else tuple(np.asarray(a) for a in lp_arrays(lp))
            self.counters["verify_rows"] += len(group)
            self.counters["drafted_tokens"] += int(num_draft.sum())
            self.counters["accepted_tokens"] += int(accepted[:len(group)].sum())
            for i, r in enumerate(group):
                r.drawn += int(accepted[i]) + 1
                self._emit(r, out[i, :accepted[i] + 1], None if lp is None else tuple(a[i] for a in lp))

    def _verify(self, sampling: bool, logprobs: int | None, *inputs, slots=()):
        """steps.verify_sampled on self.cache and self.sampling (and self.mtp with MTP drafting, all donated);
        returns (out, accepted, TokenLogprobs or None) and keeps the new state."""
        fn = functools.partial(steps.verify_sampled, sampling_rows=sampling, logprobs=logprobs)
        mtp = () if self.mtp is None else (self.mtp,)
        donate = (1, 2) if self.mtp is None else (1, 2, 7)
        out, accepted, self.cache, self.sampling, new_mtp, lp = self.call(
            "verify", fn, self.cache, self.sampling, *inputs, *mtp, decode=True, donate_argnums=donate, slots=slots,
            static=(sampling, logprobs))
        if self.mtp is not None:
            self.mtp = new_mtp
        return out, accepted, lp

    def _mtp_drafts(self, group: list[Request], slots: list[int], limits: dict[int, int]) -> dict[int, list[int]]:
        """Each request's MTP drafts (up to its limit) from its pending token, for one verify batch."""
        nd = self.speculative.num_draft
        pending = [r.pending for r in group] + [0] * (len(slots) - len(group))
        d, self.mtp = self.call("mtp_draft", functools.partial(steps.mtp_draft_step, num_draft=nd), self.cache,
                                self.mtp, *self._devs(np.array(slots, np.int32), np.array(pending, np.int32)),
                                decode=True, donate_argnums=(2,), slots=slots[:len(group)], static=nd)
        d = np.asarray(d)
        return {r.rid: d[i, :max(limits[r.rid], 0)].tolist() for i, r in enumerate(group)}
