"""Tensor-parallel throughput: a Nemotron-H model split over N devices (metrale_jax/sharding.py) against the
same weights on one device, measured in the same run. Decode: B sequences, one token each per step (tokens/s
= B / step time). Prefill: B new sequences of T tokens (tokens/s = B*T / call time). Also recorded: the
collectives in each compiled step (the design: one all-reduce per block), weight bytes per device, an
estimate of the FLOPs, and the rel. error of the split model's logits against the one-device logits.

Shapes: Nemotron-H-8B (tests/fixtures/configs/nemotron_h_8b.json: 52 blocks M/-/*, hidden 4096, 128 Mamba
heads x 64, 8 groups, state 128, 32/8 attention heads of 128, MLP 21504, vocab 131072). Random BF16 weights
drawn on the devices, each tensor straight onto its shards (the same values at every tp: threefry is
partitionable, and rows are drawn in checkpoint order, then permuted). SSM state f32.
Times: wall clock around block_until_ready; median over repeats.

    PYTHONPATH=. python benchmarks/bench_tp.py --out DIR [--tp 1,2] [--decode-batch 1,32] [--prefill 1x2048]
    CPU dry run (4 host devices, a tiny config with every block kind):
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu PYTHONPATH=. \\
        python benchmarks/bench_tp.py --tiny --out /tmp/tp
writes DIR/tp.json (DIR default benchmarks/results; the date is in the JSON); --kernels other than auto adds
_kernels-<mode>, the CPU dry run (--tiny) _tiny.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.random_weights import device_tensors, matmul_params
from metrale_jax import sharding
from metrale_jax.config import ModelConfig, ModelLevers
from metrale_jax.model import NemotronH, decode_step, prefill_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_8B = os.path.join(ROOT, "tests", "fixtures", "configs", "nemotron_h_8b.json")
TINY = dict(vocab_size=96, hidden_size=32, hybrid_override_pattern="M*E-M-", mamba_num_heads=8, mamba_head_dim=4,
            ssm_state_size=8, n_groups=4, chunk_size=8, num_attention_heads=8, num_key_value_heads=4, head_dim=4,
            intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=16, n_group=4, topk_group=2)
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


# ---- measurements ------------------------------------------------------------------------------------
def weight_bytes_per_device(model) -> int:
    dev = jax.devices()[0]
    return int(sum(s.data.nbytes for x in jax.tree.leaves(model) for s in x.addressable_shards if s.device == dev))


def _compile(step, model, *args):
    """step(model, *args) compiled ahead of time over the model's leaves (a flat list passes in ~0.3 ms; the
    nnx module itself takes a few ms to flatten per call, which would make small decode steps host-bound),
    the cache (args[0]) donated. Returns (call(*args), compiled, compile seconds)."""
    leaves, treedef = jax.tree.flatten(model)
    t = time.time()
    fn = jax.jit(lambda lv, *a: step(jax.tree.unflatten(treedef, lv), *a), donate_argnums=(1,))
    compiled = fn.lower(leaves, *args).compile()
    return (lambda *a: compiled(leaves, *a)), compiled, time.time() - t


def flatten_ms(model) -> float:
    """Host time to flatten the model pytree (what every call of a jitted step on the module itself pays)."""
    t = time.perf_counter()
    for _ in range(10):
        jax.tree.flatten(model)
    return (time.perf_counter() - t) / 10 * 1e3


def bench_decode(model, batch: int, steps: int, repeats: int, max_len: int, seed: int):
    rng = np.random.default_rng(seed)
    cache = model.new_cache(batch, max_len)
    slots = jnp.arange(batch, dtype=jnp.int32)
    tokens = jnp.asarray(rng.integers(0, model.config.vocab_size, batch).astype(np.int32))
    call, compiled, compile_s = _compile(decode_step, model, cache, slots, tokens)
    first, cache = call(cache, slots, tokens)
    first = np.asarray(first, np.float32)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(steps):
            logits, cache = call(cache, slots, tokens)
        jax.block_until_ready((logits, cache))
        times.append((time.perf_counter() - t) / steps)
    step_s = statistics.median(times)
    return dict(batch=batch, steps=steps, repeats=repeats, max_len=max_len, compile_s=round(compile_s, 2),
                step_ms=step_s * 1e3, tokens_per_s=batch / step_s,
                collectives=sharding.collective_counts(compiled.as_text())), first


def bench_prefill(model, batch: int, length: int, repeats: int, seed: int):
    rng = np.random.default_rng(seed)
    cache = model.new_cache(batch, length)
    slots = jnp.arange(batch, dtype=jnp.int32)
    ids = jnp.asarray(rng.integers(0, model.config.vocab_size, (batch, length)).astype(np.int32))
    lens = jnp.full((batch,), length, jnp.int32)
    step = functools.partial(prefill_step, all_logits=False, continue_=False)
    call, compiled, compile_s = _compile(step, model, cache, slots, ids, lens)
    first, cache = call(cache, slots, ids, lens)
    first = np.asarray(first, np.float32)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        logits, cache = call(cache, slots, ids, lens)
        jax.block_until_ready((logits, cache))
        times.append(time.perf_counter() - t)
    call_s = statistics.median(times)
    return dict(batch=batch, length=length, repeats=repeats, compile_s=round(compile_s, 2), call_ms=call_s * 1e3,
                tokens_per_s=batch * length / call_s,
                collectives=sharding.collective_counts(compiled.as_text())), first


def rel_err(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny config with every block kind (CPU dry run)")
    ap.add_argument("--config", default=CONFIG_8B, help="HF config.json (default: Nemotron-H-8B shapes)")
    ap.add_argument("--tp", default=None, help="comma-separated device counts (default 1,2; --tiny 1,2,4)")
    ap.add_argument("--decode-batch", default=None, help="comma-separated decode batches (default 1,32)")
    ap.add_argument("--prefill", default=None, help="comma-separated BxT prefill shapes (default 1x2048)")
    ap.add_argument("--decode-steps", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-len", type=int, default=None, help="KV length of the decode cache (default 512)")
    ap.add_argument("--kernels", default="auto", help="ModelLevers.kernels (auto | pallas | reference | interpret)")
    ap.add_argument("--deadline", type=float, default=float("inf"), help="seconds; stop starting new runs after")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = ap.parse_args(argv)

    tiny = args.tiny
    config = ModelConfig.from_hf(TINY if tiny else args.config)
    tps = [int(x) for x in (args.tp or ("1,2,4" if tiny else "1,2")).split(",")]
    batches = [int(x) for x in (args.decode_batch or ("1,4" if tiny else "1,32")).split(",")]
    prefill_arg = args.prefill or ("2x16" if tiny else "1x2048")
    prefills = [tuple(int(v) for v in s.split("x")) for s in prefill_arg.split(",")]
    steps = args.decode_steps or (4 if tiny else 32)
    max_len = args.max_len or (64 if tiny else 512)
    dtype = jnp.float32 if tiny else jnp.bfloat16
    levers = ModelLevers(kernels=args.kernels)
    if max(tps) > len(jax.devices()):
        print(f"--tp {max(tps)} needs {max(tps)} devices; {len(jax.devices())} available", file=sys.stderr)
        return 2
    dev = jax.devices()[0]
    result = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), device=dev.device_kind,
                  platform=dev.platform, devices=len(jax.devices()), jax=jax.__version__,
                  python=platform.python_version(), config="tiny" if tiny else os.path.basename(args.config),
                  shapes=dict(hidden=config.hidden_size, pattern=config.hybrid_override_pattern,
                              mamba_heads=config.mamba_num_heads, mamba_head_dim=config.mamba_head_dim,
                              n_groups=config.n_groups, state=config.ssm_state_size,
                              attention_heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                              intermediate=config.intermediate_size, vocab=config.vocab_size),
                  dtype=jnp.dtype(dtype).name, kernels=args.kernels,
                  method="decode_step / prefill_step compiled ahead of time over the model's leaves; decode: "
                         "`steps` steps queued then block, median over repeats; prefill: one call per repeat, "
                         "median",
                  matmul_params=matmul_params(config), runs=[], errors=[])
    flops_per_token = 2 * result["matmul_params"]
    reference: dict[str, np.ndarray] = {}
    for tp in tps:
        if time.time() - T0 > args.deadline:
            log(f"deadline: skipping tp={tp}")
            break
        try:
            mesh = None if tp == 1 else sharding.make_mesh(tp)
            t = time.time()
            tpar = None if mesh is None else sharding.tensor_parallel(mesh)
            model = NemotronH(config, device_tensors(config, dtype, tpar), dtype=dtype, levers=levers, mesh=mesh)
            jax.block_until_ready(jax.tree.leaves(model))
            run = dict(tp=tp, build_s=round(time.time() - t, 2), weight_bytes_per_device=weight_bytes_per_device(model),
                       model_flatten_ms=flatten_ms(model), decode=[], prefill=[])
            log(f"tp={tp}: model built in {run['build_s']}s, {run['weight_bytes_per_device'] / 2**30:.2f} GiB/device")
            for B in batches:
                if time.time() - T0 > args.deadline:
                    break
                r, first = bench_decode(model, B, steps, args.repeats, max_len, seed=B)
                r["weight_GBps_per_device"] = run["weight_bytes_per_device"] / (r["step_ms"] / 1e3) / 1e9
                _check(reference, f"decode{B}", first, r)
                run["decode"].append(r)
                log(f"tp={tp} decode B={B}: {r['step_ms']:.3f} ms/step, {r['tokens_per_s']:.1f} tok/s, "
                    f"compile {r['compile_s']}s, {r['collectives']}")
            for B, T in prefills:
                if time.time() - T0 > args.deadline:
                    break
                r, first = bench_prefill(model, B, T, args.repeats, seed=B * T)
                r["tflops"] = flops_per_token * B * T / (r["call_ms"] / 1e3) / 1e12
                _check(reference, f"prefill{B}x{T}", first, r)
                run["prefill"].append(r)
                log(f"tp={tp} prefill {B}x{T}: {r['call_ms']:.2f} ms, {r['tokens_per_s']:.0f} tok/s, "
                    f"{r['tflops']:.1f} TFLOP/s, compile {r['compile_s']}s, {r['collectives']}")
            result["runs"].append(run)
            del model
            gc.collect()
        except Exception as e:                     # keep what was measured; say what failed
            traceback.print_exc()
            result["errors"].append(f"tp={tp}: {type(e).__name__}: {e}"[:2000])
    result["ratios"] = _ratios(result["runs"])
    os.makedirs(args.out, exist_ok=True)
    name = "tp" + ("" if args.kernels == "auto" else f"_kernels-{args.kernels}") + ("_tiny" if tiny else "")
    path = os.path.join(args.out, f"{name}.json")
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    log(f"wrote {path}")
    for k, v in result["ratios"].items():
        log(f"  {k}: {v:.3f}x the one-device tokens/s")
    return 1 if result["errors"] else 0


def _check(reference: dict, key: str, logits: np.ndarray, record: dict) -> None:
    """First logits of a run against tp=1's (same weights, same inputs)."""
    if key not in reference:
        reference[key] = logits
        return
    record["logits_rel_err_vs_tp1"] = rel_err(logits, reference[key])


def _ratios(runs) -> dict[str, float]:
    base = next((r for r in runs if r["tp"] == 1), None)
    out = {}
    if base is None:
        return out
    for run in runs:
        if run["tp"] == 1:
            continue
        for kind, key in (("decode", "batch"), ("prefill", "length")):
            for r in run[kind]:
                b = next((x for x in base[kind] if x[key] == r[key] and x["batch"] == r["batch"]), None)
                if b is not None:
                    name = f"tp{run['tp']}_{kind}_B{r['batch']}" + (f"xT{r['length']}" if kind == "prefill" else "")
                    out[name] = r["tokens_per_s"] / b["tokens_per_s"]
    return out


if __name__ == "__main__":
    sys.exit(main())
