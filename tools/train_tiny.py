"""Train the built-in default model: a tiny byte-level Nemotron-H with every block kind (M, *, -, E)
on the King James Bible text in data/kjv/, with jax.grad + optax through the model's reference path
(the same logits NemotronH.forward returns). Runs on the CPU; fixed seed, so a rerun on the same
machine and versions retraces the same curve.

Writes config.json, model.safetensors and byte_tokenizer.json (model.save_pretrained) and
train_log.json (arguments, the train / held-out loss at every eval step in bits per byte, the unigram
baseline, the time taken, a greedy sample) to --out (default metrale_jax/assets/tiny/).

    python tools/train_tiny.py                       # the shipped model (~20 min on 2 cores)
    python tools/train_tiny.py --steps 20 --out /tmp/tiny --eval-every 10     # a smoke run
"""

from __future__ import annotations

import argparse
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

from metrale_jax.config import ModelConfig, ModelLevers
from metrale_jax.model import NemotronH, forward_step, random_tensors
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
    return NemotronH(config, tensors, dtype=jnp.float32, levers=ModelLevers(kernels="reference"),
                     tokenizer=ByteTokenizer())


def mean_nll(model: NemotronH, rows: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats) over rows [B, T+1], through the reference forward path."""
    logits = forward_step(model, rows[:, :-1])                            # [B, T, V] f32
    return optax.softmax_cross_entropy_with_integer_labels(logits, rows[:, 1:]).mean()


# ---- training ------------------------------------------------------------------------------------
def train(args) -> dict:
    train_ids = load_split(args.data / "train.txt")
    held_ids = load_split(args.data / "heldout.txt")
    T = args.seq_len
    starts = line_starts(train_ids, T)
    train_eval = eval_windows(train_ids, args.eval_rows, T)
    held_eval = eval_windows(held_ids, args.eval_rows, T)
    unigram = unigram_bits_per_byte(train_ids, held_eval[:, 1:].ravel())

    config = tiny_config(args.hidden, args.pattern, args.chunk_size)
    model = init_model(config, args.seed)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    n_params = sum(int(x.size) for x in jax.tree.leaves(params))
    # the loss below must see exactly what NemotronH.forward returns
    probe = held_eval[:2, :-1]
    np.testing.assert_array_equal(np.asarray(model.forward(probe)), np.asarray(jax.jit(forward_step)(model, probe)))

    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, max(args.steps, args.warmup + 1),
                                                  end_value=args.lr * 0.05)
    decay_mask = jax.tree.map(lambda x: x.ndim >= 2, params)
    opt = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(schedule, b1=0.9, b2=0.98, weight_decay=args.weight_decay, mask=decay_mask))
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
    files = saved.save_pretrained(args.out)
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
    p.add_argument("--finish-from", type=Path, help="skip training: re-save the f32 run saved in this folder")
    return p.parse_args(argv)


if __name__ == "__main__":
    _args = parse_args()
    refinish(_args) if _args.finish_from else train(_args)
