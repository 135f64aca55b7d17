"""Build tiny random Nemotron-H checkpoints with HF transformers and record HF's logits for them.

Each fixture directory under tests/fixtures/hf/ holds config.json (as HF writes it),
model.safetensors (canonical checkpoint names: backbone.*, experts unstacked), expected.safetensors
(input_ids, logits_forward, logits_decode) and meta.json (versions, seeds, HF-vs-HF numbers).
HF's chunked forward is checked against its own token-by-token decode before anything is written.
Needs torch + transformers (a separate venv; see tools/README.md). Runs on the CPU in under a minute;
`--check` rebuilds into a temporary directory and compares with the committed fixtures instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import safetensors
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers
from transformers import NemotronHConfig, NemotronHForCausalLM
from transformers.cache_utils import DynamicCache
from transformers.models.nemotron_h import modeling_nemotron_h as hf_nh

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "tests" / "fixtures" / "hf"

# HF-vs-HF agreement required before a fixture is written (relative Frobenius norm).
SELF_TOL = {"float32": 1e-4, "bfloat16": 5e-2}
# Smallest gap allowed between the last chosen and the first unchosen router score (and group score),
# so that rounding differences between HF and another implementation cannot flip a routing choice.
ROUTE_MARGIN = {"float32": 1e-4, "bfloat16": 2e-3}

# Sizes shared by every fixture unless a spec overrides them.
BASE = dict(
    hidden_size=32, vocab_size=128,
    mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=16, n_groups=1, conv_kernel=4, chunk_size=16,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=48,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=24, n_shared_experts=1, routed_scaling_factor=1.0,
    n_group=1, topk_group=1, norm_topk_prob=True,
    layer_norm_epsilon=1e-5, use_mamba_kernels=False, tie_word_embeddings=False,
)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One fixture: its config overrides, dtype, seed and sequence shape."""

    name: str
    pattern: str
    dtype: str
    seed: int
    seq_len: int
    prefill_lens: tuple[int, int]  # a suggested mixed-length prefill split for the decode check
    overrides: dict
    note: str
    batch: int = 2


SPECS = [
    Spec("m_attn_m_mlp_m_moe", "M*M-ME", "float32", 101, 45, (21, 28), {},
         "all four block kinds; T=45 over chunk_size=16 (2 full chunks + 13)"),
    Spec("mamba_groups_moe", "MEM*", "float32", 202, 77, (33, 40),
         dict(mamba_num_heads=8, mamba_head_dim=4, n_groups=4, ssm_state_size=8, chunk_size=32),
         "Mamba n_groups=4 (8 heads, 2 per group), chunk_size=32, T=77"),
    Spec("moe_group_limited", "*EME", "float32", 303, 52, (19, 24),
         dict(n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2,
              routed_scaling_factor=2.5),
         "group-limited routing: 16 experts in 4 groups, top-2 groups, top-3 experts, scaling 2.5"),
    Spec("moe_latent", "EM-E", "float32", 404, 61, (17, 30),
         dict(moe_latent_size=16, norm_topk_prob=False, n_routed_experts=6, num_experts_per_tok=2,
              conv_kernel=3),
         "moe_latent_size=16 (fc1/fc2_latent_proj), norm_topk_prob=False, conv_kernel=3"),
    Spec("bf16_moe_m_attn_m_mlp_m", "EM*M-M", "bfloat16", 505, 50, (18, 23), {},
         "bf16 weights and compute; MoE first so its router sees nearly the same inputs everywhere"),
]


# ---- random weights ---------------------------------------------------------------------
def _inv_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


@torch.no_grad()
def randomize(model: NemotronHForCausalLM, gen: torch.Generator) -> None:
    """Draw every weight afresh: O(1) activations and logits, and non-default A_log/D/dt_bias/norms/biases."""
    cfg = model.config

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=gen) * std + mean

    def uniform(shape, lo, hi):
        return torch.rand(shape, generator=gen) * (hi - lo) + lo

    for name, p in model.named_parameters():
        shape = p.shape
        leaf = name.split(".")[-1]
        fan_in = shape[-1]
        if name.endswith("embeddings.weight"):
            value = normal(shape, 1.0)
        elif name.endswith("norm.weight") or name.endswith("norm_f.weight"):
            value = normal(shape, 0.25, 1.0)
        elif leaf == "A_log":  # A = -exp(A_log) in [-4, -0.05]: slow and fast heads
            value = uniform(shape, math.log(0.05), math.log(4.0))
        elif leaf == "D":
            value = normal(shape, 0.5, 1.0)
        elif leaf == "dt_bias":  # softplus(dt_bias) log-uniform in [0.02, 0.3]
            value = _inv_softplus(torch.exp(uniform(shape, math.log(0.02), math.log(0.3))))
        elif name.endswith("conv1d.weight"):
            value = normal(shape, 0.5)
        elif name.endswith("conv1d.bias"):
            value = normal(shape, 0.2)
        elif name.endswith("in_proj.weight"):
            value = normal(shape, fan_in ** -0.5)
            value[-cfg.mamba_num_heads:] *= 0.4  # dt rows: keep softplus(dt + dt_bias) well above time_step_min
        elif name.endswith("gate.weight"):
            value = normal(shape, 2.0 * fan_in ** -0.5)
        elif name.endswith("experts.up_proj") or name.endswith("experts.down_proj"):
            value = normal(shape, fan_in ** -0.5)
        elif name.endswith("lm_head.weight"):
            value = normal(shape, 2.0 * fan_in ** -0.5)
        elif name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
            value = normal(shape, 0.7 * fan_in ** -0.5)
        elif name.endswith(".weight") and p.ndim == 2:  # q/k/v, up_proj, latent projections
            value = normal(shape, fan_in ** -0.5)
        else:
            raise RuntimeError(f"randomize: no rule for parameter {name} {tuple(shape)}")
        p.copy_(value)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(uniform(b.shape, -0.15, 0.15))


# ---- canonical checkpoint names ------------------------------------------------------------
def canonical_tensors(model: NemotronHForCausalLM, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF in-memory state dict -> checkpoint names (backbone.*, one tensor per expert), cast to dtype.

    e_score_correction_bias stays float32, as in NVIDIA's BF16 checkpoints (HF keeps it in f32 too).
    """
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().clone()
        if name.startswith("model."):
            name = "backbone." + name[len("model."):]
        if name.endswith("mixer.experts.up_proj") or name.endswith("mixer.experts.down_proj"):
            stem, kind = name.rsplit(".", 1)
            for e in range(t.shape[0]):
                out[f"{stem}.{e}.{kind}.weight"] = t[e].contiguous().to(dtype)
            continue
        out[name] = t.to(torch.float32 if name.endswith("e_score_correction_bias") else dtype)
    return out


def load_hf(directory: Path, dtype: torch.dtype) -> NemotronHForCausalLM:
    """Load a fixture directory through HF's own loader; every canonical tensor must land somewhere."""
    model, info = NemotronHForCausalLM.from_pretrained(
        directory, dtype=dtype, attn_implementation="eager", experts_implementation="eager",
        output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise RuntimeError(f"{directory}: HF did not load the canonical names cleanly: {bad}")
    return model.eval()


# ---- checks while HF runs --------------------------------------------------------------------
class Probe:
    """Forward hooks that record the smallest dt (before HF's floor) and the smallest routing margin."""

    def __init__(self, model: NemotronHForCausalLM):
        self.time_step_min = model.config.time_step_min
        self.min_dt = math.inf
        self.min_expert_margin = math.inf
        self.min_group_margin = math.inf
        self.routing: dict[int, dict] = {}
        self.choices: list[torch.Tensor] = []
        self.handles = []
        for module in model.modules():
            if isinstance(module, hf_nh.NemotronHMamba2Mixer):
                self.handles.append(module.register_forward_hook(self._mamba))
            elif isinstance(module, hf_nh.NemotronHTopkRouter):
                self.handles.append(module.register_forward_hook(self._router))

    @torch.no_grad()
    def _mamba(self, mixer, args, output):
        x = args[0]
        dt = mixer.in_proj(x)[..., -mixer.num_heads:]
        dt = F.softplus(dt + mixer.dt_bias.to(dt.dtype))  # the dtype HF uses on both of its paths
        self.min_dt = min(self.min_dt, float(dt.float().min()))

    @torch.no_grad()
    def _router(self, router, args, output):
        h = args[0].reshape(-1, router.hidden_dim).float()
        scores = torch.sigmoid(h @ router.weight.float().T)  # [N, E]
        choice = scores + router.e_score_correction_bias.float()
        n, g, k = router.num_experts, router.num_group, router.top_k
        allowed = torch.ones_like(choice, dtype=torch.bool)
        if router.topk_group < g:
            group_scores = choice.view(-1, g, n // g).topk(2, dim=-1)[0].sum(-1)  # [N, G]
            top = group_scores.sort(dim=-1, descending=True)[0]
            gap = top[:, router.topk_group - 1] - top[:, router.topk_group]
            self.min_group_margin = min(self.min_group_margin, float(gap.min()))
            gidx = group_scores.topk(router.topk_group, dim=-1)[1]
            gmask = torch.zeros(choice.shape[0], g, dtype=torch.bool).scatter_(1, gidx, True)
            allowed = gmask[:, :, None].expand(-1, g, n // g).reshape(-1, n)
        ranked = choice.masked_fill(~allowed, -math.inf).sort(dim=-1, descending=True)[0]
        if k < int(allowed.sum(-1).min()):
            gap = ranked[:, k - 1] - ranked[:, k]
            self.min_expert_margin = min(self.min_expert_margin, float(gap.min()))
        chosen = output[2]  # HF's top-k expert indices [N, k]
        self.choices.append(chosen.sort(-1)[0])
        if not torch.equal(choice.gather(1, chosen).min(-1)[0], ranked[:, k - 1]):
            raise RuntimeError("router probe disagrees with HF's expert choice")
        # How much the fixture exercises: experts used, choices the bias or the group limit changed.
        chosen_set = torch.zeros_like(allowed).scatter_(1, chosen, True)
        plain = torch.zeros_like(allowed).scatter_(1, scores.masked_fill(~allowed, -math.inf).topk(k)[1], True)
        ungrouped = torch.zeros_like(allowed).scatter_(1, choice.topk(k)[1], True)
        stats = self.routing.setdefault(id(router), {"tokens": 0, "experts_used": set(),
                                                     "bias_changed_choice": 0, "group_limit_changed_choice": 0})
        stats["tokens"] += chosen.shape[0]
        stats["experts_used"] |= set(chosen.flatten().tolist())
        stats["bias_changed_choice"] += int((chosen_set != plain).any(-1).sum())
        stats["group_limit_changed_choice"] += int((chosen_set != ungrouped).any(-1).sum())

    def routing_summary(self) -> list[dict]:
        return [{**v, "experts_used": len(v["experts_used"])} for v in self.routing.values()]

    def check(self, spec: Spec) -> str | None:
        """Why these inputs make a fragile fixture (dt near HF's floor, a near-tie in routing), or None."""
        floor = self.time_step_min
        if not self.min_dt > 2 * floor:
            return f"dt reached {self.min_dt:.3g}, near HF's floor time_step_min={floor}"
        margin = min(self.min_expert_margin, self.min_group_margin)
        if margin < ROUTE_MARGIN[spec.dtype]:
            return f"a routing choice is within {margin:.3g} of flipping"
        return None

    def close(self):
        for h in self.handles:
            h.remove()


def draw_inputs(model, spec: Spec, vocab: int, gen: torch.Generator, tries: int = 200):
    """Random token ids whose forward keeps dt off HF's floor and every routing choice clear of a tie."""
    for draw in range(1, tries + 1):
        ids = torch.randint(0, vocab, (spec.batch, spec.seq_len), generator=gen)
        probe = Probe(model)
        hf_forward(model, ids)
        probe.close()
        why = probe.check(spec)
        if why is None:
            return ids, draw
    raise RuntimeError(f"{spec.name}: no input draw out of {tries} passed ({why}); change the seed or sizes")


# ---- HF runs -----------------------------------------------------------------------------
@torch.no_grad()
def hf_forward(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids, use_cache=False).logits.float()


@torch.no_grad()
def hf_token_decode(model, ids: torch.Tensor, prefill: int = 0) -> torch.Tensor:
    """Logits at every position through HF's cache: `prefill` tokens in one call, then one token a call."""
    cache = DynamicCache(config=model.config)
    # position_ids are passed because HF derives them from an attention layer's cache, and a pattern
    # without '*' has none (ValueError in get_seq_length); Nemotron-H has no positional rotation.
    # Without attention layers HF's mask builder fails the same way; no padding means no masks are needed,
    # so such patterns get the per-kind mask dict (None = no mask) that generate() would otherwise build.
    masks = None if "*" in model.config.hybrid_override_pattern else {"full_attention": None,
                                                                      "linear_attention": None}
    steps = ([(0, prefill)] if prefill else []) + [(t, t + 1) for t in range(prefill, ids.shape[1])]
    out = []
    for a, b in steps:
        pos = torch.arange(a, b)[None]
        out.append(model(ids[:, a:b], position_ids=pos, attention_mask=masks, past_key_values=cache,
                         use_cache=True).logits.float())
    return torch.cat(out, dim=1)


def _finite(x: float) -> float | None:
    return None if math.isinf(x) else x


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref||_F / ||ref||_F (the metric the tests use)."""
    return float((a.double() - ref.double()).norm() / ref.double().norm())


def max_rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref|."""
    return float((a.double() - ref.double()).abs().max() / ref.double().abs().max())


# ---- one fixture ---------------------------------------------------------------------------
def build(spec: Spec, out_root: Path) -> dict:
    torch.manual_seed(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed)
    kwargs = {**BASE, **spec.overrides}
    cfg = NemotronHConfig(hybrid_override_pattern=spec.pattern, **kwargs)
    assert cfg.hybrid_override_pattern == spec.pattern
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    model = NemotronHForCausalLM(cfg).eval()
    randomize(model, gen)

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec.dtype]
    directory = out_root / spec.name
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    tensors = canonical_tensors(model, dtype)
    safetensors.torch.save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    cfg.dtype = dtype
    cfg.save_pretrained(directory)  # config.json as HF writes it

    # Everything below runs on the checkpoint as HF loads it from disk.
    hf = load_hf(directory, dtype)
    loaded = canonical_tensors(hf, dtype)
    assert loaded.keys() == tensors.keys()
    for k, v in tensors.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v), f"{k} changed through HF's loader"

    ids, draws = draw_inputs(hf, spec, kwargs["vocab_size"], gen)
    probe = Probe(hf)
    logits_fwd = hf_forward(hf, ids)
    probe.close()
    probe_dec = Probe(hf)
    logits_dec = hf_token_decode(hf, ids)
    split = min(spec.prefill_lens)
    logits_split = hf_token_decode(hf, ids, prefill=split)
    probe_dec.close()
    why = probe_dec.check(spec)  # the decode paths must keep the margins the forward had
    if why is not None:
        raise RuntimeError(f"{spec.name}: {why} in HF's decode runs")

    numbers = {
        "forward_vs_token_decode_rel": rel(logits_dec, logits_fwd),
        "forward_vs_token_decode_max_rel": max_rel(logits_dec, logits_fwd),
        f"forward_vs_prefill{split}_then_decode_rel": rel(logits_split, logits_fwd),
        "token_decode_vs_prefill_then_decode_rel": rel(logits_split, logits_dec),
    }
    worst = max(numbers["forward_vs_token_decode_rel"], numbers[f"forward_vs_prefill{split}_then_decode_rel"])
    if not worst < SELF_TOL[spec.dtype]:
        raise RuntimeError(f"{spec.name}: HF's chunked forward and its own decode disagree ({numbers}); "
                           f"refusing to write a fixture")

    expected = {"input_ids": ids.to(torch.int32), "logits_forward": logits_fwd, "logits_decode": logits_dec}
    if spec.dtype == "bfloat16":
        # The same (bf16-rounded) weights run in f32: how far HF's own bf16 compute is from exact.
        hf32 = load_hf(directory, torch.float32)
        probe32, probe16 = Probe(hf32), Probe(hf)
        ref32 = hf_forward(hf32, ids)
        hf_forward(hf, ids)
        probe32.close(), probe16.close()
        if len(probe32.choices) != len(probe16.choices) or not all(
                torch.equal(a, b) for a, b in zip(probe32.choices, probe16.choices)):
            raise RuntimeError(f"{spec.name}: the f32 run routes some token differently from the bf16 run")
        numbers["bf16_forward_vs_f32_forward_rel"] = rel(logits_fwd, ref32)
        numbers["bf16_token_decode_vs_f32_forward_rel"] = rel(logits_dec, ref32)
        expected["logits_forward_f32"] = ref32

    safetensors.torch.save_file({k: v.contiguous() for k, v in expected.items()},
                                directory / "expected.safetensors", metadata={"format": "pt"})

    meta = {
        "name": spec.name,
        "note": spec.note,
        "pattern": spec.pattern,
        "dtype": spec.dtype,
        "seed": spec.seed,
        "batch": spec.batch,
        "seq_len": spec.seq_len,
        "chunk_size": cfg.chunk_size,
        "prefill_lens": list(spec.prefill_lens),
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__,
                     "safetensors": safetensors.__version__, "numpy": np.__version__,
                     "python": platform.python_version()},
        "hf_code_path": "torch_forward",
        "hf_code_path_detail": ("NemotronHForCausalLM on the CPU in eval mode, no mamba_ssm / causal_conv1d / "
                                "kernels packages: mamba2_chunk_scan (chunked, dt floored at time_step_min) "
                                "for multi-token calls and the first call with a fresh cache, "
                                "mamba2_selective_state_update (no floor) for one-token calls with a cache; "
                                "attn_implementation=eager, experts_implementation=eager"),
        "logits_forward": "model(input_ids).logits, one call, no cache",
        "logits_decode": "token by token from an empty DynamicCache (first token through the chunked path)",
        **({"logits_forward_f32": "the same bf16-rounded weights loaded and run in float32 (HF, no cache)"}
           if spec.dtype == "bfloat16" else {}),
        "hf_self_consistency": numbers,
        "min_dt_seen": min(probe.min_dt, probe_dec.min_dt),
        "time_step_min": cfg.time_step_min,
        "input_draws": draws,
        "min_expert_routing_margin": _finite(min(probe.min_expert_margin, probe_dec.min_expert_margin)),
        "min_group_routing_margin": _finite(min(probe.min_group_margin, probe_dec.min_group_margin)),
        "routing": probe.routing_summary(),
        "logits_std": float(logits_fwd.std()),
    }
    (directory / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def compare(built: Path, committed: Path, dtype: str) -> list[str]:
    """Differences between a fresh build and the committed fixture (weights exact, logits to rounding)."""
    problems = []
    for fname in ("model.safetensors", "expected.safetensors"):
        new, old = safetensors.torch.load_file(built / fname), safetensors.torch.load_file(committed / fname)
        if new.keys() != old.keys():
            problems.append(f"{fname}: tensor names differ: {sorted(new.keys() ^ old.keys())}")
            continue
        for k in sorted(new):
            a, b = new[k], old[k]
            if a.shape != b.shape or a.dtype != b.dtype:
                problems.append(f"{fname}:{k}: {a.dtype}{list(a.shape)} vs committed {b.dtype}{list(b.shape)}")
            elif k.startswith("logits"):
                err = rel(a, b)
                if err > (1e-5 if dtype == "float32" else 1e-2):
                    problems.append(f"{fname}:{k}: rel {err:.3g} from the committed logits")
            elif not torch.equal(a, b):
                problems.append(f"{fname}:{k}: differs from the committed tensor")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture root (default: tests/fixtures/hf)")
    ap.add_argument("--only", nargs="*", help="build only these fixture names")
    ap.add_argument("--check", action="store_true",
                    help="build into a temporary directory and compare with the fixtures under --out")
    args = ap.parse_args(argv)

    for pkg in ("mamba_ssm", "causal_conv1d", "kernels"):
        if importlib.util.find_spec(pkg) is not None:
            print(f"error: {pkg} is installed; HF would take its kernels instead of the torch path", file=sys.stderr)
            return 2
    unknown = set(args.only or ()) - {s.name for s in SPECS}
    if unknown:
        print(f"error: unknown fixture names {sorted(unknown)}; known: {[s.name for s in SPECS]}", file=sys.stderr)
        return 2
    specs = [s for s in SPECS if not args.only or s.name in args.only]
    torch.set_grad_enabled(False)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) if args.check else args.out
        for spec in specs:
            meta = build(spec, root)
            sizes = sum(f.stat().st_size for f in (root / spec.name).iterdir())
            print(f"{spec.name:26s} {spec.pattern:7s} {spec.dtype:9s} T={spec.seq_len:3d} "
                  f"{sizes / 1024:6.1f} KiB  logits std {meta['logits_std']:.2f}  "
                  f"min dt {meta['min_dt_seen']:.3g}  HF-vs-HF {json.dumps(meta['hf_self_consistency'])}")
            if args.check:
                problems = compare(root / spec.name, args.out / spec.name, spec.dtype)
                failed |= bool(problems)
                print("  matches the committed fixture" if not problems else "\n".join("  " + p for p in problems))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
