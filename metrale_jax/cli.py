"""`metrale-jax` command line: run, score and inspect Nemotron-H checkpoints (the built-in model by default).

  metrale-jax demo                                    the built-in model continues a prompt
  metrale-jax generate --model DIR --prompt TEXT      continue a prompt with any checkpoint
  metrale-jax score --model DIR --data FILE.jsonl     per-example log-prob / perplexity (--tp / --dp: several
                                                      devices; --coordinator ...: several processes)
  metrale-jax info --model DIR                        layers, sizes and weight formats (headers only)
  metrale-jax quantize --model DIR --format F --out DIR   write an fp8-block / fp8 / nvfp4 checkpoint

Bad paths or arguments end with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

PROG = "metrale-jax"
DEMO_PROMPT = "And God said unto Moses,"


class UsageError(Exception):
    """A bad argument or path: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (no usage block) and exits 2."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


# ---- argument types ---------------------------------------------------------------------------
def _number(parse, ok, expected: str):
    """An argparse type: parse the text, then check it; a bad value names what was expected."""
    def convert(text: str):
        shown = text if len(text) <= 40 else text[:37] + "..."        # a 5000-digit number is not echoed whole
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {shown!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {shown}")
        return value
    return convert


_positive_int = _number(int, lambda v: v >= 1, "a positive integer")
_non_negative_float = _number(float, lambda v: 0 <= v < math.inf, "a finite number >= 0")
_top_p = _number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")
_unit_float = _number(float, lambda v: 0 <= v <= 1, "a number in [0, 1]")
_non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
_seed = _number(int, lambda v: 0 <= v < 2 ** 63, "an integer in [0, 2**63)")      # what jax.random.key takes


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:                          # not a number, or one of over 4300 digits: not echoed whole
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {shown!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


# ---- loading ----------------------------------------------------------------------------------
def _model_dir(arg: str | None) -> Path:
    """--model DIR checked (a folder holding config.json), a hub name ORG/NAME resolved to its snapshot folder
    (hub.resolve_checkpoint), or the built-in model's folder."""
    if arg is None:
        from metrale_jax.builtin import builtin_model_dir

        return builtin_model_dir()
    path = Path(arg)
    if not path.exists() and not arg.startswith((".", "/", "~")) and arg.count("/") == 1:
        from metrale_jax.errors import MetraleError
        from metrale_jax.hub import resolve_checkpoint

        try:
            path = resolve_checkpoint(arg)
        except MetraleError as e:
            raise UsageError(f"--model {_one_line(e)}") from None
    if not path.exists():
        raise UsageError(f"--model {arg}: no such directory")
    if not path.is_dir():
        raise UsageError(f"--model {arg}: not a directory")
    if not (path / "config.json").is_file():
        raise UsageError(f"--model {arg}: no config.json there")
    return path


def _load(args, mesh=None):
    """(model, its folder) for --model / --dtype (mesh: split over it, sharding.make_mesh)."""
    import jax.numpy as jnp

    from metrale_jax.builtin import checkpoint_dtype
    from metrale_jax.errors import MetraleError
    from metrale_jax.model import NemotronH

    path = _model_dir(args.model)
    dtype = checkpoint_dtype(path) if args.dtype == "auto" else jnp.dtype(args.dtype)
    try:
        return NemotronH.from_pretrained(path, dtype=dtype, mesh=mesh), path
    except (MetraleError, OSError) as e:
        raise UsageError(f"--model {args.model or path}: {_one_line(e)}") from None


def _describe(model, path: Path) -> str:
    import jax

    c = model.config
    params = model.num_params
    tok = type(model.tokenizer).__name__ if model.tokenizer is not None else "no tokenizer"
    return (f"{path}: pattern {c.hybrid_override_pattern!r}, hidden {c.hidden_size}, vocab {c.vocab_size}, "
            f"{params / 1e6:.2f}M params, {model.dtype.name}, {tok}; backend {jax.default_backend()}")


# ---- generation -------------------------------------------------------------------------------
@functools.cache
def _sampler():
    """The library's sampler (runtime/sampling.sample_tokens) for one row, jitted, with a finite-logits flag."""
    import jax
    import jax.numpy as jnp

    from metrale_jax.runtime.sampling import sample_tokens

    @functools.partial(jax.jit, static_argnames=("greedy",))
    def pick(logits, seed, step, temperature, top_p, top_k, min_p, *, greedy):
        """(next token [1], whether every logit is finite) from logits [1, V]: the draw `step` of the stream `seed`,
        as the engine draws a request's tokens. The flag comes with the token, so checking it costs no extra sync."""
        row = lambda x: jnp.reshape(x, (1,))
        tok = sample_tokens(logits, row(temperature), row(top_p), row(seed), row(step), sampling=not greedy,
                            top_k=row(top_k), min_p=row(min_p))
        return tok, jnp.all(jnp.isfinite(logits))

    return pick


def _bucket(n: int, minimum: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, minimum))))


def run_generation(model, prompt: list[int], max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
                   seed: int = 0, top_k: int = 0, min_p: float = 0.0, progress: bool | None = None) -> dict:
    """Prefill `prompt` into one slot, then decode up to max_new_tokens, timing each phase.

    The prefill runs twice on fresh caches (the first compiles), so its rate excludes compilation; the
    first decode step compiles and is left out of the decode rate. Token i is the i-th draw of the stream `seed`,
    as the engine draws them for a request submitted with that seed. Returns the new tokens and the times.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm.auto import tqdm

    from metrale_jax.errors import NonFiniteError
    from metrale_jax.runtime.sampling_params import stream_seed

    pick = _sampler()
    T = len(prompt)
    limit = model.config.max_position_embeddings
    if T + max_new_tokens > limit:                 # refused before the cache is allocated
        raise UsageError(f"--max-new-tokens {max_new_tokens}: a prompt of {T} tokens + {max_new_tokens} new tokens "
                         f"exceeds the model's max_position_embeddings {limit}")
    ids = np.zeros((1, _bucket(T, 8)), np.int32)
    ids[0, :T] = prompt
    max_len = min(_bucket(T + max_new_tokens, 16), limit)

    def prefill():
        cache = model.new_cache(1, max_len)
        logits, cache = model.prefill(cache, np.array([0]), ids, np.array([T]))
        return jax.block_until_ready(logits), cache

    t0 = time.perf_counter()
    prefill()
    t1 = time.perf_counter()
    logits, cache = prefill()
    t2 = time.perf_counter()

    eos = model.eos_ids()
    knobs = (jnp.float32(temperature), jnp.float32(top_p), jnp.int32(min(top_k, model.config.vocab_size)),
             jnp.float32(min_p))

    def sample(logits, step):
        tok, finite = pick(logits, jnp.int32(stream_seed(seed)), jnp.int32(step), *knobs, greedy=temperature == 0)
        if not finite:
            raise NonFiniteError(f"the logits of decode step {step} (prompt of {T} tokens) hold NaN or infinite "
                                 f"values: the weights are broken")
        return tok
    slots = np.array([0])
    tokens: list[int] = []
    step_s: list[float] = []                  # one decode step + sampling each; the first compiles
    finish = "length"
    bar = tqdm(total=max_new_tokens, desc="decoding", unit="tok", file=sys.stderr, leave=False,
               disable=None if progress is None else not progress)
    s0 = time.perf_counter()
    tok = sample(logits, 0)
    first_pick_s = time.perf_counter() - s0   # compiles the sampler
    for step in range(max_new_tokens):
        value = int(tok[0])
        if value in eos:
            finish = "eos"
            break
        tokens.append(value)
        bar.update(1)
        if step + 1 == max_new_tokens:
            break
        s0 = time.perf_counter()
        logits, cache = model.decode(cache, slots, tok)
        tok = jax.block_until_ready(sample(logits, step + 1))
        step_s.append(time.perf_counter() - s0)
    bar.close()
    steady = step_s[1:]
    mean = sum(steady) / len(steady) if steady else 0.0
    return {"tokens": tokens, "finish_reason": finish, "prompt_tokens": T,
            "prefill_s": t2 - t1, "prefill_compile_s": max(0.0, (t1 - t0) - (t2 - t1)),
            "decode_tokens": len(steady), "decode_s": sum(steady),
            "decode_compile_s": max(0.0, first_pick_s + (step_s[0] - mean if step_s else 0.0))}


def _rates(r: dict) -> list[str]:
    pre = r["prompt_tokens"] / r["prefill_s"] if r["prefill_s"] > 0 else float("inf")
    lines = [f"prefill: {r['prompt_tokens']} tokens in {1e3 * r['prefill_s']:.1f} ms = {pre:,.0f} tokens/s "
             f"(compile {r['prefill_compile_s']:.1f} s)"]
    if r["decode_tokens"]:
        dec = r["decode_tokens"] / r["decode_s"] if r["decode_s"] > 0 else float("inf")
        lines.append(f"decode:  {r['decode_tokens']} tokens in {r['decode_s']:.2f} s = {dec:,.1f} tokens/s "
                     f"(compile {r['decode_compile_s']:.1f} s; {len(r['tokens'])} new tokens, "
                     f"stopped on {r['finish_reason']})")
    else:
        lines.append(f"decode:  {len(r['tokens'])} new tokens, stopped on {r['finish_reason']} "
                     f"(too few steps to time apart from the compile)")
    return lines


def _prompt_ids(model, args) -> list[int]:
    if args.prompt_ids is not None:
        ids = args.prompt_ids
        bad = [i for i in ids if not 0 <= i < model.config.vocab_size]
        if bad:
            raise UsageError(f"--prompt-ids: ids {_shown(bad)} outside the vocabulary [0, {model.config.vocab_size})")
        return ids
    if model.tokenizer is None:
        raise UsageError(f"--model {args.model}: has no tokenizer (tokenizer.json or byte_tokenizer.json); "
                         f"give the prompt as --prompt-ids")
    try:
        args.prompt.encode("utf-8")
    except UnicodeError:                        # argv bytes that are not UTF-8 arrive as lone surrogates
        raise UsageError("--prompt: not valid UTF-8 text") from None
    ids = model.tokenizer.encode(args.prompt)
    if not ids:
        raise UsageError("--prompt: encodes to no tokens")
    return ids


def _shown(ids: list[int]) -> str:
    """The first few of `ids` for a message, each cut to 20 characters (an id may have thousands of digits)."""
    return "[" + ", ".join(t if len(t := str(i)) <= 20 else t[:17] + "..." for i in ids[:5]) + \
        (", ...]" if len(ids) > 5 else "]")


def _text(model, ids: list[int]) -> str:
    """Text of ids (the prompt and its continuation decoded together, so that a character split
    across the boundary survives), or the ids themselves when the model has no tokenizer."""
    return model.tokenizer.decode(ids) if model.tokenizer is not None else " ".join(map(str, ids))


def cmd_demo(args) -> int:
    t0 = time.perf_counter()
    model, path = _load(args)
    print(_describe(model, path if args.model else Path("built-in model")), flush=True)
    if args.model is None:
        print(_builtin_note(path), flush=True)
    prompt = _prompt_ids(model, args)
    r = run_generation(model, prompt, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                       seed=args.seed, top_k=args.top_k, min_p=args.min_p)
    print()
    print(_text(model, prompt + r["tokens"]))
    print()
    for line in _rates(r):
        print(line)
    print(f"total: {time.perf_counter() - t0:.1f} s (load, compile and run)")
    return 0


def _builtin_note(path: Path) -> str:
    """One line on how the built-in model was trained, from its train_log.json."""
    try:
        log = json.loads((path / "train_log.json").read_text())
        corpus = log["corpus"]["train.txt"]["bytes"]
        return (f"trained by tools/train_tiny.py: {log['steps_done']} steps, {log['train_seconds'] / 60:.0f} min on "
                f"the CPU, {corpus / 1e6:.1f} MB of the King James Bible; held-out "
                f"{log['saved']['heldout_bits_per_byte']:.2f} bits/byte (unigram "
                f"{log['unigram_heldout_bits_per_byte']:.2f})")
    except (OSError, KeyError, TypeError, json.JSONDecodeError):
        return "(no training log)"


def cmd_generate(args) -> int:
    model, path = _load(args)
    print(_describe(model, path), file=sys.stderr, flush=True)
    prompt = _prompt_ids(model, args)
    r = run_generation(model, prompt, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                       seed=args.seed, top_k=args.top_k, min_p=args.min_p)
    if args.json:
        print(json.dumps({"prompt": args.prompt, "prompt_ids": prompt, "tokens": r["tokens"],
                          "text": _text(model, r["tokens"]) if model.tokenizer is not None else None,
                          **{k: v for k, v in r.items() if k != "tokens"}}))
    else:
        print(_text(model, prompt + r["tokens"]))
        for line in _rates(r):
            print(line, file=sys.stderr)
    return 0


# ---- score ------------------------------------------------------------------------------------
def read_examples(path: str, tokenizer, vocab_size: int) -> list:
    """One scoring.Targets per line of a JSONL file: {"text": ...} (needs a tokenizer) or {"ids": [...]} (every
    token after the first scored), or {"context": ..., "continuation": ...}, both strings or both id lists (only
    the continuation scored, given the context; strings are split as lm-eval splits them)."""
    from metrale_jax.files import parse_json_object

    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--data {path}: no such file")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UsageError(f"--data {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    examples = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--data {path} line {n}"
        obj = parse_json_object(line, lambda why, at=where: UsageError(f"{at}: {why}"))   # deep nesting, huge ints
        examples.append(_example(obj, where, tokenizer, vocab_size))
    if not examples:
        raise UsageError(f"--data {path}: no examples")
    return examples


def _example(obj: dict, where: str, tokenizer, vocab_size: int):
    """A JSONL line's object as scoring.Targets (see read_examples); anything else is a UsageError at `where`."""
    from metrale_jax.scoring import Targets
    from metrale_jax.tokenizer import encode_pair

    if "context" in obj or "continuation" in obj:
        ctx, cont = obj.get("context"), obj.get("continuation")
        if isinstance(ctx, str) and isinstance(cont, str):
            _text_ok(tokenizer, where, ctx + cont)
            ctx, cont = encode_pair(tokenizer, ctx, cont)
        elif _is_ids(ctx) and _is_ids(cont):
            _ids_ok(ctx + cont, where, vocab_size)
        else:
            raise UsageError(f'{where}: expected {{"context": "...", "continuation": "..."}} (both strings or both '
                             f'lists of token ids)')
        if not ctx or not cont:
            raise UsageError(f"{where}: needs at least 1 context and 1 continuation token, has {len(ctx)} and "
                             f"{len(cont)}")
        return Targets(list(ctx) + list(cont), len(ctx))
    if isinstance(obj.get("text"), str):
        _text_ok(tokenizer, where, obj["text"])
        ids = tokenizer.encode(obj["text"])
    elif _is_ids(obj.get("ids")):
        ids = _ids_ok(obj["ids"], where, vocab_size)
    else:
        raise UsageError(f'{where}: expected {{"text": "..."}}, {{"ids": [int, ...]}} or {{"context": ..., '
                         f'"continuation": ...}}')
    if len(ids) < 2:
        raise UsageError(f"{where}: needs at least 2 tokens to score, has {len(ids)}")
    return Targets(ids, 1)


def _is_ids(v) -> bool:
    return isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)


def _ids_ok(ids: list[int], where: str, vocab_size: int) -> list[int]:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise UsageError(f"{where}: ids {_shown(bad)} outside the vocabulary [0, {vocab_size})")
    return ids


def _text_ok(tokenizer, where: str, text: str) -> None:
    if tokenizer is None:
        raise UsageError(f'{where}: has text, but the model has no tokenizer (give "ids", or "context" / '
                         f'"continuation" as ids)')
    try:
        text.encode("utf-8")
    except UnicodeError:                        # a JSON escape of a lone surrogate ("\ud800")
        raise UsageError(f"{where}: text is not valid Unicode (a lone surrogate)") from None


def report_scores(examples: list, scored: list, per_token: bool) -> list[dict]:
    """One result dict per example: its scored tokens' sum and mean log-prob, perplexity, whether every scored token
    was the greedy one, the windows it took, and with per_token the scored ids and their log-probs."""
    import numpy as np

    from metrale_jax.errors import NonFiniteError

    out = []
    for i, (t, s) in enumerate(zip(examples, scored)):
        if not np.isfinite(s.logprobs).all():
            raise NonFiniteError(f"example {i}: its log-probs hold NaN or infinite values (the model's logits are not "
                                 f"finite: the weights are broken)")
        n, total = len(s.logprobs), s.total
        row = {"example": i, "tokens": n, "sum_logprob": total, "mean_logprob": total / n,
               "perplexity": math.exp(-total / n), "greedy": s.all_greedy, "windows": s.windows}
        if per_token:
            row["token_ids"] = list(t.ids[t.first:])
            row["token_logprobs"] = [float(v) for v in s.logprobs]
        out.append(row)
    return out


def _join_run(args) -> bool:
    """Join a multi-process run when --coordinator / --num-processes / --process-id (or JAX_COORDINATOR_ADDRESS,
    JAX_NUM_PROCESSES, JAX_PROCESS_ID) say so (data_parallel.initialize); whether this is one."""
    from metrale_jax import data_parallel

    return data_parallel.initialize(args.coordinator, args.num_processes, args.process_id)


def _score_mesh(args, joined: bool):
    """The mesh --tp / --dp ask for (sharding.make_mesh over every process's devices): None for one device; in a
    multi-process run --dp defaults to every device / tp, so that each process's devices hold replicas."""
    import jax

    from metrale_jax import sharding

    tp = args.tp or 1
    dp = args.dp or (max(1, jax.device_count() // tp) if joined else 1)
    if tp * dp == 1 and not joined:
        return None
    return sharding.make_mesh(tp, dp=dp)


@contextlib.contextmanager
def _output(joined: bool):
    """Where results go: sys.stdout, or in a multi-process run, process 0's stdout alone, with file descriptor 1
    pointed at stderr meanwhile (the collectives library prints its own lines to stdout)."""
    if not joined:
        yield sys.stdout
        return
    import jax

    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with (open(saved, "w", closefd=False) if jax.process_index() == 0 else open(os.devnull, "w")) as out:
            yield out
            out.flush()
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def cmd_score(args) -> int:
    if not Path(args.data).is_file():
        raise UsageError(f"--data {args.data}: no such file")
    if args.per_token and not args.json:
        raise UsageError("--per-token: per-token log-probs are written in the --json output; add --json")
    joined = _join_run(args)
    with _output(joined) as out:
        return _score(args, joined, out)


def _score(args, joined: bool, out) -> int:
    """cmd_score's work: every process of a run makes the same calls (each replica scores its rows of a batch,
    model.score gathers them), and writes the results to `out`."""
    import jax

    from metrale_jax.scoring import score_targets

    model, path = _load(args, _score_mesh(args, joined))
    limit = model.config.max_position_embeddings
    max_length = limit if args.max_length is None else args.max_length
    if not 2 <= max_length <= limit:
        raise UsageError(f"--max-length {max_length}: expected an integer in [2, {limit}] (the model's "
                         f"max_position_embeddings)")
    stride = max(1, max_length // 2) if args.stride is None else args.stride
    if stride >= max_length:
        raise UsageError(f"--stride {stride}: must be below --max-length {max_length} (each window keeps "
                         f"max-length - stride tokens of context)")
    examples = read_examples(args.data, model.tokenizer, model.config.vocab_size)
    if jax.process_index() == 0:
        print(_describe(model, path), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    scored = score_targets(model, examples, max_length=max_length, stride=stride, batch_size=args.batch_size,
                           progress=None, progress_every=args.progress_every)
    rows = report_scores(examples, scored, args.per_token)
    seconds = time.perf_counter() - t0
    n = sum(r["tokens"] for r in rows)
    total = sum(r["sum_logprob"] for r in rows)
    summary = {"examples": len(rows), "tokens": n, "sum_logprob": total, "mean_logprob": total / n,
               "perplexity": math.exp(-total / n), "bits_per_token": -total / n / math.log(2),
               "greedy": sum(r["greedy"] for r in rows), "seconds": seconds}
    if args.json:
        for r in rows:
            print(json.dumps(r), file=out)
        print(json.dumps({"total": summary}), file=out)
        return 0
    print(f"{'example':>7}  {'tokens':>7}  {'mean log-prob':>13}  {'perplexity':>10}  {'greedy':>6}", file=out)
    for r in rows:
        print(f"{r['example']:>7}  {r['tokens']:>7}  {r['mean_logprob']:>13.4f}  {r['perplexity']:>10.3f}  "
              f"{'yes' if r['greedy'] else 'no':>6}", file=out)
    print(f"{'total':>7}  {n:>7}  {summary['mean_logprob']:>13.4f}  {summary['perplexity']:>10.3f}   "
          f"({summary['bits_per_token']:.3f} bits/token; {summary['greedy']} of {len(rows)} greedy; {seconds:.1f} s "
          f"with compile)", file=out)
    return 0


# ---- info -------------------------------------------------------------------------------------
def cmd_info(args) -> int:
    from metrale_jax.weights.summary import checkpoint_summary

    s = checkpoint_summary(_model_dir(args.model))
    if args.json:
        print(json.dumps(s, indent=1))
        return 0
    def mib(n: int) -> str:
        unit = max(u for u in range(4) if n >= 1024 ** u or u == 0)
        return f"{n} B" if unit == 0 else f"{n / 1024 ** unit:.2f} {('KiB', 'MiB', 'GiB')[unit - 1]}"

    print(f"model:    {s['path']}")
    print(f"layers:   {s['layers']}  pattern {s['pattern']!r}  ("
          + ", ".join(f"{n} {k}" for k, n in s["layer_kinds"].items()) + ")")
    print(f"params:   {s['params']:,}  in {s['tensors']} tensors, {mib(s['bytes'])}")
    print("bytes:    " + ", ".join(f"{d} {mib(n)}" for d, n in s["bytes_by_dtype"].items()))
    print("formats:  " + ", ".join(f"{n} {f}" for f, n in s["weight_formats"].items()))
    q = s["quantization"]
    if q["method"] == "unsupported":
        print(f"quantization: not loadable: {q['problem']}")
    elif q["method"] != "none":
        print(f"quantization: {q['method']} (from {q['source']}; excluded: {', '.join(q['exclude']) or 'none'})")
    print(f"tokenizer: {s['tokenizer'] or 'none'}")
    for k, v in s["config"].items():
        print(f"  {k}: {v}")
    return 0


# ---- quantize ---------------------------------------------------------------------------------
def cmd_quantize(args) -> int:
    from metrale_jax.weights.quantize import quantize_checkpoint

    src = _model_dir(args.model)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {args.out}: exists and is not a directory")
    if out.exists() and out.resolve() == src.resolve():
        raise UsageError(f"--out {args.out}: is the --model directory; write the quantized checkpoint elsewhere")
    t0 = time.perf_counter()
    summary = quantize_checkpoint(src, out, args.format, exclude=args.exclude or (), overwrite=args.overwrite)
    excluded = ", ".join(summary["exclude_modules"]) or "none"
    print(f"{src} -> {out}: {summary['quantized_modules']} linear modules in {args.format} "
          f"({summary['method']}), excluded: {excluded}; {len(summary['files'])} file(s), "
          f"{time.perf_counter() - t0:.1f} s")
    return 0


# ---- entry point ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    def model_args(p, what="the checkpoint folder (config.json, model*.safetensors)"):
        p.add_argument("--model", metavar="DIR", help=f"{what}; default: the built-in model")

    def run_args(p, default_prompt=None, temperature=0.0, top_p=1.0):
        model_args(p)
        p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                       help="weights dtype (auto: the checkpoint's torch_dtype)")
        prompt = p.add_mutually_exclusive_group(required=default_prompt is None)
        prompt.add_argument("--prompt", default=default_prompt, help="text to continue")
        prompt.add_argument("--prompt-ids", type=_token_ids, help="prompt as token ids: '1,2,3'")
        p.add_argument("--max-new-tokens", type=_positive_int, default=200)
        p.add_argument("--temperature", type=_non_negative_float, default=temperature,
                       help=f"0: greedy (default {temperature})")
        p.add_argument("--top-p", type=_top_p, default=top_p, help=f"nucleus sampling mass (default {top_p})")
        p.add_argument("--top-k", type=_non_negative_int, default=0, help="keep the k most likely tokens (0: off)")
        p.add_argument("--min-p", type=_unit_float, default=0.0,
                       help="keep tokens at least this times as likely as the most likely one (0: off)")
        p.add_argument("--seed", type=_seed, default=0)

    demo = sub.add_parser("demo", help="the built-in model continues a prompt; prints tokens/s")
    run_args(demo, DEMO_PROMPT, temperature=0.7, top_p=0.9)
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="continue a prompt")
    run_args(gen)
    gen.add_argument("--json", action="store_true", help="one JSON object with tokens, text and timings")
    gen.set_defaults(func=cmd_generate)

    score = sub.add_parser("score", help="per-example log-prob and perplexity of a JSONL file")
    model_args(score)
    score.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    score.add_argument("--data", required=True, metavar="FILE.jsonl",
                       help='one example a line: {"text": "..."} or {"ids": [...]} (every token after the first '
                            'scored), or {"context": ..., "continuation": ...} (only the continuation scored)')
    score.add_argument("--batch-size", type=_positive_int, default=8, help="rows (windows) per model call")
    score.add_argument("--max-length", type=_positive_int, metavar="TOKENS",
                       help="longest row; longer examples are scored by sliding windows (default: the model's "
                            "max_position_embeddings)")
    score.add_argument("--stride", type=_positive_int, metavar="TOKENS",
                       help="new tokens scored per window after the first; each keeps max-length - stride tokens of "
                            "context (default max-length / 2)")
    score.add_argument("--json", action="store_true", help="JSON lines: one per example, then the total")
    score.add_argument("--per-token", action="store_true",
                       help="with --json: each example's scored token ids and their log-probs")
    score.add_argument("--progress-every", type=_non_negative_float, default=5.0, metavar="SECONDS",
                       help="when stderr is not a terminal, a progress line this often (default 5)")
    par = score.add_argument_group("more than one device / process (README: More than one GPU / host)")
    par.add_argument("--tp", type=_positive_int, metavar="N", help="split the model over N devices (tensor parallel)")
    par.add_argument("--dp", type=_positive_int, metavar="N",
                     help="N replicas, each scoring its share of a batch (data parallel; default 1, in a multi-process "
                          "run every device / tp)")
    par.add_argument("--coordinator", metavar="HOST:PORT",
                     help="process 0's address, to join a multi-process run (default: $JAX_COORDINATOR_ADDRESS)")
    par.add_argument("--num-processes", type=_positive_int, metavar="N",
                     help="processes in the run (default: $JAX_NUM_PROCESSES)")
    par.add_argument("--process-id", type=_non_negative_int, metavar="I",
                     help="this process's index, 0 .. N-1; process 0 writes the output (default: $JAX_PROCESS_ID)")
    score.set_defaults(func=cmd_score)

    info = sub.add_parser("info", help="layers, sizes and weight formats, from the headers only")
    model_args(info)
    info.add_argument("--json", action="store_true")
    info.set_defaults(func=cmd_info)

    quant = sub.add_parser("quantize", help="write a quantized copy of a dense checkpoint (fp8-block, fp8, nvfp4)")
    model_args(quant, "the dense checkpoint folder")
    quant.add_argument("--format", required=True, choices=("fp8-block", "fp8", "nvfp4"),
                       help="fp8-block: E4M3 + f32 scale per 128x128 block; fp8: ModelOpt per-tensor FP8; "
                            "nvfp4: ModelOpt NVFP4 (E2M1 + E4M3 scale per 16 + global scale)")
    quant.add_argument("--out", required=True, metavar="DIR",
                       help="the folder for the checkpoint (written whole, then moved into place)")
    quant.add_argument("--overwrite", action="store_true",
                       help="replace a checkpoint already in --out (its other files are kept)")
    quant.add_argument("--exclude", nargs="+", action="extend", metavar="PATTERN",
                       help="modules to keep dense (fnmatch patterns over module names; lm_head always is)")
    quant.set_defaults(func=cmd_quantize)
    return parser


def _one_line(e: BaseException) -> str:
    """A multi-line message (a CheckpointError's list of problems) folded into one line."""
    parts = [part.strip() for part in str(e).splitlines() if part.strip()]
    if not parts:
        return type(e).__name__
    line = parts[0]
    for part in parts[1:]:
        line += (" " if line.endswith(":") else "; ") + part
    return line


def main(argv: list[str] | None = None) -> int:
    from metrale_jax.errors import MetraleError

    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except UsageError as e:
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
    except BrokenPipeError:                     # stdout closed early (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (MetraleError, OSError) as e:
        where = f"{e.filename}: " if isinstance(e, OSError) and e.filename and str(e.filename) not in str(e) else ""
        print(f"{PROG}: error: {where}{_one_line(e)}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
