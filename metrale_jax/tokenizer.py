"""Tokenizers: HF `tokenizer.json` through the `tokenizers` package, and the built-in byte tokenizer.

ByteTokenizer ids: 0 = pad, 1 = bos, 2 = eos (the Nemotron-H config defaults), byte b = b + 3, so
the vocabulary has 259 ids. A model directory names its tokenizer by file: `tokenizer.json` (HF)
or `byte_tokenizer.json` (bytes); `load_tokenizer` picks whichever is there. Either way a
`tokenizer_config.json` beside it is read (TokenizerSettings): its `add_bos_token` / `add_eos_token`, when set,
decide whether encode adds those tokens (as transformers' fast tokenizers honour them, rather than whatever the
tokenizer.json post-processor does), and its `chat_template` serves chat.apply_chat_template.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from metrale_jax.errors import ConfigError
from metrale_jax.files import config_error, read_json, read_text, replacing, write_json

BYTE_TOKENIZER_FILE = "byte_tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


@dataclasses.dataclass(frozen=True)
class TokenizerSettings:
    """What tokenizer_config.json says: add_bos_token / add_eos_token (None: not said, the tokenizer's own default),
    the chat template (a jinja2 string) and the bos / eos token strings a template may print."""

    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def read_tokenizer_settings(directory: str | os.PathLike) -> TokenizerSettings:
    """tokenizer_config.json's settings (all None without the file); a field of the wrong type is a ConfigError
    naming the file and the field. A list of named chat templates gives the one named 'default'."""
    path = Path(directory) / TOKENIZER_CONFIG_FILE
    if not os.path.lexists(path):
        return TokenizerSettings()
    raw = read_json(path, config_error)
    out = {}
    for key in ("add_bos_token", "add_eos_token"):
        v = raw.get(key)
        if v is not None and not isinstance(v, bool):
            raise ConfigError(f"{path}: {key}", f"expected true or false, got {v!r:.60}")
        out[key] = v
    for key in ("bos_token", "eos_token"):
        v = raw.get(key)
        v = v.get("content") if isinstance(v, dict) else v             # AddedToken as transformers saves it
        if v is not None and not isinstance(v, str):
            raise ConfigError(f"{path}: {key}", f"expected a string, got {v!r:.60}")
        out[key] = v
    out["chat_template"] = _chat_template(raw.get("chat_template"), path)
    return TokenizerSettings(**out)


def _chat_template(v, path: Path) -> str | None:
    if isinstance(v, list):                                               # [{"name": ..., "template": ...}, ...]
        default = [t.get("template") for t in v if isinstance(t, dict) and t.get("name") == "default"]
        v = default[-1] if default else None                              # the last one, as transformers takes it
    if v is not None and not isinstance(v, str):
        raise ConfigError(f"{path}: chat_template", f"expected a string (or a list of named templates with a "
                                                    f"'default'), got {type(v).__name__}")
    return v


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus pad / bos / eos. settings: tokenizer_config.json's (BOS added unless it says
    add_bos_token false)."""

    pad_id = 0
    bos_id = 1
    eos_id = 2
    offset = 3
    vocab_size = 256 + 3

    def __init__(self, settings: TokenizerSettings | None = None):
        self.settings = settings or TokenizerSettings()

    @property
    def chat_template(self) -> str | None:
        return self.settings.chat_template

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        """Byte ids; add_bos: the special tokens the settings ask for (BOS by default, EOS if add_eos_token)."""
        ids = [b + self.offset for b in text.encode("utf-8")]
        if add_bos and self.settings.add_bos_token is not False:
            ids = [self.bos_id, *ids]
        if add_bos and self.settings.add_eos_token:
            ids = [*ids, self.eos_id]
        return ids

    def decode(self, ids) -> str:
        """Bytes back to text; special and out-of-range ids are skipped, broken UTF-8 is replaced."""
        data = bytes(int(i) - self.offset for i in ids if self.offset <= int(i) < self.offset + 256)
        return data.decode("utf-8", errors="replace")

    def save(self, directory: str | os.PathLike) -> None:
        spec = {"type": "bytes", "pad_id": self.pad_id, "bos_id": self.bos_id, "eos_id": self.eos_id,
                "offset": self.offset, "vocab_size": self.vocab_size}
        write_json(Path(directory) / BYTE_TOKENIZER_FILE, spec)
        _save_settings(self.settings, directory)

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=259)"

    # The tokenizer is static data of a model pytree: equal tokenizers keep compiled steps shared.
    def __eq__(self, other) -> bool:
        return isinstance(other, ByteTokenizer) and self.settings == other.settings

    def __hash__(self) -> int:
        return hash((ByteTokenizer, self.settings))


def _save_settings(settings: TokenizerSettings, directory) -> None:
    """tokenizer_config.json with the settings that were read (none written when there were none)."""
    if settings.to_json():
        write_json(Path(directory) / TOKENIZER_CONFIG_FILE, settings.to_json())


class HFTokenizer:
    """A `tokenizers.Tokenizer` loaded from tokenizer.json; bos / eos / pad ids come from the model's
    config (passed in) or, failing that, from the usual special-token spellings."""

    def __init__(self, path: str | os.PathLike, *, bos_id: int | None = None, eos_id: int | None = None,
                 pad_id: int | None = None, settings: TokenizerSettings | None = None):
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
        self.settings = settings or TokenizerSettings()

    @property
    def chat_template(self) -> str | None:
        return self.settings.chat_template

    def _key(self) -> tuple:
        return (self.path.resolve(), self.bos_id, self.eos_id, self.pad_id, self.vocab_size, self.settings)

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
        """Ids with the special tokens (add_bos False: none). Where tokenizer_config.json sets add_bos_token or
        add_eos_token, those decide (BOS / EOS added around the plain encoding); else the tokenizer.json
        post-processor adds what it is set up to."""
        s = self.settings
        if s.add_bos_token is None and s.add_eos_token is None:
            return list(self._tok.encode(text, add_special_tokens=add_bos).ids)
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_bos and s.add_bos_token and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        if add_bos and s.add_eos_token and self.eos_id is not None:
            ids = [*ids, self.eos_id]
        return ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, directory: str | os.PathLike) -> None:
        with replacing(Path(directory) / "tokenizer.json") as fh:
            fh.write(self._tok.to_str(pretty=True).encode())
        _save_settings(self.settings, directory)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path}, vocab_size={self.vocab_size})"


def load_tokenizer(directory: str | os.PathLike, config=None):
    """The tokenizer a model directory ships: tokenizer.json, else byte_tokenizer.json, else None; with the
    settings of its tokenizer_config.json."""
    d = Path(directory)
    if os.path.lexists(d / "tokenizer.json"):
        first = lambda v: v[0] if isinstance(v, tuple) else v
        kw = {} if config is None else dict(bos_id=config.bos_token_id, eos_id=first(config.eos_token_id),
                                            pad_id=config.pad_token_id)
        return HFTokenizer(d / "tokenizer.json", settings=read_tokenizer_settings(d), **kw)
    if os.path.lexists(d / BYTE_TOKENIZER_FILE):
        spec = read_json(d / BYTE_TOKENIZER_FILE, config_error)
        tok = ByteTokenizer(read_tokenizer_settings(d))
        want = {"type": "bytes", "pad_id": tok.pad_id, "bos_id": tok.bos_id, "eos_id": tok.eos_id,
                "offset": tok.offset}
        bad = {k: spec.get(k) for k, v in want.items() if spec.get(k) != v}
        if bad:
            raise ConfigError(str(d / BYTE_TOKENIZER_FILE), f"unsupported byte tokenizer settings {bad}; expected "
                                                            f"{want}")
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
