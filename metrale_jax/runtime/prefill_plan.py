"""One prefill chunk of the Engine, planned on the host: which waiting prompts go in and how many tokens of each
(in order, under the token budget), where a prefix snapshot is cut, and the padded arrays the compiled prefill
step takes (steps.prefill_step)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from metrale_jax.runtime.executables import pick_bucket


@dataclasses.dataclass
class Chunk:
    """rows: (request, tokens of it in this chunk); captures: (row, request, cut point); whether a row scores;
    whether the snapshots are taken in the pass (replay tail) or after it (the chunk then ends at the cut)."""

    rows: list
    captures: list
    scoring: bool
    in_pass: bool


def plan_chunk(reqs, *, budget: int, max_rows: int, max_tokens: int, cut: Callable, capture_rows: int,
               replay_tail: bool) -> Chunk:
    """The chunk for `reqs` (waiting prompts, in order): up to max_rows rows, budget tokens and max_tokens per row.
    cut(r, n) is the snapshot point in r's next n prompt tokens or None; at most capture_rows rows capture."""
    rows, captures = [], []
    for r in reqs:
        if budget <= 0 or len(rows) == max_rows:
            break
        n = min(len(r.prompt) - r.done, budget, max_tokens)
        m = cut(r, n) if len(captures) < capture_rows else None
        if m is not None:
            if not replay_tail:
                n = m - r.done                         # two-pass split: this chunk ends at the cut
            captures.append((len(rows), r, m))
        rows.append((r, n))
        budget -= n
    scoring = any(r.score for r, _ in rows)
    if scoring and replay_tail:
        captures = []                                  # one variant fewer: no in-pass capture beside scoring
    return Chunk(rows, captures, scoring, in_pass=bool(captures) and replay_tail)


def chunk_arrays(chunk: Chunk, *, batch_buckets: Sequence[int], token_buckets: Sequence[int], pad: int,
                 capture_rows: int) -> tuple[str, dict]:
    """The executable's entry name (capture and scoring variants) and the chunk's padded host arrays: slots [B],
    ids [B, T], lengths [B]; cuts [B] and capture_rows [R] with an in-pass capture; targets [B, T] when scoring."""
    B = pick_bucket(len(chunk.rows), batch_buckets, "prefill batch")
    T = pick_bucket(max(n for _, n in chunk.rows), token_buckets, "prefill chunk")
    ids, lengths = np.zeros((B, T), np.int32), np.zeros(B, np.int32)
    slots = np.full(B, pad, np.int32)
    for b, (r, n) in enumerate(chunk.rows):
        ids[b, :n] = r.prompt[r.done:r.done + n]
        lengths[b], slots[b] = n, r.slot
    arrays, entry = dict(slots=slots, ids=ids, lengths=lengths), "prefill"
    if chunk.in_pass:
        cuts, rows = lengths.copy(), np.zeros(capture_rows, np.int32)
        for c, (b, r, m) in enumerate(chunk.captures):
            cuts[b], rows[c] = m - r.done, b
        arrays.update(cuts=cuts, capture_rows=rows)
        entry = "prefill_capture"
    if chunk.scoring:
        targets = np.zeros((B, T), np.int32)
        for b, (r, n) in enumerate(chunk.rows):
            nxt = r.prompt[r.done + 1:r.done + n + 1]
            targets[b, :len(nxt)] = nxt
        arrays["targets"] = targets
        entry += "_score"
    return entry, arrays
