"""SamplingParams: one request's sampling and stopping settings, checked once on the host.

The engine copies the numeric ones into the request's slot (sampling.SlotSampling) at admission, so every draw of
the request (plain decode, prefill's first token, speculative acceptance) uses them; stop conditions and the
log-prob outputs are handled where the tokens are read back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from metrale_jax.arguments import integer, real, shown
from metrale_jax.errors import ConfigError

MAX_LOGPROBS = 20            # the most alternatives `logprobs=n` returns per token (vLLM's default cap)
STREAM_SEEDS = 2 ** 31       # the device keys its streams by a non-negative int32


def stream_seed(seed: int) -> int:
    """The int32 the device keys a request's stream by: a seed in [0, 2**31) as it is, any other (negative, or up
    to 2**63) mixed by splitmix64 into that range, so that seeds differing by a multiple of 2**31 (5 and 2**31 + 5,
    -1 and 2**31 - 1) get different streams rather than the same one."""
    if 0 <= seed < STREAM_SEEDS:
        return seed
    z = (seed + 0x9E3779B97F4A7C15) % 2 ** 64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2 ** 64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2 ** 64
    return (z ^ (z >> 31)) % STREAM_SEEDS


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request draws and when it stops.

    max_new_tokens: at most this many new tokens (finish_reason 'length').
    temperature: 0 is greedy (argmax); else the logits are divided by it before the filters and the draw.
    top_k: keep the k most likely tokens (0: off). min_p: keep tokens whose probability is at least min_p times the
    most likely one's (0: off). top_p: then keep the smallest most-likely set whose probability, renormalized over
    what top_k / min_p kept, reaches top_p (1: off). Tokens tied with the last kept one are kept too. This is the
    order HF transformers and vLLM apply them in; the three filters act on the temperature-scaled distribution.
    seed: the request's random stream (draw i uses (seed, i)), so its tokens do not depend on its neighbours; any
    integer in [-2**63, 2**63) (`stream_seed` says how it becomes the device's int32).
    stop: strings and / or token ids that end the request with finish_reason 'stop' (a stop id is not kept; with a
    stop string the tokens through the one completing it are kept and Generation.text ends before it).
    logprobs: None (no log-probs), 0 (each chosen token's log-probability) or n <= MAX_LOGPROBS (also the n most
    likely tokens with theirs). Log-probs are those of the model's raw distribution (log_softmax of the logits at
    temperature 1, before any filter), as vLLM returns by default, so they equal `model.score` of the same tokens.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    stop: tuple = ()
    logprobs: int | None = None

    def __post_init__(self):
        set_ = _setter(self)
        set_("max_new_tokens", integer("max_new_tokens", self.max_new_tokens, 0))
        set_("temperature", real("temperature", self.temperature, lambda v: v >= 0, "a finite number >= 0"))
        set_("top_p", real("top_p", self.top_p, lambda v: 0 < v <= 1, "a number in (0, 1]"))
        set_("top_k", integer("top_k", self.top_k, 0))
        set_("min_p", real("min_p", self.min_p, lambda v: 0 <= v <= 1, "a number in [0, 1]"))
        set_("seed", integer("seed", self.seed, -2 ** 63, 2 ** 63 - 1))         # what jax.random.key takes
        set_("stop", _stops(self.stop))
        if self.logprobs is not None:
            set_("logprobs", integer("logprobs", self.logprobs, 0, MAX_LOGPROBS, "MAX_LOGPROBS"))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _setter(obj):
    """A setter for a frozen dataclass's own __post_init__ (normalized values)."""
    return lambda name, value: object.__setattr__(obj, name, value)


def _stops(stop) -> tuple:
    """stop as a tuple of non-empty strings and non-negative token ids (one string or id alone is allowed); whether
    an id lies in the vocabulary and a string has a tokenizer is checked by the engine, which knows the model."""
    if isinstance(stop, (str, int, np.integer)):
        stop = (stop,)
    if not isinstance(stop, (Sequence, set, frozenset)) or isinstance(stop, bytes):
        raise ConfigError("stop", f"expected a list of strings and token ids, got {type(stop).__name__}")
    out = []
    for s in stop:
        if isinstance(s, str):
            if not s:
                raise ConfigError("stop", "an empty stop string would end every request at once")
            out.append(s)
        elif isinstance(s, (int, np.integer)) and not isinstance(s, (bool, np.bool_)) and s >= 0:
            out.append(int(s))
        else:
            raise ConfigError("stop", f"expected token ids >= 0 or non-empty strings, got {shown(s)}")
    return tuple(out)


def resolve(params=None, **overrides) -> SamplingParams:
    """One request's SamplingParams from what a caller passed: a SamplingParams, None (the defaults) or, as the old
    positional argument, max_new_tokens; keyword overrides (temperature=..., stop=...) replace fields on top."""
    if params is None:
        return SamplingParams(**overrides)
    if isinstance(params, SamplingParams):
        return dataclasses.replace(params, **overrides) if overrides else params
    return SamplingParams(max_new_tokens=params, **overrides)


def per_request(params, n: int, **overrides) -> list[SamplingParams]:
    """n requests' SamplingParams: a list / tuple of n of them (each request its own, seeds as given), or one for
    all (request i then draws on the stream (seed, i), so that equal prompts in one batch differ)."""
    if isinstance(params, (list, tuple)):
        if len(params) != n:
            raise ConfigError("params", f"expected one SamplingParams per prompt ({n}), got {len(params)}")
        bad = [i for i, p in enumerate(params) if not isinstance(p, SamplingParams)]
        if bad:
            raise ConfigError("params", f"params[{bad[0]}]: expected a SamplingParams, got {type(params[bad[0]]).__name__}")
        return [resolve(p, **overrides) for p in params]
    one = resolve(params, **overrides)
    return [dataclasses.replace(one, seed=(stream_seed(one.seed) * 1_000_003 + i) % STREAM_SEEDS) for i in range(n)]
