"""Gradients through the model's kernels against the reference path, as a JSON log (issue 36's H200 acceptance).

For a model (default: the built-in one) in float32, the gradient of a next-token cross-entropy on KJV windows
w.r.t. every nnx.Param is taken twice, with --kernels (default 'auto': on a GPU every kernel's Pallas arm, whose
backward pass is its reference's VJP) and with the jnp references, and compared per parameter (relative Frobenius
norm) and per block kind. Also a LoRA adapter's gradients (the trainable state of a fine-tune) on the same model.
The log names the implementation each kernel resolved to, the device and the versions.

    python tools/grad_check.py --out benchmarks/results/grad_check.json                 # on the H200
    METRALE_KERNELS= python tools/grad_check.py --kernels interpret --rows 2 --seq-len 64  # a CPU smoke run

Exit status 1 when a gradient differs by more than --tol (default 1e-5).
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from metrale_jax.config import ModelLevers  # noqa: E402
from metrale_jax.layers.lora import LoraParam  # noqa: E402
from metrale_jax.model import NemotronH, forward_step  # noqa: E402
from pallas_kernels import registry  # noqa: E402


def rows_of(path: Path, n: int, length: int, seed: int) -> np.ndarray:
    """n windows of length + 1 byte ids (BOS first) at random line starts of a KJV file."""
    ids = np.frombuffer(path.read_bytes(), np.uint8).astype(np.int32) + 3
    starts = np.random.default_rng(seed).integers(0, len(ids) - length - 1, n)
    return np.stack([np.concatenate([[1], ids[s:s + length]]) for s in starts]).astype(np.int32)


def gradients(directory, kernels: str, rows: np.ndarray, what, lora: bool) -> dict[str, np.ndarray]:
    """d loss / d params (`what`: nnx.Param or LoraParam) by parameter path, with `kernels`."""
    model = NemotronH.from_pretrained(directory, dtype=jnp.float32, levers=ModelLevers(kernels=kernels),
                                      progress=False)
    table = None
    if lora:
        model.add_adapter("check", r=8, lora_alpha=16, key=jax.random.key(0),
                          target_modules=["in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj",
                                          "down_proj"])
        for _, v in nnx.iter_graph(model):                     # B away from zero, so every factor gets gradients
            if isinstance(v, LoraParam) and v[...].ndim == 3 and v[...].shape[1] > v[...].shape[2]:
                v[...] = jax.random.normal(jax.random.key(v[...].shape[1]), v[...].shape) * 0.05
        table = jnp.ones((rows.shape[0],), jnp.int32)
    graph, params, rest = nnx.split(model, what, ...)

    def loss(p):
        logits = forward_step(nnx.merge(graph, p, rest), rows[:, :-1], table)
        return optax.softmax_cross_entropy_with_integer_labels(logits, rows[:, 1:]).mean()

    grads = jax.jit(jax.grad(loss))(params)
    return {jax.tree_util.keystr(p): np.asarray(v, np.float64) for p, v in jax.tree_util.tree_leaves_with_path(grads)}


def compare(got: dict, want: dict, pattern: str) -> dict:
    """Per parameter and per block kind: relative Frobenius norm of the difference."""
    per, kinds = {}, collections.defaultdict(float)
    for name, w in want.items():
        g = got[name]
        err = float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-30)) if np.any(w) else float(np.abs(g).max())
        per[name] = err
        layer = name.split("['layers'][")[1].split("]")[0] if "['layers'][" in name else None
        kind = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}[pattern[int(layer)]] if layer else "other"
        kinds[kind] = max(kinds[kind], err)
    return {"max_rel": max(per.values()), "per_block_kind": dict(kinds), "per_param": per}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "metrale_jax" / "assets" / "tiny")
    ap.add_argument("--kernels", default="auto", help="the kernels to check against the references")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precision", default="highest", help="jax_default_matmul_precision of both paths: 'highest' "
                    "keeps float32 matmuls float32 on the GPU (the default there rounds through TF32, ~5e-4)")
    ap.add_argument("--out", type=Path, help="write the JSON log here")
    args = ap.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", args.precision)
    rows = rows_of(ROOT / "data" / "kjv" / "heldout.txt", args.rows, args.seq_len, args.seed)
    pattern = json.loads((args.model / "config.json").read_text()).get("hybrid_override_pattern", "")
    log = {"model": str(args.model), "kernels": args.kernels, "rows": args.rows, "seq_len": args.seq_len,
           "tol": args.tol, "precision": args.precision, "device": str(jax.devices()[0]),
           "device_kind": jax.devices()[0].device_kind,
           "backend": jax.default_backend(),
           "resolved": registry.report(args.kernels),
           "versions": {"jax": jax.__version__, "python": platform.python_version()}}
    for label, what, lora in (("params", nnx.Param, False), ("lora", LoraParam, True)):
        want = gradients(args.model, "reference", rows, what, lora)
        got = gradients(args.model, args.kernels, rows, what, lora)
        log[label] = compare(got, want, pattern)
        print(f"{label}: max relative difference {log[label]['max_rel']:.3g} over {len(want)} tensors; per block "
              f"kind {json.dumps({k: float(f'{v:.3g}') for k, v in log[label]['per_block_kind'].items()})}")
    ok = all(log[k]["max_rel"] <= args.tol for k in ("params", "lora"))
    log["pass"] = ok
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(log, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
