"""Serving runtime throughput: the Engine (metrale_jax/runtime) on Nemotron-H-8B shapes with random BF16 weights.

Sections (each against a floor or baseline measured in the same run; decode throughput has its own benchmark,
bench_e2e_decode.py, which uses this file's model builder, baselines and profile):
- prefill: tokens/s of one T-token prompt through the compiled prefill step, against the bytes floor and
  the FLOPs floor (2 x matmul params x T + attention, at the bf16 matmul rate measured here).
- ttft: time to first token for a prompt whose first P tokens are in the prefix cache (a hit: restore the
  snapshot, prefill the rest) vs the same length with a fresh prefix (a miss: prefill everything).
- spec: speculative decoding (n-gram prompt lookup, 3 drafts) on vs off on a repetitive prompt set, greedy:
  tokens/s, draft acceptance, and whether the outputs are identical. With random weights the acceptance
  comes from the model's own loops, not from language.
- spec_builtin: the same comparison on the built-in trained model (held-out KJV passages repeated), where
  the drafts are accepted for the reason speculation exists: the model copies; and beside it (key "mtp"),
  on the same prompts, drafting with the model's trained MTP head instead of n-gram lookup.
Times: wall clock around block_until_ready; median of repeats; compiles happen in warm-up, never timed.

    PYTHONPATH=. python benchmarks/bench_runtime.py [--out DIR] [--sections prefill,ttft,spec,spec_builtin]
        [--deadline SECONDS] [--weights bf16|fp8-block|nvfp4]   (sections: prefill,ttft,spec,spec_builtin)
    CPU dry run (tiny config with every block kind, small sizes):
    JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/bench_runtime.py --tiny --out /tmp/rt
writes DIR/runtime_<weights>.json (DIR default benchmarks/results; the date is in the JSON), e.g. runtime_bf16.json;
a model lever set away from its default (METRALE_FP8_ACTIVATIONS=bf16 ...) joins the name as _act-<mode> for the
weights' activation lever (runtime_fp8-block_act-bf16.json) or _<lever>-<value>; --tiny adds _tiny.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import timing
from benchmarks.random_weights import device_tensors, matmul_params
from metrale_jax.config import ModelConfig, ModelLevers
from metrale_jax.layers.projection import PREFILL_ONLY_ARMS, Projection
from metrale_jax.model import NemotronH
from metrale_jax.runtime import Engine, Executables, SpeculativeConfig, steps
from metrale_jax.runtime.prefix_cache import tree_nbytes
from metrale_jax.weights import quant_formats, quantize
from metrale_jax.weights.containers import Fp8Weight, Nvfp4Weight, StackedExperts
from pallas_kernels import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_8B = os.path.join(ROOT, "tests", "fixtures", "configs", "nemotron_h_8b.json")
TINY = dict(vocab_size=256, hidden_size=64, hybrid_override_pattern="M*E-M-", mamba_num_heads=8, mamba_head_dim=8,
            ssm_state_size=16, n_groups=2, chunk_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=96, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32, n_group=4, topk_group=2)
SIZES = {  # spec prompt; prefill T = ttft prefix, + tail; spec batches / new tokens
    "full": dict(prompt=64, prefix=2048, tail=64, spec_batches=(1, 8), spec_new=256, nominal_bw=4.8e12,
                 nominal_flops=989e12),
    "tiny": dict(prompt=16, prefix=64, tail=16, spec_batches=(1, 4), spec_new=24, nominal_bw=None, nominal_flops=None),
}
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


# ---- model and baselines ----------------------------------------------------------------------------
def _quantized(w: jax.Array, weights: str):
    """One dense [N, K] weight (or a stack [E, N, K]) in the container the quantized checkpoint loads as."""
    if weights == "fp8-block":
        fn, box = quant_formats.quantize_fp8_block, lambda a: Fp8Weight(*a)
    else:
        fn, box = quant_formats.quantize_nvfp4, lambda a: Nvfp4Weight(*a)
    return StackedExperts(box(jax.vmap(fn)(w))) if w.ndim == 3 else box(fn(w))


def random_model(config: ModelConfig, dtype, seed: int = 0, weights: str = "bf16") -> NemotronH:
    """Random weights drawn on the device (benchmarks/random_weights.py). weights="fp8-block" / "nvfp4": the linear
    layers `metrale-jax quantize --format fp8-block|nvfp4` would quantize become block-scaled FP8 / NVFP4
    containers (quantized on the device; a layer's stacked routed experts as StackedExperts), as such a checkpoint
    loads."""
    tensors = device_tensors(config, dtype, None, seed)
    if weights == "bf16":
        return NemotronH(config, tensors, dtype=dtype)
    entries = [(n, "BF16" if a.dtype == jnp.bfloat16 else "F32", tuple(a.shape)) for n, a in tensors.items()]
    stacks = {n.replace(".experts.", ".experts.0."): n for n in tensors if n.endswith("_proj") and ".experts." in n}
    entries += [(m + ".weight", "BF16", tuple(tensors[n].shape[1:])) for m, n in stacks.items()]  # as the quantizer
    qcfg, todo = quantize.plan(entries, weights)                                              # sees expert 0
    for module in todo:
        name = stacks.get(module, module + ".weight")          # a layer's routed experts: quantized as one stack
        tensors[name] = _quantized(tensors[name], weights)
    return NemotronH(config, tensors, dtype=dtype, quant_config=qcfg)


def decode_weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads: the whole model less the prefill-only copies of its projections
    (pre-dequantized FP8, transposed NVFP4)."""
    copies = [getattr(node, arm).get_value() for _, node in nnx.iter_graph(model) if isinstance(node, Projection)
              for arm in PREFILL_ONLY_ARMS if getattr(node, arm) is not None]
    return tree_nbytes(jax.tree.leaves(model)) - tree_nbytes(jax.tree.leaves(copies))


def block(x):
    return jax.tree.map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)


def median_time(fn, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        block(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(calls: int = 20) -> float:
    """Bytes read + written per second by an elementwise pass over a large array (the bytes-floor baseline);
    `calls` passes are queued back to back so the host's dispatch and sync stay out of the rate."""
    n = (1 << 28) if jax.default_backend() == "gpu" else (1 << 22)
    x = jax.random.normal(jax.random.key(0), (n,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001 + 1.0)
    block(f(x))

    def chained():
        y = x
        for _ in range(calls):
            y = f(y)
        return y

    return 2 * x.nbytes * calls / median_time(chained)


def matmul_rate(dtype) -> float:
    """FLOP/s of a large square matmul in the model dtype (the FLOPs-floor baseline)."""
    n = 8192 if jax.default_backend() == "gpu" else 512
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    block(f(a, a))
    return 2 * n ** 3 / median_time(lambda: f(a, a))


def state_bytes_per_seq(cache, seq_len: int) -> dict:
    """Per decoding sequence and step: Mamba state read + written, keys/values read (seq_len rows) + written."""
    ssm = (cache.ssm.conv_state[:, 0].nbytes + cache.ssm.ssm_state[:, 0].nbytes) if cache.ssm.num_layers else 0
    kv_row = cache.kv.k[:, 0, 0].nbytes * 2 if cache.kv.num_layers else 0
    return {"ssm_rw": 2 * ssm, "kv_read": kv_row * seq_len, "kv_write": kv_row}


# ---- sections ---------------------------------------------------------------------------------------
KERNEL_CLASSES = (  # (class, substrings of a kernel name), first match wins
    # Mosaic kernels reach the trace as `anonymous_mosaic_gpu_kernel`; at decode they are the projection GEMVs
    ("projections (Pallas)", ("gemv", "w8a16", "w4a16", "w4a4", "fp8_gemm", "quantize_rows", "mosaic_gpu")),
    ("mamba mixer (Pallas)", ("ssm_state_update", "causal_conv1d", "ssd", "rmsnorm")),
    ("XLA matmuls", ("nvjet", "gemm", "cutlass", "cublas", "sm90_xmma", "dot")),
    ("XLA slices", ("slice",)),   # operands cut out for a custom call (each a kernel of its own)
)


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((c for c, keys in KERNEL_CLASSES if any(k in low for k in keys)), "XLA fusions and other")


def decode_profile(chained, chain: int, dev_s: float) -> dict:
    """Where a chained decode step's GPU time goes, from a profiler trace of one chain: kernel time per class and
    per kernel name, kernels per step, and the idle part of the traced span (launch gaps, host waits)."""
    if jax.default_backend() != "gpu":
        return {"error": "GPU only: the trace has kernel events on the GPU backend"}
    d = tempfile.mkdtemp()
    try:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            block(chained())
        events = timing.gpu_kernel_events(d)
    except Exception as e:  # noqa: BLE001  (the profiler is optional; the timing above stands)
        return {"error": f"profile failed: {e!r}"[:300]}
    if not events:
        return {"error": "no kernel events in the trace"}
    return {"wall_step_us": dev_s * 1e6, **timing.kernel_breakdown(events, chain, kernel_class)}


def _one_slot_engine(model, sz, exe):
    """The engine the prefill and ttft sections share (same cache shapes, so the same executables)."""
    P, tail = sz["prefix"], sz["tail"]
    return Engine(model, max_slots=1, max_len=P + tail + 2, batch_buckets=(1,), token_buckets=(bucket_of(tail), P),
                  prefill_token_budget=P, prefix_cache_bytes=1 << 40, executables=exe, eos_ids=[])


def bench_prefill(model, sz, exe, bw, flops, out):
    """One P-token prompt through the compiled prefill step (a fresh slot each time)."""
    T = sz["prefix"]
    eng = _one_slot_engine(model, sz, exe)
    c = model.config
    ids = jax.device_put(np.random.default_rng(1).integers(0, c.vocab_size, (1, T)).astype(np.int32))
    slots, lengths = jax.device_put(np.zeros(1, np.int32)), jax.device_put(np.full(1, T, np.int32))
    zero = jax.device_put(np.int32(0))

    def once():
        eng.cache = exe.run("zero_slot", steps.zero_slot, eng.cache, zero, donate_argnums=(0,))
        res = eng.call("prefill", steps.prefill_step, eng.cache, slots, ids, lengths, None, None, None,
                       donate_argnums=(1,))
        eng.cache = res.cache
        return res.logits

    block(once())                                          # compile
    t = median_time(once, reps=3)
    wbytes = tree_nbytes(jax.tree.leaves(model))
    fl = 2 * matmul_params(c) * T + len(c.attention_layer_ids) * 2 * c.num_attention_heads * c.head_dim * T * T
    bytes_floor = wbytes + state_bytes_per_seq(eng.cache, 0)["ssm_rw"] / 2
    out["prefill"] = {"T": T, "seconds": t, "tokens_per_s": T / t, "flops_est": fl, "bytes_floor_s": bytes_floor / bw,
                      "flops_floor_s": fl / flops, "vs_flops_floor": fl / flops / t,
                      "vs_bytes_floor": bytes_floor / bw / t}
    log(f"prefill T={T}: {T / t:,.0f} tok/s, {fl / flops / t:.0%} of the matmul-rate floor, "
        f"{bytes_floor / bw / t:.0%} of the bytes floor")


def bench_ttft(model, sz, exe, out):
    """Prompt = P tokens seen before + a new tail (a hit restores P, prefills the tail) against a prompt of the
    same length never seen (a miss prefills it all). The first round compiles what the rounds use."""
    P, tail = sz["prefix"], sz["tail"]
    eng = _one_slot_engine(model, sz, exe)
    rng = np.random.default_rng(2)
    V = model.config.vocab_size

    def ttft(prompt):
        rid = eng.submit(prompt, 1)
        eng.run()
        r = eng.pop(rid)
        return r.t_first - r.t_submit, r.prefix_hit

    hits, misses = [], []
    for _ in range(4):
        base = rng.integers(0, V, P).tolist()
        ttft(base)                                         # its snapshot at P
        hits.append(ttft(base + rng.integers(0, V, tail).tolist()))
        misses.append(ttft(rng.integers(0, V, P + tail).tolist()))
    hits, misses = hits[1:], misses[1:]
    h, m = statistics.median(t for t, _ in hits), statistics.median(t for t, _ in misses)
    out["ttft"] = {"prefix_tokens": P, "tail_tokens": tail, "hit_s": h, "miss_s": m, "speedup": m / h,
                   "restored_tokens": [n for _, n in hits], "missed_restores": [n for _, n in misses],
                   "prefix_cache": eng.prefix_cache.stats()}
    log(f"ttft: hit {h * 1e3:.1f} ms, miss {m * 1e3:.1f} ms ({m / h:.1f}x)")


def bucket_of(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b


def spec_compare(model, prompts_by_batch: dict, new: int, exe, num_draft: int = 3, method: str = "ngram") -> dict:
    """Greedy generation with speculation (`method` drafts) off vs on, per batch: tokens/s (the second of two
    runs, so nothing one-off is timed), acceptance of that run's drafts, and whether the outputs are identical."""
    batches = sorted(prompts_by_batch)
    plen = max(len(p) for ps in prompts_by_batch.values() for p in ps)
    common = dict(max_slots=max(batches), max_len=plen + new + num_draft + 8, batch_buckets=batches,
                  prefill_batch_buckets=(max(batches),), token_buckets=(bucket_of(plen),),
                  prefill_token_budget=bucket_of(plen) * max(batches), executables=exe, eos_ids=[])
    plain = Engine(model, **common)
    spec = Engine(model, speculative=SpeculativeConfig(method=method, num_draft=num_draft), **common)
    log(f"spec ({method}): warm-up compiles {plain.warmup() + spec.warmup()}")
    res = {}
    for B in batches:
        prompts, row = prompts_by_batch[B], {}
        for name, eng in (("off", plain), ("on", spec)):
            for _ in range(2):
                c0 = dict(eng.counters)
                t = time.perf_counter()
                gens = eng.generate(prompts, new)
                dt = time.perf_counter() - t
            drafted = eng.counters.get("drafted_tokens", 0) - c0.get("drafted_tokens", 0)
            accepted = eng.counters.get("accepted_tokens", 0) - c0.get("accepted_tokens", 0)
            row[name] = (sum(len(g.tokens) for g in gens) / dt, [g.tokens for g in gens], drafted, accepted)
        same = sum(a == b for a, b in zip(row["off"][1], row["on"][1]))
        _, _, drafted, accepted = row["on"]
        res[B] = {"off_tokens_per_s": row["off"][0], "on_tokens_per_s": row["on"][0],
                  "speedup": row["on"][0] / row["off"][0], "identical_outputs": f"{same}/{B}",
                  "drafted": drafted, "accepted": accepted, "acceptance": accepted / max(drafted, 1)}
        log(f"spec ({method}) B={B}: {res[B]['speedup']:.2f}x ({row['off'][0]:,.0f} -> {row['on'][0]:,.0f} tok/s), "
            f"acceptance {res[B]['acceptance']:.0%}, identical outputs {same}/{B}")
    return {"method": method, "num_draft": num_draft, "new_tokens": new, "by_batch": res}


def bench_spec(model, sz, exe, out):
    """Speculation off vs on for this model, on repetitive prompts (a random segment x 4)."""
    V, seg = model.config.vocab_size, sz["prompt"] // 2
    rng = np.random.default_rng(3)
    prompts = {B: [rng.integers(0, V, seg).tolist() * 4 for _ in range(B)] for B in sz["spec_batches"]}
    out["spec"] = {"prompt": f"{seg} random tokens x 4", **spec_compare(model, prompts, sz["spec_new"], exe)}


def bench_spec_builtin(sz, out):
    """Speculation off vs on for the built-in trained model (real acceptance; a small, launch-bound model):
    held-out KJV verses, each prompt one passage twice, so a model that copies continues the passage."""
    from metrale_jax.builtin import load_builtin

    model = load_builtin()
    text = open(os.path.join(ROOT, "data", "kjv", "heldout.txt"), "rb").read()
    rng = np.random.default_rng(4)
    seg = sz["prompt"] * 2

    def prompt():
        at = int(rng.integers(0, len(text) - seg))
        passage = text[at:at + seg].decode("utf-8", "ignore")
        return model.tokenizer.encode(passage) + model.tokenizer.encode(passage, add_bos=False)

    prompts = {B: [prompt() for _ in range(B)] for B in sz["spec_batches"]}
    exe = Executables()
    out["spec_builtin"] = {"model": "built-in tiny (metrale_jax/assets/tiny)", "dtype": str(model.dtype),
                           "prompt": f"{seg} bytes of held-out KJV x 2",
                           **spec_compare(model, prompts, sz["spec_new"], exe)}
    if model.mtp is None:
        out["spec_builtin"]["mtp"] = {"skipped": "the built-in checkpoint has no MTP head"}
    else:
        out["spec_builtin"]["mtp"] = {"pattern": model.config.mtp_hybrid_override_pattern,
                                      **spec_compare(model, prompts, sz["spec_new"], exe, method="mtp")}


# ---- main -------------------------------------------------------------------------------------------
ACTIVATION_LEVER = {"fp8-block": "fp8_activations", "nvfp4": "nvfp4_activations"}


def result_name(weights: str, levers: ModelLevers, tiny: bool) -> str:
    """runtime_<weights>[_act-<mode>][_<lever>-<value>...][_tiny].json: one file per weight format and lever
    setting. Levers at their defaults stay out of the name; the weights' activation lever reads act-<mode>."""
    act = ACTIVATION_LEVER.get(weights)
    parts = ["runtime", weights]
    for field in dataclasses.fields(ModelLevers):
        value = getattr(levers, field.name)
        if value == field.default:
            continue
        if field.name == act:
            parts.append(f"act-{value}")
        elif field.name not in ACTIVATION_LEVER.values():     # the other format's activation lever changes nothing
            parts.append(f"{field.name}-{value}")
    if tiny:
        parts.append("tiny")
    return "_".join(parts) + ".json"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--tiny", action="store_true", help="tiny config and sizes (a CPU dry run)")
    ap.add_argument("--config", default=CONFIG_8B, help="HF config.json (default: Nemotron-H-8B shapes)")
    ap.add_argument("--sections", default="prefill,ttft,spec,spec_builtin")
    ap.add_argument("--deadline", type=float, default=float("inf"), help="skip sections that start after this")
    ap.add_argument("--weights", default="bf16", choices=("bf16", "fp8-block", "nvfp4"),
                    help="linear weights: BF16, block-scaled FP8 (the FP8 arms) or NVFP4 (the W4A16 arms)")
    args = ap.parse_args()
    sz = SIZES["tiny" if args.tiny else "full"]
    config = ModelConfig.from_hf(TINY if args.tiny else args.config)
    dtype = jnp.bfloat16
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": jax.devices()[0].device_kind,
           "backend": jax.default_backend(), "jax": jax.__version__, "python": platform.python_version(),
           "config": {k: getattr(config, k) for k in ("hidden_size", "num_hidden_layers", "hybrid_override_pattern",
                                                       "mamba_num_heads", "mamba_head_dim", "ssm_state_size",
                                                       "n_groups", "chunk_size", "num_attention_heads",
                                                       "num_key_value_heads", "head_dim", "intermediate_size",
                                                       "vocab_size")},
           "dtype": "bfloat16", "weights": args.weights, "ssm_state_dtype": str(config.mamba_ssm_cache_dtype), "sizes": sz, "errors": {}}
    log("building the model")
    model = random_model(config, dtype, weights=args.weights)
    first_mamba = model.layers[model.config.hybrid_override_pattern.index("M")]
    out["arms"] = {"mamba_decode_B1": first_mamba.active_arm("decode", 1),
                   "mamba_prefill_T2048": first_mamba.active_arm("prefill", 2048)}
    out["kernels"] = registry.report()
    out["levers"] = dataclasses.asdict(model.levers)
    bw, flops = copy_bandwidth(), matmul_rate(dtype)
    out["baselines"] = {"copy_bytes_per_s": bw, "matmul_flops_per_s": flops, "nominal_bytes_per_s": sz["nominal_bw"],
                        "nominal_flops_per_s": sz["nominal_flops"]}
    log(f"copy {bw / 1e9:,.0f} GB/s, matmul {flops / 1e12:,.1f} TFLOP/s")
    exe = Executables()
    sections = {"prefill": lambda: bench_prefill(model, sz, exe, bw, flops, out),
                "ttft": lambda: bench_ttft(model, sz, exe, out),
                "spec": lambda: bench_spec(model, sz, exe, out),
                "spec_builtin": lambda: bench_spec_builtin(sz, out)}
    for name in args.sections.split(","):
        if time.time() - T0 > args.deadline:
            out["errors"][name] = "skipped: deadline"
            continue
        try:
            sections[name]()
        except Exception as e:                               # keep the other sections' numbers
            out["errors"][name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
    out["compiles"] = exe.stats()["compiles"]
    out["wall_s"] = time.time() - T0
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, result_name(args.weights, model.levers, args.tiny))
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1, default=str)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
