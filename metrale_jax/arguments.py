"""Host-side checks of a caller's plain arguments (counts, numbers, prompts), shared by the model's batch jobs and
the engine: a bad value is a ConfigError / ShapeError naming the argument, never a silent conversion."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from metrale_jax.errors import ConfigError, ShapeError


def integer(name: str, value, lo: int, hi: int | None = None, hi_is: str = "") -> int:
    """value as an int in [lo, hi] (hi None: no upper bound; hi_is: what hi is, for the message), else ConfigError."""
    if not is_int(value) or value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]" + (f" ({hi_is})" if hi_is else "")
        raise ConfigError(name, f"expected an integer {bound}, got {shown(value)}")
    return int(value)


def is_int(value) -> bool:
    """Whether value is an integer (a Python or numpy one) and not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


MODEL_DTYPES = ("float32", "bfloat16", "float16")


def model_dtype(value) -> np.dtype:
    """value (a dtype, its type or its name) as a model's weights dtype: float32, bfloat16 or float16 (what the
    layers compute in); anything else, "foo" or an integer or float8 type, is a ConfigError naming `dtype`."""
    import jax.numpy as jnp

    try:
        dtype = jnp.dtype(value)
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype.name not in MODEL_DTYPES:
        raise ConfigError("dtype", f"expected one of {', '.join(MODEL_DTYPES)}, got {shown(value)}")
    return dtype


def real(name: str, value, ok, want: str) -> float:
    """value as a finite float for which ok(value) holds (want: the message's words for that), else ConfigError;
    bools and strings are refused, not converted."""
    if not is_real(value) or not _finite(value) or not ok(value):
        raise ConfigError(name, f"expected {want}, got {shown(value)}")
    return float(value)


def _finite(value) -> bool:
    """Whether a real number is finite as a float (an int too large for a float, 10**400, is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def shown(value, width: int = 60) -> str:
    """value's repr for a message, cut to `width` characters; a value repr refuses (an int of over 4300 digits, a
    list nested too deeply) is shown by its type."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        text = f"a {type(value).__name__} too large to show"
    return text[:width]


def is_real(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def as_array(name: str, value) -> np.ndarray:
    """np.asarray(value), a ShapeError naming `name` for what numpy cannot make an array of (ragged nested lists)."""
    try:
        return np.asarray(value)
    except (ValueError, TypeError, OverflowError):
        raise ShapeError(f"{name}: expected a rectangular array of integers, got ragged or mixed {type(value).__name__}"
                         ) from None


def encode_text(tokenizer, i: int, text: str) -> list[int]:
    """prompts[i], a string, as token ids; a lone surrogate (not encodable text) is a ShapeError."""
    try:
        text.encode("utf-8")
    except UnicodeError:
        raise ShapeError(f"prompts[{i}]: not valid Unicode text (a lone surrogate)") from None
    return tokenizer.encode(text)


def prompt_ids(i: int, prompt) -> list[int]:
    """prompts[i] as token ids: a list / tuple / 1-D array of integers. Floats, strings and bytes are refused, not
    converted (bytes would otherwise pass as a sequence of small ints)."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise ShapeError(f"prompts[{i}]: bytes are not token ids; pass a list of ints, or a string (with a tokenizer)")
    if isinstance(prompt, (list, tuple)) and any(isinstance(t, (bool, np.bool_)) for t in prompt):
        raise ShapeError(f"prompts[{i}]: expected a list of integer token ids, got a {type(prompt).__name__} of bool")
    arr = as_array(f"prompts[{i}]", prompt) if isinstance(prompt, (list, tuple, np.ndarray)) else None
    if arr is None or arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        shown = f"{type(prompt).__name__}" + (f" of {arr.dtype}{list(arr.shape)}" if arr is not None else "")
        raise ShapeError(f"prompts[{i}]: expected a list of integer token ids, got {shown}")
    return arr.astype(np.int64).tolist()


def prompts_ids(prompts, tokenizer) -> tuple[list[list[int]], bool]:
    """(token ids of each prompt, whether they came as text). prompts: a non-empty list of strings (encoded by the
    tokenizer) or of token-id lists, not a mix; an empty prompt is a ShapeError naming it."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not len(prompts):
        raise ShapeError("prompts: expected a non-empty list of token-id lists or strings")
    as_text = isinstance(prompts[0], str)
    if any(isinstance(p, str) != as_text for p in prompts):
        raise ShapeError("prompts: mix of strings and token lists")
    if as_text and tokenizer is None:
        raise ConfigError("tokenizer", "string prompts need a tokenizer; this model has none (pass token ids)")
    seqs = [encode_text(tokenizer, i, p) if as_text else prompt_ids(i, p) for i, p in enumerate(prompts)]
    for i, s in enumerate(seqs):
        if not s:
            raise ShapeError(f"prompts[{i}]: empty")
    return seqs, as_text
