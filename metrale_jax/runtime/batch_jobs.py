"""Batch jobs on a serving engine: generate a list of prompts, score a batch of rows, each submitted as requests
and stepped until all have finished. Shared by Engine and DataParallelEngine (anything with submit / submit_score /
step / has_work / pop and a model)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from metrale_jax.arguments import as_array, prompts_ids, shown
from metrale_jax.errors import ShapeError
from metrale_jax.model import Generation
from metrale_jax.runtime.request import check_callback, generation
from metrale_jax.runtime.sampling_params import SamplingParams, per_request


class BatchJobs:
    """generate / generate_ids / score on top of an engine's request API (and its checks, _request and
    _score_request, which queue nothing)."""

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | int | None = None, *,
                 stream: Callable[[int, int], None] | None = None, progress: bool | None = False,
                 adapter: str | None = None, **overrides) -> list[Generation]:
        """Continue each prompt (token ids, or strings when the model has a tokenizer) through the engine.
        params: one SamplingParams for all (request i then samples with its own stream (seed, i)), a list of one
        per prompt (each with its own seed as given), or max_new_tokens as before; keyword overrides (temperature=,
        stop=, logprobs=, ...) apply to each. stream(i, token) gets tokens as they come. adapter: a loaded LoRA
        adapter for every prompt (`submit` takes one per request)."""
        seqs, as_text = prompts_ids(prompts, self.model.tokenizer)
        return self.generate_ids(seqs, per_request(params, len(seqs), **overrides), as_text=as_text, stream=stream,
                                 progress=progress, adapter=adapter)

    def generate_ids(self, seqs: list[list[int]], params: list[SamplingParams], *, as_text: bool = False,
                     stream: Callable[[int, int], None] | None = None, progress: bool | None = False,
                     adapter: str | None = None) -> list[Generation]:
        """`generate` for prompts already as token ids, one SamplingParams each; as_text: give each Generation its
        text (the model's tokenizer). Every request is checked before any is queued, so a refused one leaves the
        engine as it was; an exception `stream` raises is raised again once every request has finished."""
        check_callback("stream", stream, "stream(i, token)")
        for p, sp in zip(seqs, params):
            self._request(p, sp, adapter=adapter)
        rids = []
        for i, (p, sp) in enumerate(zip(seqs, params)):
            cb = None if stream is None else (lambda _rid, t, i=i: stream(i, t))
            rids.append(self.submit(p, sp, on_token=cb, adapter=adapter))
        self._run_until(rids, progress)
        done = [self.pop(rid) for rid in rids]
        for r in done:
            if r.error is not None:
                raise r.error
        return [generation(r, self.model.tokenizer if as_text else None) for r in done]

    def score(self, ids, lengths=None, *, progress: bool | None = False) -> np.ndarray:
        """log p(ids[b, t+1] | ids[b, :t+1]) [B, T-1] float32, zero past each row's length."""
        ids = as_array("ids", ids)
        if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 2:
            raise ShapeError(f"ids: expected [B, T] token ids with B >= 1 and T >= 2, got {list(ids.shape)}")
        B, T = ids.shape
        lengths = np.full(B, T) if lengths is None else as_array("lengths", lengths)
        if lengths.shape != (B,) or not np.issubdtype(lengths.dtype, np.integer) or lengths.min() < 1 or \
                lengths.max() > T:
            raise ShapeError(f"lengths: expected [{B}] integers in [1, {T}], got {lengths.dtype}{list(lengths.shape)} "
                             f"{shown(lengths.tolist())}")
        for b in range(B):                                # every row checked before any is queued
            self._score_request(ids[b, :lengths[b]], f"ids[{b}]")
        rids = [self.submit_score(ids[b, :lengths[b]]) for b in range(B)]
        self._run_until(rids, progress)
        out = np.zeros((B, T - 1), np.float32)
        for b, rid in enumerate(rids):
            lp = self.pop(rid).logprobs
            out[b, :len(lp)] = lp
        return out

    def _run_until(self, rids: list[int], progress) -> None:
        from tqdm.auto import tqdm

        pending = set(rids)
        with tqdm(total=len(rids), disable=not progress if progress is not None else None, unit="req",
                  desc="engine") as bar:
            while pending:
                if not self.has_work:
                    raise RuntimeError(f"requests {sorted(pending)} are neither queued nor running")
                done = pending.intersection(self.step())
                pending -= done
                bar.update(len(done))
