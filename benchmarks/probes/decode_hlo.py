"""The kernels of one compiled decode step: the optimized HLO's fusions and custom calls per computation, so that a
reader sees what XLA runs between the Pallas kernels (on the GPU; on the CPU the interpret-mode kernels differ).

    PYTHONPATH=. python benchmarks/probes/decode_hlo.py [--weights fp8-block] [--batch 1] [--tiny] [--out DIR]
writes DIR/decode_hlo_<weights>_B<batch>.txt (the HLO) and prints the counts of the entry computation's kernels.
"""

from __future__ import annotations

import argparse
import collections
import os
import re

import jax.numpy as jnp
import numpy as np

from benchmarks.bench_runtime import CONFIG_8B, TINY, random_model
from metrale_jax.config import ModelConfig
from metrale_jax.runtime import Engine, steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", default="fp8-block")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="/tmp")
    args = ap.parse_args()
    config = ModelConfig.from_hf(TINY if args.tiny else CONFIG_8B)
    model = random_model(config, jnp.bfloat16, weights=args.weights)
    eng = Engine(model, max_slots=max(args.batch, 1), max_len=64, batch_buckets=(args.batch,), token_buckets=(16,),
                 eos_ids=[])
    slots = eng._dev(np.arange(args.batch))
    eng.call("decode", steps.decode_pending_step, eng.cache, eng.sampling.pending, slots, decode=True)
    (exe,) = eng.decode_exe.compiled("decode")
    hlo = exe.as_text()
    path = os.path.join(args.out, f"decode_hlo_{args.weights}_B{args.batch}.txt")
    with open(path, "w") as fh:
        fh.write(hlo)
    entry = hlo[hlo.index("ENTRY"):]
    entry = entry[:entry.index("\n}\n")]
    kinds = collections.Counter()
    for line in entry.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+) = .*? (fusion|custom-call|copy|dynamic-update-slice|slice|gather|"
                     r"scatter|while|conditional|sort)\(", line)
        if m:
            target = re.search(r'custom_call_target="([^"]+)"', line)
            name = target.group(1) if target else m.group(1)
            kinds[(m.group(2), re.sub(r"(\.[0-9]+)+$|_[0-9]+$", "", name))] += 1
    total = sum(kinds.values())
    print(f"{total} kernel-launching ops in the entry computation; wrote {path}")
    for (op, name), n in kinds.most_common(60):
        print(f"{n:5d}  {op:12s} {name}")


if __name__ == "__main__":
    main()
