"""End-to-end decode: what a user of Engine.generate gets, against the device step and the bytes floor.

One row per (weights bf16 / fp8-block / nvfp4, Mamba state float32 / bfloat16, batch 1 / 8 / 32 / 64 / 256), on
Nemotron-H-8B shapes with random weights (64-token prompts, 64 new tokens, greedy):
- engine_tok_s: Engine.step() while every sequence decodes (host bookkeeping, sampling, read-back included),
  from the first decode step, the prompts' prefill finished on the device (its time is prefill's, not decode's);
  engine_steady_tok_s: the same from the fourth decode step on (the pipeline filled);
- device_tok_s: the engine's own decode and sample executables chained on the device (tokens never leave it);
- floor_tok_s: batch / (bytes a step must read and write / the copy bandwidth measured in this run). Bytes:
  every weight a decode step reads (prefill-only copies left out; of the embedding table one row per sequence),
  each sequence's Mamba state read and written, its keys/values read (the positions it holds) and written;
- kernels_per_step: GPU kernels per chained step, from a profiler trace (GPU only); kernel_us_per_step their time,
  gap_us_per_step the untraced step's wall time less it (launch gaps), by_class_us / top_kernels the split;
- chained_tokens_sha256: a digest of the tokens the first chained steps sampled: two runs of the same weights
  (levers that must keep the bits, e.g. XLA flags) agree on it.

    PYTHONPATH=. python benchmarks/bench_e2e_decode.py [--weights bf16,fp8-block,nvfp4] [--states float32,bfloat16]
        [--batches 1,8,32,64,256] [--out benchmarks/results/e2e_decode.json] [--update]
        [--fp8-decode-activations e4m3]   (the FP8 decode on the FP8 matrix units: e2e_decode_fp8-decode-e4m3.json)
        [--gpu-default w8a8_gemv=mosaic]  (a kernel's other GPU arm; recorded under `levers`)
        [--disable add_rmsnorm]           (a kernel made unresolvable, its callers' fallback timed; `levers`)
    CPU dry run: JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/bench_e2e_decode.py --tiny --out /tmp/e2e.json
The JSON holds the rows of this run (`rows`), and the date, device and copy bandwidth; a weight format that
failed is named in `errors` (its message) and the run exits non-zero after writing the others. With --update, the
rows of --out that this run did not measure are kept (a full table takes longer than one device call allows): each
row carries the date and copy bandwidth of its own run; a table from another device or model is replaced, not
joined.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import hashlib
import json
import os
import platform
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_runtime import (CONFIG_8B, TINY, block, copy_bandwidth, decode_profile, decode_weight_bytes,
                                      median_time, random_model)
from metrale_jax.config import ModelConfig
from metrale_jax.runtime import Engine, Executables, steps
from metrale_jax.runtime.sampling import sample_slots
from pallas_kernels import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def step_bytes(model, cache, batch: int, seq_len: int) -> int:
    """Bytes one decode step of `batch` sequences holding seq_len tokens must move: the weights it reads (one
    embedding row per sequence), each sequence's Mamba state read + written, keys/values read + one row written."""
    emb = model.embeddings[...]
    weights = decode_weight_bytes(model) - emb.nbytes + batch * emb.shape[1] * emb.dtype.itemsize
    ssm = cache.ssm
    state = 2 * (ssm.conv_state[:, 0].nbytes + ssm.ssm_state[:, 0].nbytes) if ssm.num_layers else 0
    kv_row = 2 * cache.kv.k[:, 0, 0].nbytes if cache.kv.num_layers else 0
    return weights + batch * (state + kv_row * (seq_len + 1))


def engine_rates(eng: Engine, batch: int, prompt: int, new: int, rng) -> tuple[float, float]:
    """Decode tokens/s through Engine.step(): from the step after every prompt is in, once its prefill has finished
    on the device, to the end; and in steady state (tokens read back from the fourth decode step on, the drain at
    the end included)."""
    V = eng.model.config.vocab_size
    for _ in range(batch):
        eng.submit(rng.integers(0, V, prompt).tolist(), new)
    while eng.queue or any(r.done < len(r.prompt) for r in eng.running.values()):
        eng.step()
    jax.block_until_ready(eng.cache)                     # the last prefill chunk done: decode time starts here
    t, n0 = time.perf_counter(), eng.counters["decode_rows"]
    for _ in range(3):
        eng.step()
    ts, g0 = time.perf_counter(), eng.counters["generated_tokens"]
    while eng.has_work:
        eng.step()
    end = time.perf_counter()
    return (eng.counters["decode_rows"] - n0) / (end - t), (eng.counters["generated_tokens"] - g0) / (end - ts)


def chained_steps(eng: Engine, batch: int, chain: int):
    """A function that runs `chain` decode + sample steps of the engine's executables over slots 0..batch-1,
    each step's tokens feeding the next on the device."""
    slots = jax.device_put(np.arange(batch, dtype=np.int32))
    draw = jax.device_put(np.ones(batch, bool))
    greedy = functools.partial(sample_slots, sampling=False)

    def run():
        for _ in range(chain):
            logits, eng.cache = eng.call("decode", steps.decode_pending_step, eng.cache, eng.sampling.pending, slots,
                                         decode=True, donate_argnums=(1,))
            tokens, eng.sampling = eng.exe.run("sample", greedy, logits, eng.sampling, slots, draw,
                                               donate_argnums=(1,), static=False)
        return tokens

    return run


def bench_rows(model, weights: str, state: str, batches, sz, bw, exe, rows: list, save) -> None:
    prompt, new, chain = sz["prompt"], sz["new"], sz["chain"]
    bmax = max(batches)
    pre = min(32, bmax)                                  # prefill rows per step: one prefill executable
    eng = Engine(model, max_slots=bmax, max_len=prompt + new + 2 * chain + 2, batch_buckets=batches,
                 prefill_batch_buckets=(pre,), token_buckets=(prompt,), prefill_token_budget=prompt * pre,
                 executables=exe, eos_ids=[], ssm_state_dtype=state)
    log(f"{weights} / {state}: warm-up compiles {eng.warmup()}")
    rng = np.random.default_rng(0)
    for B in batches:
        engine_tok_s, steady_tok_s = engine_rates(eng, B, prompt, new, rng)
        run = chained_steps(eng, B, chain)
        tokens = np.asarray(run())                       # the slots' lengths now run past the prompts
        digest = hashlib.sha256(tokens.tobytes()).hexdigest()[:16]    # same model, flags that keep the bits: same
        dev_s = median_time(run, reps=3) / chain
        floor_s = step_bytes(model, eng.cache, B, prompt + new + chain) / bw
        prof = decode_profile(chained_steps(eng, B, 2), 2, dev_s) if sz["profile"] else {"error": "off"}
        row = {"weights": weights, "state_dtype": state, "batch": B, "device_tok_s": B / dev_s,
               "engine_tok_s": engine_tok_s, "engine_steady_tok_s": steady_tok_s, "floor_tok_s": B / floor_s,
               "kernels_per_step": prof.get("kernels_per_step"), "chained_tokens_sha256": digest,
               "engine_vs_device": engine_tok_s * dev_s / B, "device_vs_floor": floor_s / dev_s,
               "step_bytes": int(floor_s * bw), "kernel_us_per_step": prof.get("kernel_us_per_step"),
               "gap_us_per_step": step_gap_us(dev_s, prof), "traced_idle_us_per_step": prof.get("idle_us_per_step"),
               "by_class_us": {k: round(v["us_per_step"], 1) for k, v in prof.get("by_class", {}).items()},
               "top_kernels": {k: {"us": round(v["us_per_step"], 1), "n": round(v["count_per_step"], 1)}
                               for k, v in prof.get("top_kernels", {}).items()}}
        rows.append(row)
        save()                                           # a run cut short keeps the rows it finished
        log(f"{weights} / {state} B={B}: engine {engine_tok_s:,.0f} tok/s ({row['engine_vs_device']:.0%} of the "
            f"device step; steady {steady_tok_s * dev_s / B:.0%}), device {B / dev_s:,.0f} ({row['device_vs_floor']:.0%} of the floor "
            f"{B / floor_s:,.0f}), {row['kernels_per_step']} kernels")


def step_gap_us(dev_s: float, prof: dict) -> float | None:
    """The part of an untraced chained step no kernel runs in: its wall time less the kernels' time in the trace.
    (The trace's own idle span is not it: tracing stretches the gaps between short kernels, runtime.md.)"""
    busy = prof.get("kernel_us_per_step")
    return None if busy is None else round(dev_s * 1e6 - busy, 1)


ROW_ORDER = {"weights": ("bf16", "fp8-block", "nvfp4"), "state_dtype": ("float32", "bfloat16")}


def row_key(row: dict) -> tuple:
    return row["weights"], row["state_dtype"], row["batch"]


DEFAULT_LEVERS = {"fp8_decode_activations": "bf16"}


def read_previous(path: str, device: str, config: str, levers: dict | None = None) -> dict | None:
    """The table at path to update, or None (no file, or another device's, model's or levers' table: this run
    starts anew)."""
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        previous = json.load(fh)
    if previous.get("levers", DEFAULT_LEVERS) != (levers or DEFAULT_LEVERS):
        log(f"--update: {path} holds rows of levers {previous.get('levers', DEFAULT_LEVERS)}; this run writes a new "
            "table")
        return None
    if (previous.get("device"), previous.get("config")) != (device, config):
        log(f"--update: {path} holds {previous.get('device')} / {previous.get('config')} rows; this {device} / "
            f"{config} run writes a new table")
        return None
    return previous


def merge_runs(previous: dict, run: dict) -> dict:
    """`run`'s document with the rows of `previous` it did not measure kept; every row stamped with the date and
    copy bandwidth of the run that measured it; rows ordered by weights, state dtype and batch."""
    if previous.get("device") != run["device"] or previous.get("config") != run["config"]:
        raise SystemExit(f"--update: {previous.get('device')} / {previous.get('config')} rows cannot join a "
                         f"{run['device']} / {run['config']} run")
    stamp = lambda doc: [{"date": doc["date"], "copy_bytes_per_s": doc["copy_bytes_per_s"], **r} for r in doc["rows"]]
    fresh = stamp(run)
    measured = {row_key(r) for r in fresh}
    rows = [r for r in stamp(previous) if row_key(r) not in measured] + fresh
    order = lambda r: (ROW_ORDER["weights"].index(r["weights"]) if r["weights"] in ROW_ORDER["weights"] else 9,
                       ROW_ORDER["state_dtype"].index(r["state_dtype"]), r["batch"])
    remeasured = {r["weights"] for r in fresh} | set(run["errors"])
    errors = {w: e for w, e in previous.get("errors", {}).items() if w not in remeasured} | run["errors"]
    return {**run, "rows": sorted(rows, key=order), "errors": errors}


SIZES = {"full": dict(prompt=64, new=64, chain=16, profile=True),
         "tiny": dict(prompt=16, new=8, chain=4, profile=False)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="default benchmarks/results/e2e_decode[_<variant>].json")
    ap.add_argument("--tiny", action="store_true", help="tiny config and sizes (a CPU dry run)")
    ap.add_argument("--weights", default="bf16,fp8-block,nvfp4")
    ap.add_argument("--states", default="float32,bfloat16")
    ap.add_argument("--batches", default=None, help="default 1,8,32,64,256 (tiny: 1,4,8)")
    ap.add_argument("--update", action="store_true", help="keep the rows of --out that this run does not measure")
    ap.add_argument("--fp8-decode-activations", default="bf16", choices=("bf16", "e4m3"),
                    help="ModelLevers.fp8_decode_activations of the FP8 models (e4m3: w8a8_gemv; the default --out "
                         "becomes e2e_decode_fp8-decode-e4m3.json)")
    ap.add_argument("--gpu-default", action="append", default=[], metavar="KERNEL=ARM",
                    help="time a kernel's other GPU arm (registry.gpu_default), e.g. w8a8_gemv=mosaic; repeatable")
    ap.add_argument("--disable", action="append", default=[], metavar="KERNEL",
                    help="make a kernel unresolvable (registry.disabled), e.g. add_rmsnorm: its callers' fallback "
                         "is timed; repeatable")
    args = ap.parse_args()
    os.environ["METRALE_FP8_DECODE_ACTIVATIONS"] = args.fp8_decode_activations     # every model of this run
    if any("=" not in a for a in args.gpu_default):
        ap.error(f"--gpu-default takes KERNEL=ARM, got {args.gpu_default}")
    arms = dict(a.split("=", 1) for a in args.gpu_default)
    with contextlib.ExitStack() as stack:
        for kernel, arm in arms.items():
            stack.enter_context(registry.gpu_default(kernel, arm))
        if args.disable:
            stack.enter_context(registry.disabled(*args.disable))
        run(args, arms)


def run(args, arms: dict):
    if args.out is None:
        variant = "" if args.fp8_decode_activations == "bf16" else "_fp8-decode-e4m3"
        args.out = os.path.join(ROOT, "benchmarks", "results", f"e2e_decode{variant}.json")
    sz = SIZES["tiny" if args.tiny else "full"]
    config = ModelConfig.from_hf(TINY if args.tiny else CONFIG_8B)
    batches = tuple(int(b) for b in (args.batches or ("1,4,8" if args.tiny else "1,8,32,64,256")).split(","))
    bw = copy_bandwidth()
    log(f"copy {bw / 1e9:,.0f} GB/s")
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": jax.devices()[0].device_kind,
           "jax": jax.__version__, "python": platform.python_version(), "copy_bytes_per_s": bw,
           "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "config": "tiny" if args.tiny else "nemotron_h_8b", "sizes": sz,
           "levers": {"fp8_decode_activations": args.fp8_decode_activations,
                      **({"gpu_defaults": arms} if arms else {}),
                      **({"disabled": sorted(args.disable)} if args.disable else {})}, "rows": [], "errors": {}}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    previous = read_previous(args.out, out["device"], out["config"], out["levers"]) if args.update else None

    def save():
        out["wall_s"] = time.time() - T0
        doc = merge_runs(previous, out) if previous else out
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1, default=str)

    for weights in args.weights.split(","):
        exe = Executables()
        try:
            log(f"building the {weights} model")
            model = random_model(config, jnp.bfloat16, weights=weights)
            for state in args.states.split(","):
                bench_rows(model, weights, state, batches, sz, bw, exe, out["rows"], save)
        except Exception as e:                           # keep the other rows
            out["errors"][weights] = f"{type(e).__name__}: {e}"[:500]
            traceback.print_exc()
        model = None
    save()
    log(f"wrote {args.out}")
    if out["errors"]:
        raise SystemExit(f"failed: {', '.join(out['errors'])} (see `errors` in {args.out})")


if __name__ == "__main__":
    main()
