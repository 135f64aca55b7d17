"""Train the built-in default model: a tiny byte-level Nemotron-H with every block kind (M, *, -, E)
on the King James Bible text in data/kjv/, with jax.grad + optax through the model's own forward pass and
its default kernels (METRALE_KERNELS: the references on the CPU, the Pallas kernels on a GPU, whose backward
passes are their references' VJPs; the same logits NemotronH.forward returns). Runs on the CPU; fixed seed,
so a rerun on the same machine and versions retraces the same curve.

Writes config.json, model.safetensors and byte_tokenizer.json (model.save_pretrained) and
train_log.json (arguments, the train / held-out loss at every eval step in bits per byte, the unigram
baseline, the time taken, a greedy sample) to --out (default metrale_jax/assets/tiny/).

    python tools/train_tiny.py                       # the shipped model (~20 min on 2 cores)
    python tools/train_tiny.py --steps 20 --out /tmp/tiny --eval-every 10     # a smoke run

--mtp-only trains an MTP head (one step of --mtp-pattern blocks, drafting tok_{t+2}) onto the model in
--base (default the shipped one) with its main weights, embeddings and lm_head frozen, through the MTP path
the engine serves (NemotronMTP.prefill on a throw-away MtpCache), and saves the model with the head to --out
(main tensors unchanged bit for bit; train_log.json gets an "mtp" section):

    python tools/train_tiny.py --mtp-only --steps 1000 --eval-every 100 --out /tmp/tiny_mtp    # ~8 min, 2 cores
    (the shipped head: then copy config.json, model.safetensors, train_log.json into metrale_jax/assets/tiny/)
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from metrale_jax.config import ModelConfig
from metrale_jax.layers.mtp import MtpCache
from metrale_jax.model import NemotronH, _hidden_no_cache, _logits, forward_step, random_tensors
from metrale_jax.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parents[1]
LN2 = math.log(2.0)


# ---- data ----------------------------------------------------------------------------------------
def load_split(path: Path) -> np.ndarray:
    """A corpus file as byte-tokenizer ids (byte + 3), int32."""
    return np.frombuffer(path.read_bytes(), np.uint8).astype(np.int32) + ByteTokenizer.offset


def line_starts(ids: np.ndarray, length: int) -> np.ndarray:
    """Offsets of the line beginnings from which a window of `length` ids fits."""
    newline = ord("\n") + ByteTokenizer.offset
    starts = np.concatenate([[0], np.flatnonzero(ids[:-1] == newline) + 1])
    return starts[starts + length <= len(ids)]


def windows(ids: np.ndarray, offsets: np.ndarray, length: int) -> np.ndarray:
    """Rows [BOS, ids[o], ..., ids[o + length - 1]] for each offset: [len(offsets), length + 1].
    Every row starts with BOS, as a prompt does when it is encoded."""
    rows = np.stack([ids[o:o + length] for o in offsets])
    return np.concatenate([np.full((len(offsets), 1), ByteTokenizer.bos_id, np.int32), rows], axis=1)


def eval_windows(ids: np.ndarray, n: int, length: int) -> np.ndarray:
    """n windows at evenly spaced line starts: a fixed evaluation set."""
    starts = line_starts(ids, length)
    return windows(ids, starts[np.linspace(0, len(starts) - 1, n).astype(int)], length)


def unigram_bits_per_byte(train: np.ndarray, test: np.ndarray) -> float:
    """Cross-entropy of `test` under byte frequencies counted on `train` (add-one smoothed), bits/byte."""
    counts = np.bincount(train, minlength=ByteTokenizer.vocab_size).astype(np.float64) + 1.0
    logp = np.log2(counts / counts.sum())
    return float(-logp[test].mean())


# ---- model ---------------------------------------------------------------------------------------
def tiny_config(hidden: int, pattern: str, chunk_size: int) -> ModelConfig:
    """Byte vocabulary; Mamba-2 with head dim 32 and expand 2; GQA attention (head dim 32, no
    positional rotation, as in Nemotron-H); relu^2 MLP 4x; 4 routed experts (top 2) + 1 shared."""
    return ModelConfig.from_hf(dict(
        vocab_size=ByteTokenizer.vocab_size, hidden_size=hidden, hybrid_override_pattern=pattern,
        mamba_num_heads=2 * hidden // 32, mamba_head_dim=32, ssm_state_size=32, n_groups=1, chunk_size=chunk_size,
        num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 64), head_dim=32,
        intermediate_size=4 * hidden, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=2 * hidden,
        n_shared_experts=1, moe_shared_expert_intermediate_size=2 * hidden, n_group=1, topk_group=1,
        tie_word_embeddings=False, max_position_embeddings=4096,
        bos_token_id=ByteTokenizer.bos_id, eos_token_id=ByteTokenizer.eos_id, pad_token_id=ByteTokenizer.pad_id))


def init_model(config: ModelConfig, seed: int) -> NemotronH:
    """f32 random weights (the library's initialiser) with a zero routing correction bias: a trained
    router starts unbiased; the bias only changes which experts are chosen and gets no gradient."""
    tensors = random_tensors(config, jax.random.key(seed), jnp.float32)
    for name in tensors:
        if name.endswith("e_score_correction_bias"):
            tensors[name] = jnp.zeros_like(tensors[name])
    return NemotronH(config, tensors, dtype=jnp.float32, tokenizer=ByteTokenizer())


def mean_nll(model: NemotronH, rows: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats) over rows [B, T+1], through the model's forward path (its kernels)."""
    logits = forward_step(model, rows[:, :-1])                            # [B, T, V] f32
    return optax.softmax_cross_entropy_with_integer_labels(logits, rows[:, 1:]).mean()


# ---- training ------------------------------------------------------------------------------------
def load_data(args):
    """(train ids, held-out ids, window length T, train window starts, train / held-out eval windows)."""
    train_ids = load_split(args.data / "train.txt")
    held_ids = load_split(args.data / "heldout.txt")
    T = args.seq_len
    return (train_ids, held_ids, T, line_starts(train_ids, T), eval_windows(train_ids, args.eval_rows, T),
            eval_windows(held_ids, args.eval_rows, T))


def optimizer(args, params):
    """(AdamW with warm-up + cosine decay, clipped, decay on matrices only; its schedule)."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, max(args.steps, args.warmup + 1),
                                                  end_value=args.lr * 0.05)
    decay_mask = jax.tree.map(lambda x: x.ndim >= 2, params)
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=args.weight_decay, mask=decay_mask))
    return opt, schedule


def train(args) -> dict:
    train_ids, held_ids, T, starts, train_eval, held_eval = load_data(args)
    unigram = unigram_bits_per_byte(train_ids, held_eval[:, 1:].ravel())

    config = tiny_config(args.hidden, args.pattern, args.chunk_size)
    model = init_model(config, args.seed)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    n_params = sum(int(x.size) for x in jax.tree.leaves(params))
    # the loss below must see exactly what NemotronH.forward returns
    probe = held_eval[:2, :-1]
    np.testing.assert_array_equal(np.asarray(model.forward(probe)), np.asarray(jax.jit(forward_step)(model, probe)))

    opt, schedule = optimizer(args, params)
    opt_state = opt.init(params)

    def loss_fn(p, rows):
        return mean_nll(nnx.merge(graphdef, p, rest), rows)

    @jax.jit
    def step(p, s, rows):
        loss, grads = jax.value_and_grad(loss_fn)(p, rows)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    eval_loss = jax.jit(loss_fn)
    rng = np.random.default_rng(args.seed)
    log = {"args": {k: _rel(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "finish_from"},
           "config": {"pattern": config.hybrid_override_pattern, "hidden_size": config.hidden_size},
           "params": n_params, "corpus": _corpus_info(args.data), "unigram_heldout_bits_per_byte": unigram,
           "evals": [], "versions": {"jax": jax.__version__, "optax": optax.__version__,
                                     "python": platform.python_version()}, "machine": platform.machine()}
    print(f"{n_params:,} parameters, pattern {config.hybrid_override_pattern!r}, hidden {config.hidden_size}; "
          f"unigram baseline {unigram:.3f} bits/byte on the held-out windows", flush=True)

    t0 = time.perf_counter()
    done = 0
    for it in range(1, args.steps + 1):
        rows = windows(train_ids, rng.choice(starts, args.batch), T)
        params, opt_state, loss = step(params, opt_state, jnp.asarray(rows))
        done = it
        out_of_time = time.perf_counter() - t0 > args.max_minutes * 60
        if it % args.eval_every == 0 or it == args.steps or it == 1 or out_of_time:
            tr = float(eval_loss(params, jnp.asarray(train_eval))) / LN2
            he = float(eval_loss(params, jnp.asarray(held_eval))) / LN2
            entry = {"step": it, "seconds": round(time.perf_counter() - t0, 1), "lr": float(schedule(it)),
                     "batch_loss_bits": float(loss) / LN2, "train_bits_per_byte": tr, "heldout_bits_per_byte": he}
            log["evals"].append(entry)
            print(f"step {it:5d}  {entry['seconds']:7.1f}s  lr {entry['lr']:.2e}  batch {entry['batch_loss_bits']:.3f}"
                  f"  train {tr:.3f}  held-out {he:.3f} bits/byte", flush=True)
        if out_of_time:
            print(f"stopping at step {it}: --max-minutes {args.max_minutes} reached", flush=True)
            break

    log.update(steps_done=done, train_seconds=round(time.perf_counter() - t0, 1), final=log["evals"][-1])
    return finish(nnx.merge(graphdef, params, rest), args, log, held_eval)


def finish(model: NemotronH, args, log: dict, held_eval: np.ndarray) -> dict:
    """Save the model in --save-dtype, load it back, and log the saved model's held-out bits/byte
    (the figure tests/model/test_builtin_model.py checks) and a greedy sample."""
    dtype = jnp.dtype(args.save_dtype)
    saved = NemotronH(model.config, model.state_dict(), dtype=dtype, tokenizer=ByteTokenizer())
    args.out.mkdir(parents=True, exist_ok=True)
    files = saved.save_pretrained(args.out, overwrite=True)
    loaded = NemotronH.from_pretrained(args.out, dtype=dtype, progress=False)
    logprobs = np.asarray(loaded.score(held_eval), np.float64)
    log["saved"] = {"dtype": dtype.name, "bytes": sum(f.stat().st_size for f in files),
                    "heldout_bits_per_byte": float(-logprobs.mean() / LN2), "heldout_windows": held_eval.shape[0]}
    prompt = "And God said unto Moses,"
    log["sample_greedy"] = prompt + loaded.generate([prompt], max_new_tokens=200)[0].text
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"saved {dtype.name} weights to {args.out}: held-out {log['saved']['heldout_bits_per_byte']:.3f} "
          f"bits/byte (unigram {log['unigram_heldout_bits_per_byte']:.3f}); greedy sample:\n{log['sample_greedy']}",
          flush=True)
    return log


def refinish(args) -> dict:
    """--finish-from DIR: save a finished run (an f32 checkpoint and its train_log.json) again,
    in --save-dtype, without training."""
    src = args.finish_from
    model = NemotronH.from_pretrained(src, dtype=jnp.float32, progress=False)
    log = json.loads((src / "train_log.json").read_text())
    log["args"].update(out=_rel(args.out), save_dtype=args.save_dtype)      # as if the run had saved it so
    held_eval = eval_windows(load_split(args.data / "heldout.txt"), int(log["args"]["eval_rows"]),
                             int(log["args"]["seq_len"]))
    return finish(model, args, log, held_eval)


# ---- the MTP head (--mtp-only) -------------------------------------------------------------------
def with_mtp_head(base: NemotronH, pattern: str, seed: int) -> NemotronH:
    """`base` (f32) plus a fresh one-step MTP head of blocks `pattern` (the library's initialiser)."""
    config = dataclasses.replace(base.config, num_nextn_predict_layers=1, mtp_hybrid_override_pattern=pattern)
    tensors = dict(base.state_dict())
    fresh = random_tensors(config, jax.random.key(seed), jnp.float32)
    tensors.update({n: jnp.zeros_like(v) if n.endswith("e_score_correction_bias") else v
                    for n, v in fresh.items() if n.startswith("mtp.")})
    return NemotronH(config, tensors, dtype=jnp.float32, levers=base.levers, tokenizer=ByteTokenizer())


def mtp_draft_logits(model: NemotronH, mtp, rows: jax.Array) -> jax.Array:
    """Draft logits [B, L-2, V] of tok_{t+2} for rows [B, L]: the frozen model's final-normed h_t and
    embed(tok_{t+1}) through mtp.prefill (the engine's call in steps.mtp_prefill, for new sequences) on a
    throw-away MtpCache, then the shared lm_head."""
    B, L = rows.shape
    T = L - 2
    h = jax.lax.stop_gradient(_hidden_no_cache(model, rows[:, :T], jnp.full((B,), T, jnp.int32)))   # [B, T, D]
    emb = jax.lax.stop_gradient(model.embeddings[...][rows[:, 1:T + 1]])                          # [B, T, D]
    kv = MtpCache.for_config(model.config, B, T, h.dtype).kv
    g, _ = mtp.prefill(kv, jnp.arange(B, dtype=jnp.int32), emb, h, jnp.full((B,), T, jnp.int32),
                       jnp.zeros((B,), jnp.int32))
    return _logits(model, g.reshape(B * T, -1)).reshape(B, T, -1)


def train_mtp(args) -> dict:
    """Train only the MTP head of --base's model plus a fresh head (cross-entropy of its drafts against
    ids[t+2]); log train / held-out loss and the held-out top-1 draft accuracy; save to --out."""
    train_ids, held_ids, T, starts, train_eval, held_eval = load_data(args)
    base = NemotronH.from_pretrained(args.base, dtype=jnp.float32, progress=False)
    model = with_mtp_head(base, args.mtp_pattern, args.seed)
    graphdef, params, rest = nnx.split(model.mtp, nnx.Param, ...)
    n_params = sum(int(x.size) for x in jax.tree.leaves(params))

    opt, schedule = optimizer(args, params)
    opt_state = opt.init(params)

    def loss_fn(p, m, rows):
        logits = mtp_draft_logits(m, nnx.merge(graphdef, p, rest), rows)
        return optax.softmax_cross_entropy_with_integer_labels(logits, rows[:, 2:]).mean(), logits

    @jax.jit
    def step(p, s, m, rows):
        (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, m, rows)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    @jax.jit
    def evaluate(p, m, rows):
        loss, logits = loss_fn(p, m, rows)
        return loss, (jnp.argmax(logits, -1) == rows[:, 2:]).mean()

    rng = np.random.default_rng(args.seed + 1)
    log = {"args": {k: _rel(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                    if k in ("base", "mtp_pattern", "seq_len", "batch", "steps", "lr", "warmup", "weight_decay",
                             "eval_rows", "seed", "save_dtype")},
           "pattern": args.mtp_pattern, "params": n_params, "target": "tok_{t+2} (one MTP step)", "evals": []}
    print(f"MTP head {args.mtp_pattern!r}: {n_params:,} trained parameters (main model frozen)", flush=True)
    t0 = time.perf_counter()
    done = 0
    for it in range(1, args.steps + 1):
        rows = windows(train_ids, rng.choice(starts, args.batch), T)
        params, opt_state, loss = step(params, opt_state, model, jnp.asarray(rows))
        done = it
        out_of_time = time.perf_counter() - t0 > args.max_minutes * 60
        if it % args.eval_every == 0 or it == args.steps or it == 1 or out_of_time:
            tr, _ = evaluate(params, model, jnp.asarray(train_eval))
            he, acc = evaluate(params, model, jnp.asarray(held_eval))
            entry = {"step": it, "seconds": round(time.perf_counter() - t0, 1), "lr": float(schedule(it)),
                     "batch_loss_bits": float(loss) / LN2, "train_bits_per_byte": float(tr) / LN2,
                     "heldout_bits_per_byte": float(he) / LN2, "heldout_top1_draft_accuracy": float(acc)}
            log["evals"].append(entry)
            print(f"step {it:5d}  {entry['seconds']:7.1f}s  lr {entry['lr']:.2e}  batch "
                  f"{entry['batch_loss_bits']:.3f}  train {entry['train_bits_per_byte']:.3f}  held-out "
                  f"{entry['heldout_bits_per_byte']:.3f} bits/byte  top-1 {float(acc):.1%}", flush=True)
        if out_of_time:
            print(f"stopping at step {it}: --max-minutes {args.max_minutes} reached", flush=True)
            break
    log.update(steps_done=done, train_seconds=round(time.perf_counter() - t0, 1), final=log["evals"][-1])
    nnx.update(model.mtp, params)
    log["engine_path_check"] = check_engine_path(model, held_eval[:2, :65])
    return finish_mtp(model, args, log)


def check_engine_path(model: NemotronH, rows: np.ndarray, cuts=(5, 17, 40, 63)) -> str:
    """The engine's first MTP draft after prefilling rows[b, :n] (steps.prefill_step with an MtpCache, then
    steps.mtp_draft_step from the pending token rows[b, n]) must be the argmax of mtp_draft_logits at n - 1:
    the trained function is the served one. Raises if any differs."""
    from metrale_jax.runtime import steps

    logits = np.asarray(jax.jit(mtp_draft_logits)(model, model.mtp, jnp.asarray(rows)))         # [B, L-2, V]
    slot = jnp.zeros((1,), jnp.int32)
    bad = []
    for b in range(rows.shape[0]):
        for n in cuts:
            out = steps.prefill_step(model, model.new_cache(1, rows.shape[1]), slot, jnp.asarray(rows[b:b + 1, :n]),
                                     jnp.array([n]), mtp=model.new_mtp_cache(1, rows.shape[1]))
            draft, _ = steps.mtp_draft_step(model, out.cache, out.mtp, slot, jnp.asarray(rows[b, n:n + 1]),
                                            num_draft=1)
            if int(draft[0, 0]) != int(np.argmax(logits[b, n - 1])):
                bad.append((b, n))
    if bad:
        raise RuntimeError(f"the engine's MTP drafts differ from the trained function's at (row, length) {bad}")
    return f"{rows.shape[0] * len(cuts)}/{rows.shape[0] * len(cuts)} engine drafts == argmax of the trained logits"


def finish_mtp(model: NemotronH, args, log: dict) -> dict:
    """Save the base checkpoint's own main tensors with the trained head (in --save-dtype) to --out, check
    that every main tensor is byte-identical to --base's, and add log as the "mtp" section of --base's log."""
    dtype = jnp.dtype(args.save_dtype)
    before = {n: v for n, v in read_raw_tensors(args.base / "model.safetensors").items()   # a base's own MTP
              if not n.startswith("mtp.")}                                                  # head is replaced
    main = NemotronH.from_pretrained(args.base, dtype=dtype, progress=False).state_dict()
    head = {n: v for n, v in model.state_dict().items() if n.startswith("mtp.")}
    saved = NemotronH(model.config, {**main, **head}, dtype=dtype, tokenizer=ByteTokenizer())
    args.out.mkdir(parents=True, exist_ok=True)
    train_log = json.loads((args.base / "train_log.json").read_text())
    saved.save_pretrained(args.out, overwrite=True)
    after = read_raw_tensors(args.out / "model.safetensors")
    changed = [n for n in before if after.get(n) != before[n]]
    if changed or set(after) - set(before) != set(head):
        raise RuntimeError(f"main tensors changed or missing: {changed[:5]}")
    log["main_tensors_byte_identical"] = f"{len(before)}/{len(before)}"
    train_log["mtp"] = log
    (args.out / "train_log.json").write_text(json.dumps(train_log, indent=1) + "\n")
    print(f"saved to {args.out}: {len(head)} mtp.* tensors ({dtype.name}); {len(before)} main tensors "
          f"byte-identical to {args.base}", flush=True)
    return log


def read_raw_tensors(path: Path) -> dict[str, tuple]:
    """name -> (dtype, shape, raw bytes) of a safetensors file, read from its header (no conversion)."""
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    return {k: (v["dtype"], tuple(v["shape"]), blob[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}


def _rel(path: Path) -> str:
    """A path relative to the repo root when it lies inside it (the log ships in the package)."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _corpus_info(data: Path) -> dict:
    return {p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
            for p in sorted(data.glob("*.txt"))}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=ROOT / "data" / "kjv", help="folder with train.txt, heldout.txt")
    p.add_argument("--out", type=Path, default=ROOT / "metrale_jax" / "assets" / "tiny")
    p.add_argument("--pattern", default="M*-EM-", help="hybrid_override_pattern (M, *, -, E)")
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--chunk-size", type=int, default=64, help="SSD chunk length (below --seq-len: chunked path)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=460)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-rows", type=int, default=16, help="fixed windows for the train / held-out loss")
    p.add_argument("--max-minutes", type=float, default=60.0,
                   help="a safety stop: save after this much training time even if --steps are not done")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--mtp-only", action="store_true", help="train only an MTP head onto --base (frozen)")
    p.add_argument("--base", type=Path, default=ROOT / "metrale_jax" / "assets" / "tiny",
                   help="--mtp-only: the trained model to add the head to")
    p.add_argument("--mtp-pattern", default="*-", help="--mtp-only: the MTP step's blocks (*, -, E)")
    p.add_argument("--finish-from", type=Path, help="skip training: re-save the f32 run saved in this folder")
    return p.parse_args(argv)


if __name__ == "__main__":
    _args = parse_args()
    if _args.mtp_only:
        train_mtp(_args)
    else:
        refinish(_args) if _args.finish_from else train(_args)
