"""SASS of Mosaic GPU kernels from a compile log: run the kernel once on the GPU with

    MOSAIC_GPU_DUMP_TO=/tmp/d MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_PTXAS=1 python3 ... > log 2>&1

(the log then holds the lowered module with the cubin embedded as `gpu.binary @<kernel> [... bin = "..."]`), and
on any machine (no GPU needed)

    python3 benchmarks/probes/mosaic_sass.py log --out DIR [--control]

writes DIR/<kernel>.cubin per kernel and, where nvdisasm is found ($NVDISASM, PATH, or the `nvidia-cuda-nvdisasm`
wheel: `pip install nvidia-cuda-nvdisasm`), DIR/<kernel>.sass and an opcode count of each loop (a label and the
last branch back to it) of at least --min-loop instructions: what ptxas made of the inner loops. --control adds
DIR/<kernel>.ctl.txt, each instruction with the scoreboards it sets and waits for (how a global-load prefetch
in the w4 GEMV, commit 5b594f4, was defeated by a full scoreboard wait at the loop head).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys

_INSN = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")


def cubins(text: str) -> dict[str, bytes]:
    """kernel name -> cubin bytes, from every `gpu.binary @name [... bin = "<MLIR-escaped bytes>"` in the text
    (the last one per name wins: the log repeats the module after each pass)."""
    out = {}
    for m in re.finditer(r'gpu\.binary @([\w$.]+)', text):
        j = text.find('bin = "', m.end())
        if j < 0:
            continue
        k, buf = j + len('bin = "'), bytearray()
        while text[k] != '"':
            if text[k] == "\\":
                if text[k + 1] in '\\"':
                    buf.append(ord(text[k + 1]))
                    k += 2
                else:
                    buf.append(int(text[k + 1:k + 3], 16))
                    k += 3
            else:
                buf.append(ord(text[k]))
                k += 1
        if buf[:4] == b"\x7fELF":
            out[m.group(1)] = bytes(buf)
    return out


def find_nvdisasm() -> str | None:
    cands = [os.environ.get("NVDISASM"), shutil.which("nvdisasm")]
    for p in sys.path:
        cands += glob.glob(os.path.join(p, "nvidia", "*", "bin", "nvdisasm"))
    return next((c for c in cands if c and os.path.isfile(c)), None)


def loops(sass: str, min_len: int) -> list[tuple[str, int, collections.Counter]]:
    """(label, instructions, opcode counts) of each label ... last `BRA label` span with >= min_len instructions."""
    lines = sass.splitlines()
    labels = {l[:-1]: i for i, l in enumerate(lines) if re.match(r"^\.L\w+:$", l)}
    found = []
    for name, start in labels.items():
        ends = [i for i, l in enumerate(lines) if i > start and f"BRA `({name})" in l]
        if not ends:
            continue
        ops = collections.Counter(m.group(1) for l in lines[start:ends[-1] + 1] if (m := _INSN.match(l)))
        if sum(ops.values()) >= min_len:
            found.append((name, sum(ops.values()), ops))
    return found


_HEX = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* 0x([0-9a-f]{16}) \*/\s*$")
_HEX_HI = re.compile(r"^\s*/\* 0x([0-9a-f]{16}) \*/\s*$")


def control(hex_sass: str) -> list[dict]:
    """Per instruction of `nvdisasm -hex` output, the scheduling control bits of its 128-bit encoding (bits 41..62
    of the second word): stall cycles, yield, the scoreboard it sets when it writes (wb) or reads (rb) late, and the
    scoreboards it waits for (wait: a set; 7 = none for wb/rb). Shows where a variable-latency load is waited on."""
    lines, out = hex_sass.splitlines(), []
    for i, line in enumerate(lines[:-1]):
        m, hi = _HEX.search(line), _HEX_HI.match(lines[i + 1])
        if m and hi:
            c = int(hi.group(1), 16) >> 41
            out.append({"addr": int(m.group(1), 16), "insn": m.group(2), "stall": c & 0xF, "yield": (c >> 4) & 1,
                        "wb": (c >> 5) & 7, "rb": (c >> 8) & 7,
                        "wait": {b for b in range(6) if (c >> 11) >> b & 1}})
    return out


def control_listing(rows: list[dict]) -> str:
    sb = lambda v: "-" if v == 7 else str(v)
    return "\n".join(f"{r['addr']:05x}  {r['insn'][:70]:70s} wb {sb(r['wb'])} rb {sb(r['rb'])} "
                     f"wait {','.join(map(str, sorted(r['wait']))) or '-'} stall {r['stall']}" for r in rows) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--out", required=True)
    ap.add_argument("--min-loop", type=int, default=50)
    ap.add_argument("--control", action="store_true",
                    help="also DIR/<kernel>.ctl.txt: every instruction with its scoreboards and stall count")
    args = ap.parse_args()
    with open(args.log, encoding="latin-1") as f:
        bins = cubins(f.read())
    if not bins:
        raise SystemExit(f"no gpu.binary with an ELF payload in {args.log} (was MOSAIC_GPU_DUMP_* set?)")
    os.makedirs(args.out, exist_ok=True)
    nvdisasm = find_nvdisasm()
    for name, data in bins.items():
        path = os.path.join(args.out, name)
        with open(path + ".cubin", "wb") as f:
            f.write(data)
        print(f"{name}: {len(data)} bytes -> {path}.cubin")
        if nvdisasm is None:
            print("  nvdisasm not found ($NVDISASM, PATH or `pip install nvidia-cuda-nvdisasm`): no SASS")
            continue
        sass = subprocess.run([nvdisasm, "-c", path + ".cubin"], check=True, capture_output=True, text=True).stdout
        with open(path + ".sass", "w") as f:
            f.write(sass)
        if args.control:
            hexed = subprocess.run([nvdisasm, "-c", "-hex", path + ".cubin"], check=True, capture_output=True,
                                   text=True).stdout
            with open(path + ".ctl.txt", "w") as f:
                f.write(control_listing(control(hexed)))
        for label, n, ops in sorted(loops(sass, args.min_loop), key=lambda r: r[1]):     # innermost first
            print(f"  loop {label}: {n} instructions  " + " ".join(f"{k} {v}" for k, v in ops.most_common()))


if __name__ == "__main__":
    main()
