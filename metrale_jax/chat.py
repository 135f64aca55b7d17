"""Chat prompts: a list of messages rendered by the tokenizer's chat template (tokenizer_config.json's
`chat_template`), the way transformers renders it: jinja2 in an immutable sandbox with trim_blocks / lstrip_blocks
and loop controls, `raise_exception`, a `tojson` filter and `strftime_now`, given `messages`, `bos_token`,
`eos_token` and `add_generation_prompt`. jinja2 comes with the optional extra `[hub]` (and with lm-eval)."""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Sequence

from metrale_jax.arguments import shown
from metrale_jax.errors import ConfigError


def apply_chat_template(tokenizer, messages: Sequence[dict], *, add_generation_prompt: bool = True, **extra) -> str:
    """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]); add_generation_prompt: end with the
    template's cue for the assistant's turn. extra: further template variables (e.g. tools). The text holds the
    template's own special tokens: encode it with add_bos=False."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ConfigError("chat_template", "this model's tokenizer has no chat template (tokenizer_config.json "
                                           "'chat_template'); format the prompt yourself")
    _check_messages(messages)
    settings = getattr(tokenizer, "settings", None)
    compiled = _compiled(template)
    from jinja2 import TemplateError           # importable: _compiled imported jinja2

    try:
        return compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                               bos_token=getattr(settings, "bos_token", None) or "",
                               eos_token=getattr(settings, "eos_token", None) or "", **extra)
    except _TemplateRaised as e:
        raise ConfigError("messages", str(e)) from None
    except TemplateError as e:                 # e.g. the template reads a key the messages lack
        raise ConfigError("messages", f"the chat template cannot render these messages: {type(e).__name__}: "
                                      f"{str(e)[:200]}") from None


class _TemplateRaised(Exception):
    """A template's own raise_exception(message): the messages do not fit it (e.g. roles out of order)."""


def _check_messages(messages) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ConfigError("messages", "expected a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ConfigError("messages", f"messages[{i}]: expected a dict with a string 'role' and a 'content', "
                                          f"got {shown(m, 80)}")


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    """The template compiled once (a template string is the key)."""
    try:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError("chat_template", "rendering a chat template needs jinja2: pip install "
                                           "'metrale-jax[hub]'") from None

    def raise_exception(message):
        raise _TemplateRaised(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ConfigError("chat_template", f"not a valid jinja2 template ({e})") from None
