"""Tokenizers: HF `tokenizer.json` through the `tokenizers` package, and the built-in byte tokenizer.

ByteTokenizer ids: 0 = pad, 1 = bos, 2 = eos (the Nemotron-H config defaults), byte b = b + 3, so
the vocabulary has 259 ids. A model directory names its tokenizer by file: `tokenizer.json` (HF)
or `byte_tokenizer.json` (bytes); `load_tokenizer` picks whichever is there.
"""

from __future__ import annotations

import os
from pathlib import Path

from metrale_jax.errors import ConfigError
from metrale_jax.files import config_error, read_json, read_text, replacing, write_json

BYTE_TOKENIZER_FILE = "byte_tokenizer.json"


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus pad / bos / eos."""

    pad_id = 0
    bos_id = 1
    eos_id = 2
    offset = 3
    vocab_size = 256 + 3

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        ids = [b + self.offset for b in text.encode("utf-8")]
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids) -> str:
        """Bytes back to text; special and out-of-range ids are skipped, broken UTF-8 is replaced."""
        data = bytes(int(i) - self.offset for i in ids if self.offset <= int(i) < self.offset + 256)
        return data.decode("utf-8", errors="replace")

    def save(self, directory: str | os.PathLike) -> None:
        spec = {"type": "bytes", "pad_id": self.pad_id, "bos_id": self.bos_id, "eos_id": self.eos_id,
                "offset": self.offset, "vocab_size": self.vocab_size}
        write_json(Path(directory) / BYTE_TOKENIZER_FILE, spec)

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=259)"

    # The tokenizer is static data of a model pytree: equal tokenizers keep compiled steps shared.
    def __eq__(self, other) -> bool:
        return isinstance(other, ByteTokenizer)

    def __hash__(self) -> int:
        return hash(ByteTokenizer)


class HFTokenizer:
    """A `tokenizers.Tokenizer` loaded from tokenizer.json; bos / eos / pad ids come from the model's
    config (passed in) or, failing that, from the usual special-token spellings."""

    def __init__(self, path: str | os.PathLike, *, bos_id: int | None = None, eos_id: int | None = None,
                 pad_id: int | None = None):
        from tokenizers import Tokenizer

        self.path = Path(path)
        text = read_text(self.path, config_error)            # a regular file, read here: never a blocking open
        try:
            self._tok = Tokenizer.from_str(text)
        except Exception as e:  # the Rust side raises a bare Exception
            raise ConfigError(str(self.path), f"cannot load tokenizer ({e})") from None
        self.bos_id = bos_id if bos_id is not None else self._find("<s>", "<|begin_of_text|>", "<bos>")
        self.eos_id = eos_id if eos_id is not None else self._find("</s>", "<|end_of_text|>", "<eos>")
        self.pad_id = pad_id if pad_id is not None else self._find("<pad>", "<unk>")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def _key(self) -> tuple:
        return (self.path.resolve(), self.bos_id, self.eos_id, self.pad_id, self.vocab_size)

    def __eq__(self, other) -> bool:
        return isinstance(other, HFTokenizer) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _find(self, *names: str) -> int | None:
        for name in names:
            i = self._tok.token_to_id(name)
            if i is not None:
                return i
        return None

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        """Ids with the tokenizer's own special tokens (its post-processor adds BOS where it is set up to)."""
        return list(self._tok.encode(text, add_special_tokens=add_bos).ids)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, directory: str | os.PathLike) -> None:
        with replacing(Path(directory) / "tokenizer.json") as fh:
            fh.write(self._tok.to_str(pretty=True).encode())

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path}, vocab_size={self.vocab_size})"


def load_tokenizer(directory: str | os.PathLike, config=None):
    """The tokenizer a model directory ships: tokenizer.json, else byte_tokenizer.json, else None."""
    d = Path(directory)
    if os.path.lexists(d / "tokenizer.json"):
        first = lambda v: v[0] if isinstance(v, tuple) else v
        kw = {} if config is None else dict(bos_id=config.bos_token_id, eos_id=first(config.eos_token_id),
                                            pad_id=config.pad_token_id)
        return HFTokenizer(d / "tokenizer.json", **kw)
    if os.path.lexists(d / BYTE_TOKENIZER_FILE):
        spec = read_json(d / BYTE_TOKENIZER_FILE, config_error)
        tok = ByteTokenizer()
        want = {"type": "bytes", "pad_id": tok.pad_id, "bos_id": tok.bos_id, "eos_id": tok.eos_id,
                "offset": tok.offset}
        bad = {k: spec.get(k) for k, v in want.items() if spec.get(k) != v}
        if bad:
            raise ConfigError(BYTE_TOKENIZER_FILE, f"unsupported byte tokenizer settings {bad}; expected {want}")
        return tok
    return None


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of a context and of its continuation as the model reads them together, split as lm-eval's HF model
    splits them: trailing whitespace of the context moves to the continuation, the pair is encoded whole and the
    continuation is what follows the context's own encoding (so a token spanning the boundary counts as the
    continuation's). An empty context is the BOS token (the EOS token without one) alone."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    if not context:
        prefix = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
        return [prefix], tokenizer.encode(continuation, add_bos=False)
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    return ctx, whole[len(ctx):]
