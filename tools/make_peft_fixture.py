"""Build PEFT LoRA adapters on tiny random HF Nemotron-Hs and record HF+PEFT's logits for them.

tests/fixtures/peft/<name>/ holds
  base/         config.json + model.safetensors: the base checkpoint (canonical names, as make_hf_fixtures.py writes)
  adapter/      adapter_config.json + adapter_model.safetensors exactly as PEFT's save_pretrained writes them
  expected.safetensors   input_ids [B, T] int32, logits_adapter [B, T, V] f32 (HF + PEFT, no cache),
                         logits_base (the base alone)
  meta.json     versions, seeds, the LoRA config, how far the adapter moves the logits, HF-vs-HF numbers
Two fixtures (FIXTURES):
  m_attn_m_mlp_m_moe_lora  the Mamba in_proj, attention q/k/v/o_proj and the MLP and shared-expert up/down_proj
      (PEFT 0.21 refuses the Mamba out_proj and conv1d on Nemotron-H: its mamba kernels read those weights
      directly), with use_rslora, a rank_pattern and an alpha_pattern so that every scale rule is exercised;
      tests/model/test_peft_adapter.py.
  m_moe_head_lora  the routed experts through target_parameters (PEFT's ParamWrapper on NemotronHExperts' 3-D
      up_proj / down_proj, both nested on one module), the shared experts and MLP up/down_proj and lm_head (PEFT
      then also saves lm_head.base_layer.weight, which the loader checks against the base) on a pattern with two
      MoE layers; tests/test_lora_experts.py.
B is zero at PEFT's init, so A and B are redrawn at random. The logits are those of the adapter as PEFT loads it
back from disk onto the base as HF loads it.

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

FIXTURES = {
    "m_attn_m_mlp_m_moe_lora": dict(
        pattern="M*M-ME", seed=707,
        lora=dict(r=4, lora_alpha=6.0, use_rslora=True, rank_pattern={"o_proj": 2}, alpha_pattern={"up_proj": 3.0},
                  target_modules=["in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"])),
    "m_moe_head_lora": dict(
        pattern="ME*-E", seed=708,
        lora=dict(r=3, lora_alpha=5.0, target_modules=["lm_head", "up_proj", "down_proj"],
                  target_parameters=["experts.up_proj", "experts.down_proj"])),
}
BATCH, SEQ_LEN = 2, 29
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


def build(out_root: Path, name: str) -> dict:
    fix = FIXTURES[name]
    pattern, seed, lora_kw = fix["pattern"], fix["seed"], fix["lora"]
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    cfg = NemotronHConfig(hybrid_override_pattern=pattern, **hf_fixtures.BASE)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    model = NemotronHForCausalLM(cfg).eval()
    hf_fixtures.randomize(model, gen)

    directory = out_root / name
    if directory.exists():
        shutil.rmtree(directory)
    (directory / "base").mkdir(parents=True)
    tensors = hf_fixtures.canonical_tensors(model, torch.float32)
    safetensors.torch.save_file(tensors, directory / "base" / "model.safetensors", metadata={"format": "pt"})
    cfg.dtype = torch.float32
    cfg.save_pretrained(directory / "base")

    lora = LoraConfig(**lora_kw)
    tuned = get_peft_model(model, lora).eval()
    drawn = randomize_lora(tuned, gen)
    tuned.save_pretrained(directory / "adapter")
    (directory / "adapter" / "README.md").unlink(missing_ok=True)    # PEFT's model-card template, not data

    # everything below runs on the files as HF and PEFT load them
    base = hf_fixtures.load_hf(directory / "base", torch.float32)
    loaded = PeftModel.from_pretrained(base, directory / "adapter").eval()
    spec = _spec(name, pattern, seed)
    ids, draws = hf_fixtures.draw_inputs(loaded, spec, cfg.vocab_size, gen)   # margins with the adapter on
    with loaded.disable_adapter():
        logits_base = hf_fixtures.hf_forward(loaded, ids)
    probe = hf_fixtures.Probe(loaded)
    logits = hf_fixtures.hf_forward(loaded, ids)
    probe.close()
    why = probe.check(spec)
    if why is not None:
        raise RuntimeError(f"{name}: {why} with the adapter; change the seed")
    in_memory = hf_fixtures.hf_forward(tuned, ids)
    effect = hf_fixtures.rel(logits, logits_base)
    numbers = {"loaded_vs_in_memory_rel": hf_fixtures.rel(logits, in_memory), "adapter_vs_base_rel": effect}
    if not numbers["loaded_vs_in_memory_rel"] < 1e-6:
        raise RuntimeError(f"{name}: the adapter PEFT loads back differs from the one it saved: {numbers}")
    if not effect > MIN_EFFECT:
        raise RuntimeError(f"{name}: the adapter moves the logits by only {effect:.3g} (relative); redraw larger")

    safetensors.torch.save_file({"input_ids": ids.to(torch.int32).contiguous(), "logits_adapter": logits,
                                 "logits_base": logits_base}, directory / "expected.safetensors",
                                metadata={"format": "pt"})
    meta = {
        "name": name, "pattern": pattern, "dtype": "float32", "seed": seed, "batch": BATCH, "seq_len": SEQ_LEN,
        "lora": lora_kw, "lora_factors_drawn": drawn, "input_draws": draws, "moe_layers": pattern.count("E"),
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


def _spec(name: str, pattern: str, seed: int) -> hf_fixtures.Spec:
    """The input-draw settings make_hf_fixtures.py uses (float32 margins) for this fixture's shape."""
    return hf_fixtures.Spec(name, pattern, "float32", seed, SEQ_LEN, (SEQ_LEN // 2, SEQ_LEN - 1), {}, "", BATCH)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture root (default: tests/fixtures/peft)")
    ap.add_argument("--only", action="append", choices=sorted(FIXTURES), help="build only this fixture")
    args = ap.parse_args(argv)
    for pkg in ("mamba_ssm", "causal_conv1d", "kernels"):
        if importlib.util.find_spec(pkg) is not None:
            print(f"error: {pkg} is installed; HF would take its kernels instead of the torch path", file=sys.stderr)
            return 2
    torch.set_grad_enabled(False)
    for name in args.only or FIXTURES:
        meta = build(args.out, name)
        size = sum(f.stat().st_size for f in (args.out / name).rglob("*") if f.is_file())
        print(f"{name}: {size / 1024:.1f} KiB, adapter moves the logits by "
              f"{meta['numbers']['adapter_vs_base_rel']:.3f} (relative), PEFT reload vs in memory "
              f"{meta['numbers']['loaded_vs_in_memory_rel']:.2g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
