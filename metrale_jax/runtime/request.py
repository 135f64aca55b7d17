"""One request of the Engine: its parameters and progress on the host, and the rules that end it (stop ids, stop
strings, the length limit) and keep its tokens' log-probs, as the Engine reads its tokens back."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from metrale_jax.arguments import as_array
from metrale_jax.errors import ConfigError, ShapeError
from metrale_jax.model import Generation
from metrale_jax.runtime.sampling import TokenLogprobs
from metrale_jax.runtime.sampling_params import MAX_LOGPROBS


@dataclasses.dataclass(eq=False)
class Request:
    """One request's parameters and progress (host side)."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0                       # 0: off
    min_p: float = 0.0                   # 0: off
    want_logprobs: int | None = None     # SamplingParams.logprobs: None, 0 (chosen tokens) or n (and the top n)
    stop_ids: frozenset = frozenset()    # the caller's stop tokens (finish_reason 'stop'; eos ids: 'eos')
    stop_strings: tuple = ()             # finish_reason 'stop' once the text holds one
    on_token: Callable[[int, int], None] | None = None
    score: bool = False
    adapter: str | None = None          # the LoRA adapter its rows use (model.adapters), None for the base
    slot: int = -1
    replica: int = 0                    # the data-parallel replica serving it (DataParallelEngine; else 0)
    done: int = 0                       # prompt tokens in the cache
    drawn: int = 0                      # tokens sampled on the device (read back or not)
    tokens: list[int] = dataclasses.field(default_factory=list)
    pending: int | None = None          # the last emitted token read back, not yet fed to the model
    finish_reason: str | None = None
    error: Exception | None = None       # what on_token raised (finish_reason 'error')
    text_end: int | None = None          # with a stop string: where it starts in the decoded text
    logprobs: list[float] = dataclasses.field(default_factory=list)    # scoring: the prompt's; else the tokens'
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)   # with want_logprobs n
    drafter: object = None
    prefix_hit: int = 0                 # prompt tokens restored from the prefix cache
    t_submit: float = 0.0
    t_first: float | None = None        # when the first token was emitted (time to first token)
    t_done: float | None = None


def check_prompt(prompt, name: str, vocab_size: int) -> list[int]:
    """A prompt of token ids as a list of ints (ShapeError naming `name`: not ids, empty, out of the vocabulary)."""
    arr = as_array(name, prompt)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise ShapeError(f"{name}: expected a non-empty list of token ids, got {arr.dtype}{list(arr.shape)}")
    if arr.min() < 0 or arr.max() >= vocab_size:
        raise ShapeError(f"{name}: token ids must lie in [0, {vocab_size}), got range [{arr.min()}, {arr.max()}]")
    return [int(t) for t in arr]


def check_callback(name: str, fn, signature: str) -> None:
    """fn is None or a callable (ConfigError naming `name` else: it would fail only when a token is read back)."""
    if fn is not None and not callable(fn):
        raise ConfigError(name, f"expected a callable {signature} or None, got {type(fn).__name__}")


def stops_for(stop: tuple, model) -> dict:
    """A request's stop ids and stop strings from SamplingParams.stop (checked there; here against the model: ids
    in the vocabulary, strings only with a tokenizer)."""
    V = model.config.vocab_size
    for s in stop:
        if isinstance(s, str) and model.tokenizer is None:
            raise ConfigError("stop", f"stop string {s!r} needs a tokenizer; this model has none (pass stop token ids)")
        if isinstance(s, int) and s >= V:
            raise ConfigError("stop", f"expected token ids in [0, {V}) or non-empty strings, got {s!r}")
    return dict(stop_ids=frozenset(s for s in stop if isinstance(s, int)),
                stop_strings=tuple(s for s in stop if isinstance(s, str)))


def stop_string_ends(r: Request, decode: Callable) -> bool:
    """Whether r's last token completed one of its stop strings; if so r.text_end marks where the first one
    starts. Only the last few tokens are decoded per check: a token holds at least one byte, a character at most
    four."""
    window = 4 * max(len(s) for s in r.stop_strings) + 4
    if not any(s in decode(r.tokens[-window:]) for s in r.stop_strings):
        return False
    text = decode(r.tokens)
    starts = [i for i in (text.find(s) for s in r.stop_strings) if i >= 0]
    if starts:
        r.text_end = min(starts)
    return bool(starts)


def logprobs_bucket(requests) -> int | None:
    """The log-prob width a sampling / verify executable computes for these requests: None when none asks (the
    plain executable), 0 when they ask for the chosen tokens' only, else MAX_LOGPROBS alternatives (each request
    keeps its own n of them): three variants at most, and top_k over the vocabulary costs about the same for 4
    as for 20."""
    asked = [r.want_logprobs for r in requests if r.want_logprobs is not None]
    if not asked:
        return None
    return MAX_LOGPROBS if max(asked) else 0


def lp_arrays(lp: TokenLogprobs) -> tuple:
    return lp.chosen, lp.top_ids, lp.top_logprobs


def keep_logprobs(r: Request, lp: tuple, j: int) -> None:
    """Token j's log-prob (and its request's top n of the step's bucket of alternatives) onto r."""
    chosen, top_ids, top_lp = lp
    r.logprobs.append(float(chosen[j]))
    if r.want_logprobs:
        n = r.want_logprobs
        r.top_logprobs.append([(int(i), float(v)) for i, v in zip(top_ids[j, :n], top_lp[j, :n])])


def generation(r: Request, tokenizer=None) -> Generation:
    """A finished request as a Generation: its text (cut before a stop string) when a tokenizer is given, its
    tokens' log-probs when it asked for them."""
    lp = r.want_logprobs is not None
    return Generation(tokens=list(r.tokens), text=tokenizer.decode(r.tokens)[:r.text_end] if tokenizer else None,
                      finish_reason=r.finish_reason, logprobs=list(r.logprobs) if lp else None,
                      top_logprobs=list(r.top_logprobs) if lp and r.want_logprobs else None)
