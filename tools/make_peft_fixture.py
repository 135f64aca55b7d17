"""Build a PEFT LoRA adapter on a tiny random HF Nemotron-H and record HF+PEFT's logits for it.

tests/fixtures/peft/<name>/ holds
  base/         config.json + model.safetensors: the base checkpoint (canonical names, as make_hf_fixtures.py writes)
  adapter/      adapter_config.json + adapter_model.safetensors exactly as PEFT's save_pretrained writes them
  expected.safetensors   input_ids [B, T] int32, logits_adapter [B, T, V] f32 (HF + PEFT, no cache),
                         logits_base (the base alone)
  meta.json     versions, seeds, the LoRA config, how far the adapter moves the logits, HF-vs-HF numbers
The adapter targets the Mamba in_proj, attention q/k/v/o_proj and the MLP and shared-expert up/down_proj (PEFT
0.21 refuses the Mamba out_proj and conv1d on Nemotron-H: its mamba kernels read those weights directly), with
use_rslora, a rank_pattern and an alpha_pattern so that every scale rule is exercised. B is zero at PEFT's init,
so A and B are redrawn at random. The logits are those of the adapter as PEFT loads it back from disk onto the
base as HF loads it. tests/model/test_peft_adapter.py loads both in metrale-jax and compares.

Needs torch, transformers and peft (a separate venv; see tools/README.md); runs on the CPU in seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import shutil
import sys
from pathlib import Path

import numpy as np
import peft
import safetensors
import safetensors.torch
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import NemotronHConfig, NemotronHForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_hf_fixtures as hf_fixtures  # noqa: E402  (its sizes, weight draws, checkpoint names, HF runs)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "tests" / "fixtures" / "peft"

NAME = "m_attn_m_mlp_m_moe_lora"
PATTERN = "M*M-ME"
SEED = 707
BATCH, SEQ_LEN = 2, 29
LORA = dict(r=4, lora_alpha=6.0, use_rslora=True, rank_pattern={"o_proj": 2}, alpha_pattern={"up_proj": 3.0},
            target_modules=["in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
# the adapter must move the logits clearly (relative Frobenius norm vs the base), or the test proves little
MIN_EFFECT = 0.05


@torch.no_grad()
def randomize_lora(model, gen: torch.Generator) -> int:
    """Draw every lora_A / lora_B afresh (PEFT initialises B to zero); returns the number of factors drawn."""
    n = 0
    for name, p in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            fan_in = p.shape[1]
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 * fan_in ** -0.5))
            n += 1
    return n


def build(out_root: Path) -> dict:
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    cfg = NemotronHConfig(hybrid_override_pattern=PATTERN, **hf_fixtures.BASE)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    model = NemotronHForCausalLM(cfg).eval()
    hf_fixtures.randomize(model, gen)

    directory = out_root / NAME
    if directory.exists():
        shutil.rmtree(directory)
    (directory / "base").mkdir(parents=True)
    tensors = hf_fixtures.canonical_tensors(model, torch.float32)
    safetensors.torch.save_file(tensors, directory / "base" / "model.safetensors", metadata={"format": "pt"})
    cfg.dtype = torch.float32
    cfg.save_pretrained(directory / "base")

    lora = LoraConfig(**LORA)
    tuned = get_peft_model(model, lora).eval()
    drawn = randomize_lora(tuned, gen)
    tuned.save_pretrained(directory / "adapter")
    (directory / "adapter" / "README.md").unlink(missing_ok=True)    # PEFT's model-card template, not data

    # everything below runs on the files as HF and PEFT load them
    base = hf_fixtures.load_hf(directory / "base", torch.float32)
    loaded = PeftModel.from_pretrained(base, directory / "adapter").eval()
    ids, draws = hf_fixtures.draw_inputs(loaded, _spec(), cfg.vocab_size, gen)   # margins with the adapter on
    with loaded.disable_adapter():
        logits_base = hf_fixtures.hf_forward(loaded, ids)
    probe = hf_fixtures.Probe(loaded)
    logits = hf_fixtures.hf_forward(loaded, ids)
    probe.close()
    why = probe.check(_spec())
    if why is not None:
        raise RuntimeError(f"{NAME}: {why} with the adapter; change the seed")
    in_memory = hf_fixtures.hf_forward(tuned, ids)
    effect = hf_fixtures.rel(logits, logits_base)
    numbers = {"loaded_vs_in_memory_rel": hf_fixtures.rel(logits, in_memory), "adapter_vs_base_rel": effect}
    if not numbers["loaded_vs_in_memory_rel"] < 1e-6:
        raise RuntimeError(f"{NAME}: the adapter PEFT loads back differs from the one it saved: {numbers}")
    if not effect > MIN_EFFECT:
        raise RuntimeError(f"{NAME}: the adapter moves the logits by only {effect:.3g} (relative); redraw larger")

    safetensors.torch.save_file({"input_ids": ids.to(torch.int32).contiguous(), "logits_adapter": logits,
                                 "logits_base": logits_base}, directory / "expected.safetensors",
                                metadata={"format": "pt"})
    meta = {
        "name": NAME, "pattern": PATTERN, "dtype": "float32", "seed": SEED, "batch": BATCH, "seq_len": SEQ_LEN,
        "lora": LORA, "lora_factors_drawn": drawn, "input_draws": draws,
        "versions": {"transformers": transformers.__version__, "peft": peft.__version__,
                     "torch": torch.__version__, "safetensors": safetensors.__version__,
                     "numpy": np.__version__, "python": platform.python_version()},
        "logits_adapter": "PeftModel.from_pretrained(base as HF loads it, adapter/) (input_ids).logits, no cache",
        "logits_base": "the base alone, same input_ids",
        "numbers": numbers,
        "min_expert_routing_margin": hf_fixtures._finite(probe.min_expert_margin),
        "min_dt_seen": probe.min_dt,
    }
    (directory / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _spec() -> hf_fixtures.Spec:
    """The input-draw settings make_hf_fixtures.py uses (float32 margins) for this fixture's shape."""
    return hf_fixtures.Spec(NAME, PATTERN, "float32", SEED, SEQ_LEN, (SEQ_LEN // 2, SEQ_LEN - 1), {}, "", BATCH)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture root (default: tests/fixtures/peft)")
    args = ap.parse_args(argv)
    for pkg in ("mamba_ssm", "causal_conv1d", "kernels"):
        if importlib.util.find_spec(pkg) is not None:
            print(f"error: {pkg} is installed; HF would take its kernels instead of the torch path", file=sys.stderr)
            return 2
    torch.set_grad_enabled(False)
    meta = build(args.out)
    size = sum(f.stat().st_size for f in (args.out / NAME).rglob("*") if f.is_file())
    print(f"{NAME}: {size / 1024:.1f} KiB, adapter moves the logits by {meta['numbers']['adapter_vs_base_rel']:.3f} "
          f"(relative), PEFT reload vs in memory {meta['numbers']['loaded_vs_in_memory_rel']:.2g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
