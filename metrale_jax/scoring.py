"""Log-likelihood of token targets through the compiled scoring (`NemotronH.score`), for the CLI's `score` and the
lm-evaluation-harness model.

A sequence is scored from its first target on (1: every token after the first; a context's length for a context /
continuation pair). One longer than max_length tokens is scored by windows (`windows`): each target once, each with
at least max_length - stride tokens before it as context, so no row is longer than the model takes and memory stays
bounded. Rows from all sequences are sorted by length and batched, so a batch pads little and model.score compiles
once per (batch, length) bucket; every target comes with whether it was the model's greedy choice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from metrale_jax.arguments import integer
from metrale_jax.errors import ConfigError, ShapeError
from metrale_jax.progress import Progress


@dataclasses.dataclass(frozen=True)
class Targets:
    """Token ids and the index of the first one scored (1 <= first < len(ids))."""

    ids: list[int]
    first: int = 1


@dataclasses.dataclass(frozen=True)
class Scored:
    """A sequence's targets scored: logprobs [n - first] float32, log p(ids[t] | the tokens before it in its window)
    for t = first .. n-1; greedy [n - first] bool, whether ids[t] was the most likely token there; the number of
    windows (rows) it took."""

    logprobs: np.ndarray
    greedy: np.ndarray
    windows: int

    @property
    def total(self) -> float:
        return float(np.sum(self.logprobs, dtype=np.float64))

    @property
    def all_greedy(self) -> bool:
        return bool(self.greedy.all())


def windows(n: int, first: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(row start, row end, first target) of the rows scoring targets first .. n-1 of an n-token sequence. One row
    [0, n) when n <= max_length; else the targets in groups, the first up to index max(first + stride, max_length)
    (those see every token before them), then `stride` at a time, each group scored by the max_length tokens ending
    with its last target: a target sees at least max_length - stride tokens before it. stride = max_length - 1 gives
    disjoint windows (lm-eval's rolling log-likelihood); smaller strides give more context at more rows."""
    if not 1 <= first < n:
        raise ShapeError(f"targets: need 1 <= first < n, got first {first}, n {n}")
    if not 1 <= stride < max_length:
        raise ConfigError("stride", f"expected an integer in [1, max_length - 1 = {max_length - 1}], got {stride}")
    out = []
    a, b = first, min(n, max(first + stride, max_length))
    while True:
        out.append((max(0, b - max_length), b, a))
        if b == n:
            return out
        a, b = b, min(n, b + stride)


def score_rows(model, rows: Sequence[Sequence[int]], *, batch_size: int = 8, progress: Progress | None = None
               ) -> list[tuple[np.ndarray, np.ndarray]]:
    """(log-probs [len - 1], greedy [len - 1]) of each row's tokens 1.. given those before, rows batched by length
    (shortest first), each batch padded by model.score to its bucket."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    out: list = [None] * len(rows)
    for k in range(0, len(order), batch_size):
        batch = order[k:k + batch_size]
        lengths = np.array([len(rows[i]) for i in batch])
        ids = np.zeros((len(batch), lengths.max()), np.int32)
        for j, i in enumerate(batch):
            ids[j, :lengths[j]] = rows[i]
        lp, greedy = model.score(ids, lengths, greedy=True)
        lp, greedy = np.asarray(lp), np.asarray(greedy)
        for j, i in enumerate(batch):
            out[i] = (lp[j, :lengths[j] - 1], greedy[j, :lengths[j] - 1])
        if progress is not None:
            progress.update(len(batch))
    return out


def score_targets(model, seqs: Sequence[Targets], *, max_length: int | None = None, stride: int | None = None,
                  batch_size: int = 8, progress: bool | None = False, progress_every: float = 5.0) -> list[Scored]:
    """Each sequence's targets scored (`Scored`), windowed to max_length tokens (default and at most the model's
    max_position_embeddings) at `stride` (default max_length // 2). progress: see progress.Progress (rows)."""
    limit = model.config.max_position_embeddings
    L = limit if max_length is None else integer("max_length", max_length, 2, limit, "the model's "
                                                                                      "max_position_embeddings")
    S = max(1, L // 2) if stride is None else integer("stride", stride, 1, L - 1, "below max_length")
    integer("batch_size", batch_size, 1)
    rows, owners = [], []
    for i, t in enumerate(seqs):
        for start, end, first in windows(len(t.ids), t.first, L, S):
            rows.append(t.ids[start:end])
            owners.append((i, start, end, first))
    with Progress(len(rows), "scoring", "rows", enabled=progress, every=progress_every) as bar:
        scored = score_rows(model, rows, batch_size=batch_size, progress=bar)
    pieces: list[list] = [[] for _ in seqs]
    for (i, start, end, first), (lp, greedy) in zip(owners, scored):
        pieces[i].append((lp[first - start - 1:end - start - 1], greedy[first - start - 1:end - start - 1]))
    return [Scored(np.concatenate([p[0] for p in ps]), np.concatenate([p[1] for p in ps]), len(ps)) for ps in pieces]
