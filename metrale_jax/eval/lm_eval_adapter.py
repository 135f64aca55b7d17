"""MetraleLM: an lm-evaluation-harness model (`lm_eval.api.model.LM`) over a NemotronH, registered as `metrale-jax`.

    lm_eval.simple_evaluate(model="metrale-jax", model_args="pretrained=DIR,dtype=bfloat16", tasks=[...])
    lm_eval.simple_evaluate(model=MetraleLM(model=my_model), tasks=[...])
    python -m metrale_jax.eval --model metrale-jax --model_args pretrained=DIR --tasks ...   (the harness's CLI)

loglikelihood and loglikelihood_rolling run on the compiled scoring (`NemotronH.score` through scoring.py: rows
sorted by length and batched, so each batch compiles once per (batch, length) bucket; texts longer than max_length
are windowed), so a request's log-likelihood is exactly what `model.score` gives for its tokens. generate_until
runs on the Engine (continuous batching, stop strings, greedy unless the task samples). Contexts and continuations
are split into tokens as the harness's HF model splits them (tokenizer.encode_pair).
"""

from __future__ import annotations

import lm_eval.models  # noqa: F401  (the harness's own models registered first: get_model looks them up lazily)
from lm_eval.api.model import LM
from lm_eval.api.registry import model_registry
from lm_eval.models.utils import normalize_gen_kwargs

from metrale_jax.arguments import integer, shown
from metrale_jax.errors import ConfigError, ShapeError
from metrale_jax.progress import Progress
from metrale_jax.runtime.sampling_params import SamplingParams
from metrale_jax.scoring import Targets, score_targets
from metrale_jax.tokenizer import encode_pair

NAME = "metrale-jax"


class MetraleLM(LM):
    """pretrained: a checkpoint directory or hub name (default: the built-in model), or model: a NemotronH already
    loaded. dtype: 'auto' (the checkpoint's), 'float32', 'bfloat16' or 'float16'. batch_size: rows per scoring call
    and sequences decoded at once. max_length: the longest row scored or prompt + generation (default the model's
    max_position_embeddings). max_gen_toks: new tokens when a task names none. seed: generate_until's sampling
    seed when a task samples. progress: a bar (a line every few seconds when stderr is no terminal)."""

    def __init__(self, pretrained: str | None = None, dtype: str = "auto", batch_size: int | str = 8,
                 max_length: int | None = None, max_gen_toks: int = 256, seed: int = 0, progress: bool = True,
                 model=None, device: str | None = None, max_batch_size: int | None = None, **unused):
        super().__init__()
        if unused:
            raise ConfigError("model_args", f"unknown argument(s) {sorted(unused)} for {NAME}; expected pretrained, "
                                            f"dtype, batch_size, max_length, max_gen_toks, seed, progress")
        self.model = model if model is not None else _load(pretrained, dtype)
        self.tok = self.model.tokenizer
        if self.tok is None:
            raise ConfigError("tokenizer", f"{NAME} needs a model with a tokenizer (tokenizer.json or "
                                           "byte_tokenizer.json): the harness speaks text")
        if str(batch_size).startswith("auto"):
            batch_size = 8                     # no memory probing: the buckets make batches cheap to choose
        self.batch_size = _integer("batch_size", batch_size, 1)
        limit = self.model.config.max_position_embeddings
        self.max_length = limit if max_length is None else min(_integer("max_length", max_length, 2), limit)
        self.max_gen_toks = _integer("max_gen_toks", max_gen_toks, 1)
        self.seed = _integer("seed", seed, -2 ** 63)
        self.progress = bool(progress)
        self._engine = None

    # ---- scoring -------------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether every continuation token is the greedy one) per request."""
        pairs = [req.args for req in requests]
        targets = []
        for i, (context, continuation) in enumerate(pairs):
            ctx, cont = encode_pair(self.tok, context, continuation)
            if not cont:                        # nothing to score (the harness's HF model asserts as much)
                raise ShapeError(f"requests[{i}]: the continuation {shown(continuation, 40)} encodes to no tokens")
            targets.append(Targets(ctx + cont, len(ctx)))
        scored = self._score(targets, disable_tqdm)
        out = [(s.total, s.all_greedy) for s in scored]
        for pair, res in zip(pairs, out):
            self.cache_hook.add_partial("loglikelihood", pair, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """log p(text) given the BOS token, each token scored once: disjoint windows of max_length tokens (the last
        one with a full context), as the harness's HF model does."""
        prefix = self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id
        texts = [req.args[0] for req in requests]
        scored = self._score([Targets([prefix] + self.tok.encode(t, add_bos=False), 1) for t in texts],
                             disable_tqdm)
        out = [s.total for s in scored]
        for text, res in zip(texts, out):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), res)
        return out

    def _score(self, targets: list[Targets], disable_tqdm: bool):
        return score_targets(self.model, targets, max_length=self.max_length, stride=self.max_length - 1,
                             batch_size=self.batch_size, progress=self._progress(disable_tqdm))

    def _progress(self, disable_tqdm: bool) -> bool | None:
        """progress.Progress's `enabled`: None (a bar, or lines when stderr is no terminal) or False (silent)."""
        return None if self.progress and not disable_tqdm else False

    # ---- generation ----------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context continued through the engine until one of its `until` strings (the text ends before it),
        an eos token or max_gen_toks; greedy unless the request's gen_kwargs sample."""
        engine = self._get_engine()
        jobs = []
        for context, gen_kwargs in (req.args for req in requests):
            params = self._params(gen_kwargs)
            room = self.max_length - params.max_new_tokens
            if room < 1:
                raise ConfigError("max_gen_toks", f"{params.max_new_tokens} new tokens leave no room for a prompt in "
                                                  f"max_length {self.max_length}")
            ids = self.tok.encode(context)[-room:]                  # the context's end, as the harness truncates
            engine._request(ids, params)                            # every request checked before any is queued
            jobs.append((ids, params))
        rids = [engine.submit(ids, params) for ids, params in jobs]
        with Progress(len(rids), "generate_until", "requests", enabled=self._progress(disable_tqdm)) as bar:
            pending = set(rids)
            while pending:
                done = pending.intersection(engine.step())
                pending -= done
                bar.update(len(done))
        texts = []
        for rid, req in zip(rids, requests):
            r = engine.pop(rid)
            texts.append(self.tok.decode(r.tokens)[:r.text_end])
            self.cache_hook.add_partial("generate_until", req.args, texts[-1])
        return texts

    def _params(self, gen_kwargs: dict) -> SamplingParams:
        """A request's gen_kwargs (normalized as the harness's models do) as SamplingParams; `until` strings that
        decode to nothing (a special token's name in a byte vocabulary) are left to the eos ids."""
        kw = normalize_gen_kwargs(dict(gen_kwargs or {}), self.max_gen_toks)
        until = kw.get("until") or []
        sample = bool(kw.get("do_sample")) and float(kw.get("temperature", 0.0)) > 0
        return SamplingParams(max_new_tokens=int(kw["max_gen_toks"]), stop=[u for u in until if u],
                              temperature=float(kw.get("temperature", 0.0)) if sample else 0.0,
                              top_p=float(kw.get("top_p", 1.0) or 1.0), top_k=int(kw.get("top_k", 0) or 0),
                              min_p=float(kw.get("min_p", 0.0) or 0.0), seed=int(kw.get("seed", self.seed)))

    def _get_engine(self):
        if self._engine is None:
            from metrale_jax.runtime import Engine

            self._engine = Engine(self.model, max_slots=self.batch_size, max_len=self.max_length)
        return self._engine

    # ---- chat ----------------------------------------------------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        return repr(self.tok)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tok, "chat_template", None)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        from metrale_jax.chat import apply_chat_template

        return apply_chat_template(self.tok, chat_history, add_generation_prompt=add_generation_prompt)


def _integer(name: str, value, lo: int) -> int:
    """A model_args number (the harness passes them as text, "8", or as ints) as an int >= lo; else ConfigError."""
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit() and len(value) < 40:
        value = int(value)
    return integer(name, value, lo)


def _load(pretrained: str | None, dtype: str):
    """The model named by `pretrained` (a directory or hub name; None: the built-in model) in `dtype`."""
    import jax.numpy as jnp

    from metrale_jax.builtin import builtin_model_dir, checkpoint_dtype
    from metrale_jax.model import NemotronH

    path = builtin_model_dir() if pretrained is None else pretrained
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ConfigError("dtype", f"expected auto, float32, bfloat16 or float16, got {dtype!r}")
    if dtype == "auto":
        from metrale_jax.hub import resolve_checkpoint

        path = resolve_checkpoint(path)
        return NemotronH.from_pretrained(path, dtype=checkpoint_dtype(path), progress=False)
    return NemotronH.from_pretrained(path, dtype=jnp.dtype(dtype), progress=False)


if model_registry.get(NAME, None) is not MetraleLM:
    model_registry.register(NAME)(MetraleLM)
