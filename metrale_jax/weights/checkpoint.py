"""HF-layout checkpoints: the tensor-name table of each block kind, the loader and the saver.

Loading checks every tensor's name, shape and dtype from the safetensors headers first and raises one
CheckpointError listing every problem (with the expected shape) before any data is read; then it reads tensor by
tensor from the memory-mapped files (a progress bar on a terminal) and casts to the model dtype, except the tensors
kept in float32 (A_log, D, dt_bias, router weight and e_score_correction_bias). A config with
num_nextn_predict_layers > 0 may come with the MTP head's tensors (mtp.layers.{j}.*, see layers/mtp.py): all of
them are then checked and read like the main blocks'; a checkpoint without any loads without MTP (with a note), and
mtp.* tensors of a config with no MTP layers are skipped with a note.

Quantized checkpoints (hf_quant_config.json or config.json "quantization_config": ModelOpt FP8 / NVFP4, block FP8;
see weights/quant_config.py) come out with a container per linear module instead of an array: Fp8Weight (a ModelOpt
per-tensor scale expanded exactly to the 128x128 block grid), Nvfp4Weight, or the array itself where the module is
stored dense (excluded). The linear tensors' formats, dtypes and scale shapes are checked as they are read (every
problem collected, one CheckpointError before any model exists). A layer's routed experts are stacked [E, ...]:
kept quantized (StackedExperts, served by the grouped kernels) when all are block FP8 or all NVFP4, else a dense
array (quantized members dequantized to the model dtype, with a note). On a mesh each device's shares come from the
map (sharding.place; quantized: sharding_quant.read_on_mesh)."""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from metrale_jax import files
from metrale_jax.arguments import integer
from metrale_jax.config import ModelConfig, ModelLevers
from metrale_jax.errors import CheckpointError, WeightFormatError
from metrale_jax.layers.attention import NemotronAttentionWeights
from metrale_jax.layers.mamba2 import NemotronSsmWeights
from metrale_jax.layers.mlp import NemotronMlpWeights
from metrale_jax.layers.moe import NemotronMoeWeights
from metrale_jax.layers.mtp import MtpStepWeights, mtp_view
from metrale_jax.weights.containers import (DenseWeight, Fp8Share, Fp8Weight, Nvfp4Weight, StackedExperts, W4a4Weight,
                                            WeightQuantFormat, stack_experts)
from metrale_jax.weights.finite import nonfinite_tensors
from metrale_jax.weights.quant_config import QuantConfig, load_linear, quant_config_from_dicts, read_quant_config
from metrale_jax.weights.quantize import LINEAR_MODULES
from metrale_jax.weights.safetensors_io import (INDEX, CheckpointReader, SafetensorsFile, is_checkpoint_file,
                                               save_safetensors)

log = logging.getLogger(__name__)

FLOAT_DTYPES = ("F32", "BF16", "F16")
QUANTIZED_DTYPES = ("F8_E4M3", "F8_E5M2", "U8", "I8")
QUANTIZED_SUFFIXES = ("weight_scale", "weight_scale_2", "weight_scale_inv", "input_scale")
QUANTIZED_MESSAGE = ("no quantization config says how to read them (hf_quant_config.json, or config.json "
                     "quantization_config): the quantized loader needs one")
SUPPORTED_MESSAGE = "the quantized loader reads ModelOpt FP8 / NVFP4 and 128x128 block FP8 checkpoints"
# routed experts held dense (dequantized at load) are listed as excluded in the saved quantization config
EXPERTS_PATTERN = "backbone.layers.*.mixer.experts.*"
MAX_SHARD_BYTES = 2 * 1024 ** 3
# missing tensors listed one by one beyond twice the checkpoint's count (size_problem); past that, the config's sizes
MAX_MISSING = 1024
_MTP = re.compile(r"^mtp\.")
_KV_SCALE = re.compile(r"\.[kv]_scale$")          # ModelOpt FP8 KV-cache scales: the KV pool is not quantized
# A routed expert's weight; the loader stacks a layer's experts into one [E, ...] array under
# "<mixer>.experts.up_proj" / ".experts.down_proj" (HF's in-memory fused names).
_EXPERT = re.compile(r"^(?P<mixer>(?:backbone|mtp)\.layers\.\d+\.mixer\.)"
                     r"experts\.(?P<e>\d+)\.(?P<proj>up|down)_proj\.weight$")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What the loader expects under one name: shape (HF layout), accepted alternative shapes, and
    whether the tensor stays float32 whatever the model dtype."""

    shape: tuple[int, ...]
    keep_f32: bool = False
    alt_shapes: tuple[tuple[int, ...], ...] = ()

    def accepts(self, shape) -> bool:
        return tuple(shape) == self.shape or tuple(shape) in self.alt_shapes


# ---- name tables ---------------------------------------------------------------------------
def _mamba_tensors(c: ModelConfig) -> dict[str, TensorSpec]:
    H, I, C, K, D = c.mamba_num_heads, c.d_inner, c.conv_dim, c.conv_kernel, c.hidden_size
    t = {"in_proj.weight": TensorSpec((c.in_proj_dim, D)),
         "conv1d.weight": TensorSpec((C, 1, K), alt_shapes=((C, K),)),
         "dt_bias": TensorSpec((H,), keep_f32=True), "A_log": TensorSpec((H,), keep_f32=True),
         "D": TensorSpec((H,), keep_f32=True), "norm.weight": TensorSpec((I,)), "out_proj.weight": TensorSpec((D, I))}
    if c.use_conv_bias:
        t["conv1d.bias"] = TensorSpec((C,))
    return t


def _attention_tensors(c: ModelConfig) -> dict[str, TensorSpec]:
    D, H, KVH, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    t = {"q_proj.weight": TensorSpec((H * hd, D)), "k_proj.weight": TensorSpec((KVH * hd, D)),
         "v_proj.weight": TensorSpec((KVH * hd, D)), "o_proj.weight": TensorSpec((D, H * hd))}
    if c.attention_bias:
        t.update({"q_proj.bias": TensorSpec((H * hd,)), "k_proj.bias": TensorSpec((KVH * hd,)),
                  "v_proj.bias": TensorSpec((KVH * hd,)), "o_proj.bias": TensorSpec((D,))})
    return t


def _mlp_tensors(prefix: str, D: int, inter: int, bias: bool) -> dict[str, TensorSpec]:
    t = {f"{prefix}up_proj.weight": TensorSpec((inter, D)), f"{prefix}down_proj.weight": TensorSpec((D, inter))}
    if bias:
        t.update({f"{prefix}up_proj.bias": TensorSpec((inter,)), f"{prefix}down_proj.bias": TensorSpec((D,))})
    return t


def _moe_tensors(c: ModelConfig, *, experts: bool = True) -> dict[str, TensorSpec]:
    """A MoE block's tensors (experts=False: all but the routed experts' 2 * n_routed_experts)."""
    D, E, I = c.hidden_size, c.n_routed_experts, c.moe_intermediate_size
    Din = c.moe_latent_size or D
    t = {"gate.weight": TensorSpec((E, D), keep_f32=True),
         "gate.e_score_correction_bias": TensorSpec((E,), keep_f32=True)}
    for e in range(E if experts else 0):
        t[f"experts.{e}.up_proj.weight"] = TensorSpec((I, Din))
        t[f"experts.{e}.down_proj.weight"] = TensorSpec((Din, I))
    if c.n_shared_experts:
        t.update(_mlp_tensors("shared_experts.", D, c.moe_shared_expert_intermediate_size, c.mlp_bias))
    if c.moe_latent_size is not None:
        t["fc1_latent_proj.weight"] = TensorSpec((Din, D))
        t["fc2_latent_proj.weight"] = TensorSpec((D, Din))
        if c.mlp_bias:
            t["fc1_latent_proj.bias"] = TensorSpec((Din,))
            t["fc2_latent_proj.bias"] = TensorSpec((D,))
    return t


MIXER_TABLES: dict[str, Callable[[ModelConfig], dict[str, TensorSpec]]] = {
    "M": _mamba_tensors,
    "*": _attention_tensors,
    "-": lambda c: _mlp_tensors("", c.hidden_size, c.intermediate_size, c.mlp_bias),
    "E": _moe_tensors,
}


def block_tensors(config: ModelConfig, i: int) -> dict[str, TensorSpec]:
    """Every tensor of block i under its full HF name."""
    p = f"backbone.layers.{i}"
    out = {f"{p}.norm.weight": TensorSpec((config.hidden_size,))}
    for suffix, spec in MIXER_TABLES[config.hybrid_override_pattern[i]](config).items():
        out[f"{p}.mixer.{suffix}"] = spec
    return out


def expected_tensors(config: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor a dense checkpoint of `config` holds (lm_head only when not tied), a layer's
    experts in order 0..E-1."""
    V, D = config.vocab_size, config.hidden_size
    out = {"backbone.embeddings.weight": TensorSpec((V, D))}
    for i in range(config.num_hidden_layers):
        out.update(block_tensors(config, i))
    out["backbone.norm_f.weight"] = TensorSpec((D,))
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = TensorSpec((V, D))
    return out


def tensor_count(config: ModelConfig, *, mtp: bool) -> int:
    """How many tensors `expected_tensors` (plus `mtp_tensors` with mtp) names, counted from the tables without
    listing them: a config's layer, expert and MTP step counts are its own to choose, and a listing is as long."""
    def block(kind: str) -> int:                      # a block's tensors, its input norm included
        if kind == "E":
            return 1 + len(_moe_tensors(config, experts=False)) + 2 * config.n_routed_experts
        return 1 + len(MIXER_TABLES[kind](config))
    count = lambda pattern: sum(block(k) * n for k, n in collections.Counter(pattern).items())
    n = 2 + (not config.tie_word_embeddings) + count(config.hybrid_override_pattern)
    if mtp and config.num_nextn_predict_layers > 0:   # per step: its blocks, enorm, hnorm, eh_proj, final_layernorm
        n += config.num_nextn_predict_layers * (4 + count(config.mtp_hybrid_override_pattern))
    return n


def parameter_count(config: ModelConfig, *, mtp: bool) -> int:
    """The model's parameters: the elements of every tensor the checkpoint names (a quantized weight counts its
    logical elements, its scales none), the MTP head's with mtp."""
    specs = {**expected_tensors(config), **(mtp_tensors(config) if mtp else {})}
    return sum(math.prod(spec.shape) for spec in specs.values())


def mtp_tensors(config: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor of the MTP head (none when num_nextn_predict_layers is 0): block j of the MTP pattern
    repeated per step as mtp.layers.{j}.norm / .mixer.* (the main blocks' table), enorm / hnorm / eh_proj on
    a step's first block and final_layernorm on its last."""
    if not config.num_nextn_predict_layers:
        return {}
    view, P, D = mtp_view(config), len(config.mtp_hybrid_override_pattern), config.hidden_size
    out: dict[str, TensorSpec] = {}
    for j in range(view.num_hidden_layers):
        p = f"mtp.layers.{j}"
        if j % P == 0:
            out.update({f"{p}.enorm.weight": TensorSpec((D,)), f"{p}.hnorm.weight": TensorSpec((D,)),
                        f"{p}.eh_proj.weight": TensorSpec((D, 2 * D))})
        out.update((_to_mtp(n), spec) for n, spec in block_tensors(view, j).items())
        if j % P == P - 1:
            out[f"{p}.final_layernorm.weight"] = TensorSpec((D,))
    return out


def has_mtp(names) -> bool:
    """Whether any of `names` is an MTP tensor (mtp.*)."""
    return any(_MTP.match(n) for n in names)


def model_tensors(config: ModelConfig, names=()) -> dict[str, TensorSpec]:
    """`expected_tensors`, plus the MTP head's tensors when the config has MTP layers and `names` (the
    tensors at hand) hold any mtp.* one: the MTP head is optional, but whole."""
    out = expected_tensors(config)
    if config.num_nextn_predict_layers and has_mtp(names):
        out.update(mtp_tensors(config))
    return out


def _to_mtp(name: str) -> str:
    return "mtp." + name[len("backbone."):]


def _to_backbone(name: str) -> str:
    return "backbone." + name[len("mtp."):]


def missing_tensors(config: ModelConfig, tensors: Mapping[str, object]) -> list[str]:
    """Problems for expected names absent from `tensors` (stacked experts count for their members); the MTP
    head's names count when any mtp.* tensor is given."""
    out = []
    for name, spec in model_tensors(config, tensors).items():
        m = _EXPERT.match(name)
        if name not in tensors and (m is None or f"{m['mixer']}experts.{m['proj']}_proj" not in tensors):
            out.append(f"{name}: missing (expected shape {list(spec.shape)})")
    return out


def unsupported(config: ModelConfig) -> list[str]:
    """Config switches the layers do not implement yet."""
    if "M" in config.hybrid_override_pattern and config.use_bias:
        return ["use_bias=true: the Mamba-2 layer has no in_proj/out_proj bias support yet"]
    return []


# ---- tensors <-> layer weights ---------------------------------------------------------------
def layer_weights(config: ModelConfig, i: int, tensors: Mapping[str, object]):
    """(input norm, mixer weights dataclass) of block i from HF-named tensors (a layer's routed experts
    either one by one or stacked under "<mixer>.experts.up_proj" / "<mixer>.experts.down_proj"; a routed
    experts given as quantized containers of one format stay quantized, as the loader keeps them)."""
    p = f"backbone.layers.{i}.mixer."
    get = lambda s: tensors[p + s]
    opt = lambda s: tensors.get(p + s)
    dense = lambda s: as_linear(get(s))
    kind = config.hybrid_override_pattern[i]
    if kind == "M":
        w = NemotronSsmWeights(
            in_proj=dense("in_proj.weight"), out_proj=dense("out_proj.weight"),
            conv1d_weight=jnp.reshape(get("conv1d.weight"), (config.conv_dim, config.conv_kernel)),
            conv1d_bias=opt("conv1d.bias"), dt_bias=get("dt_bias"), A_log=get("A_log"), D=get("D"),
            norm_weight=get("norm.weight"))
    elif kind == "*":
        w = NemotronAttentionWeights(
            dense("q_proj.weight"), dense("k_proj.weight"), dense("v_proj.weight"), dense("o_proj.weight"),
            q_bias=opt("q_proj.bias"), k_bias=opt("k_proj.bias"), v_bias=opt("v_proj.bias"),
            o_bias=opt("o_proj.bias"))
    elif kind == "-":
        w = _mlp_weights(tensors, p)
    else:
        E = config.n_routed_experts
        stacked = lambda proj: (get(f"experts.{proj}") if p + f"experts.{proj}" in tensors else
                                _stack_given(p + f"experts.{proj}", [get(f"experts.{e}.{proj}.weight")
                                                                     for e in range(E)]))
        w = NemotronMoeWeights(
            gate=get("gate.weight"), e_score_correction_bias=get("gate.e_score_correction_bias"),
            experts_up=stacked("up_proj"), experts_down=stacked("down_proj"),
            shared=_mlp_weights(tensors, p + "shared_experts.") if config.n_shared_experts else None,
            fc1_latent_proj=None if opt("fc1_latent_proj.weight") is None else dense("fc1_latent_proj.weight"),
            fc2_latent_proj=None if opt("fc2_latent_proj.weight") is None else dense("fc2_latent_proj.weight"),
            fc1_latent_bias=opt("fc1_latent_proj.bias"), fc2_latent_bias=opt("fc2_latent_proj.bias"))
    return tensors[f"backbone.layers.{i}.norm.weight"], w


def mtp_weights(config: ModelConfig, tensors: Mapping[str, object]):
    """(blocks, steps) of the MTP head from HF-named tensors: blocks[j] = (input norm, mixer weights) of
    mtp.layers.{j} (as `layer_weights` reads a main block), steps[s] = MtpStepWeights."""
    view, P = mtp_view(config), len(config.mtp_hybrid_override_pattern)
    renamed = {_to_backbone(n): v for n, v in tensors.items() if _MTP.match(n)}
    blocks = [layer_weights(view, j, renamed) for j in range(view.num_hidden_layers)]
    steps = []
    for s in range(config.num_nextn_predict_layers):
        first, last = f"mtp.layers.{s * P}", f"mtp.layers.{s * P + P - 1}"
        steps.append(MtpStepWeights(tensors[f"{first}.enorm.weight"], tensors[f"{first}.hnorm.weight"],
                                    as_linear(tensors[f"{first}.eh_proj.weight"]),
                                    tensors[f"{last}.final_layernorm.weight"]))
    return blocks, steps


def mtp_layer_tensors(config: ModelConfig, blocks, steps) -> dict[str, object]:
    """The inverse of `mtp_weights`: the MTP head's tensors under their mtp.* names."""
    view, P = mtp_view(config), len(config.mtp_hybrid_override_pattern)
    out: dict[str, object] = {}
    for j, (norm, w) in enumerate(blocks):
        out.update((_to_mtp(n), v) for n, v in layer_tensors(view, j, norm, w).items())
    for s, w in enumerate(steps):
        first, last = f"mtp.layers.{s * P}", f"mtp.layers.{s * P + P - 1}"
        eh = w.eh_proj.weight if isinstance(w.eh_proj, DenseWeight) else w.eh_proj
        out.update({f"{first}.enorm.weight": w.enorm, f"{first}.hnorm.weight": w.hnorm,
                    f"{first}.eh_proj.weight": eh, f"{last}.final_layernorm.weight": w.final_layernorm})
    return out


def _mlp_weights(tensors, p: str) -> NemotronMlpWeights:
    return NemotronMlpWeights(as_linear(tensors[p + "up_proj.weight"]), as_linear(tensors[p + "down_proj.weight"]),
                              up_bias=tensors.get(p + "up_proj.bias"), down_bias=tensors.get(p + "down_proj.bias"))


def as_linear(value):
    """A linear module's weight as a container: quantized containers and DenseWeight pass, arrays are wrapped."""
    return value if is_container(value) else DenseWeight(value)


def is_container(value) -> bool:
    return isinstance(value, (DenseWeight, Fp8Weight, Fp8Share, Nvfp4Weight, W4a4Weight, StackedExperts))


def _stack_given(key: str, members: list):
    """Experts given one by one: quantized ones of one stackable format stay quantized (StackedExperts),
    else a dense stack (quantized members dequantized)."""
    if all(is_quantized(v) for v in members):
        try:
            return stack_experts(key, members)
        except WeightFormatError:
            pass
    return jnp.stack([v.dequantize(jnp.float32) if is_quantized(v) else v for v in members])


def is_quantized(value) -> bool:
    return is_container(value) and not isinstance(value, DenseWeight)


def linear_module(name: str) -> str | None:
    """The module of a linear layer's weight ("...mixer.q_proj.weight" -> "...mixer.q_proj"; lm_head
    included, the router and norms not), else None."""
    if not name.endswith(".weight"):
        return None
    module = name[:-len(".weight")]
    return module if module == "lm_head" or module.rsplit(".", 1)[-1] in (*LINEAR_MODULES, "eh_proj") else None


def layer_tensors(config: ModelConfig, i: int, input_norm, weights) -> dict[str, object]:
    """The inverse of `layer_weights`: block i's tensors under HF names, in the HF layout."""
    p = f"backbone.layers.{i}.mixer."
    out: dict[str, object] = {f"backbone.layers.{i}.norm.weight": input_norm}
    put = lambda s, v: v is not None and out.__setitem__(p + s, v.weight if isinstance(v, DenseWeight) else v)
    kind = config.hybrid_override_pattern[i]
    if kind == "M":
        put("in_proj.weight", weights.in_proj)
        put("conv1d.weight", jnp.reshape(weights.conv1d_weight, (config.conv_dim, 1, config.conv_kernel)))
        put("conv1d.bias", weights.conv1d_bias)
        for s, v in (("dt_bias", weights.dt_bias), ("A_log", weights.A_log), ("D", weights.D),
                     ("norm.weight", weights.norm_weight), ("out_proj.weight", weights.out_proj)):
            put(s, v)
    elif kind == "*":
        for n in "qkvo":
            put(f"{n}_proj.weight", getattr(weights, f"{n}_proj"))
            put(f"{n}_proj.bias", getattr(weights, f"{n}_bias"))
    elif kind == "-":
        _put_mlp(put, "", weights)
    else:
        put("gate.weight", weights.gate)
        put("gate.e_score_correction_bias", weights.e_score_correction_bias)
        for e in range(config.n_routed_experts):
            put(f"experts.{e}.up_proj.weight", weights.experts_up[e])
            put(f"experts.{e}.down_proj.weight", weights.experts_down[e])
        if weights.shared is not None:
            _put_mlp(put, "shared_experts.", weights.shared)
        put("fc1_latent_proj.weight", weights.fc1_latent_proj)
        put("fc2_latent_proj.weight", weights.fc2_latent_proj)
        put("fc1_latent_proj.bias", weights.fc1_latent_bias)
        put("fc2_latent_proj.bias", weights.fc2_latent_bias)
    return out


def _put_mlp(put, prefix: str, w: NemotronMlpWeights) -> None:
    put(prefix + "up_proj.weight", w.up_proj)
    put(prefix + "down_proj.weight", w.down_proj)
    put(prefix + "up_proj.bias", w.up_bias)
    put(prefix + "down_proj.bias", w.down_bias)


# ---- loading ---------------------------------------------------------------------------------
def check_checkpoint(reader, config: ModelConfig, qcfg: QuantConfig | None = None) -> tuple[list[str], list[str]]:
    """(problems, notes) from the headers alone: missing, unexpected, mis-shaped or mis-typed tensors. With a
    quantization (qcfg, default: the config's quantization_config), a linear module's weight may be stored
    quantized with its scale tensors beside it; load_linear checks those as it reads them."""
    if qcfg is None:
        qcfg = quantization_of(config)
    quantized_ckpt = qcfg.method != "none"
    problems = unsupported(config)
    notes: list[str] = []
    present = set(reader.keys())
    if (size := size_problem(config, present)) is not None:
        raise CheckpointError(size)
    expected = model_tensors(config, present)
    if not quantized_ckpt:
        quantized = sorted(n for n in present if n.rsplit(".", 1)[-1] in QUANTIZED_SUFFIXES
                           or (n in expected and reader.info(n)[0] in QUANTIZED_DTYPES))
        if quantized:
            shown = ", ".join(quantized[:8]) + (f" and {len(quantized) - 8} more" if len(quantized) > 8 else "")
            raise CheckpointError(f"quantized tensors ({shown}), but {QUANTIZED_MESSAGE}")
    scales: set[str] = set()
    for name, spec in expected.items():
        if name not in present:
            problems.append(f"{name}: missing (expected shape {list(spec.shape)})")
            continue
        module = linear_module(name) if quantized_ckpt else None
        if module is not None:
            scales.update(f"{module}.{s}" for s in QUANTIZED_SUFFIXES)
            continue
        dtype, shape = reader.info(name)
        if not spec.accepts(shape):
            alts = "".join(f" or {list(a)}" for a in spec.alt_shapes)
            problems.append(f"{name}: shape {list(shape)}, expected {list(spec.shape)}{alts}")
        if dtype not in FLOAT_DTYPES:
            problems.append(f"{name}: dtype {dtype}, expected one of {', '.join(FLOAT_DTYPES)}")
    ignored = sorted(n for n in present - set(expected) if _MTP.match(n) and not config.num_nextn_predict_layers)
    if ignored:
        notes.append(f"ignored {len(ignored)} multi-token-prediction tensors (mtp.*): the config has "
                     f"num_nextn_predict_layers = 0")
    if config.num_nextn_predict_layers and not has_mtp(present):
        notes.append(f"no MTP tensors (mtp.*) although num_nextn_predict_layers = {config.num_nextn_predict_layers}: "
                     f"loaded without the MTP head (no MTP drafting)")
    kv_scales = sorted(n for n in present - set(expected) if quantized_ckpt and _KV_SCALE.search(n))
    if kv_scales:
        notes.append(f"ignored {len(kv_scales)} KV-cache scales (k_scale / v_scale): the KV pool is not quantized")
        ignored += kv_scales
    if config.tie_word_embeddings and "lm_head.weight" in present:
        notes.append("ignored lm_head.weight: tie_word_embeddings is true, so lm_head uses the embeddings")
        ignored += [n for n in present if n == "lm_head.weight" or n.startswith("lm_head.")]
    for name in sorted(present - set(expected) - set(ignored) - scales):
        dtype, shape = reader.info(name)
        problems.append(f"{name}: unexpected tensor ({dtype} {list(shape)}); the config {_describe(config)} "
                        f"has no such weight")
    return problems, notes


def size_problem(config: ModelConfig, present) -> str | None:
    """Why `config` cannot describe a checkpoint holding the tensors `present` (None when it may): it names more
    than twice as many tensors, plus MAX_MISSING. Such a config (num_hidden_layers, n_routed_experts or
    num_nextn_predict_layers far past the checkpoint's) is refused by its counts, before its tensor names are
    listed: listing them, and each as missing, costs memory and time in proportion to numbers it chooses."""
    want = tensor_count(config, mtp=has_mtp(present))
    if want <= 2 * len(present) + MAX_MISSING:
        return None
    return (f"config.json names {want} tensors ({config.num_hidden_layers} layers, n_routed_experts = "
            f"{config.n_routed_experts}, num_nextn_predict_layers = {config.num_nextn_predict_layers}), but the "
            f"checkpoint holds {len(present)}: the config describes another model")


def quantization_of(config: ModelConfig) -> QuantConfig:
    """The QuantConfig that config.json's quantization_config describes (method 'none' without one)."""
    return _supported(lambda: quant_config_from_dicts(None, {"quantization_config": config.quantization_config}))


def checkpoint_quantization(directory: str | os.PathLike) -> QuantConfig:
    """The quantization of the checkpoint in `directory` (hf_quant_config.json, else config.json)."""
    return _supported(lambda: read_quant_config(directory))


def _supported(read) -> QuantConfig:
    try:
        return read()
    except CheckpointError as e:
        raise CheckpointError([*e.problems[:-1], f"{e.problems[-1]} ({SUPPORTED_MESSAGE})"]) from None


def _describe(config: ModelConfig) -> str:
    return f"(pattern {config.hybrid_override_pattern!r})"


class _SingleFileReader:
    """The reader interface over one model.safetensors, so that other .safetensors files lying in the
    directory (test fixtures, optimizer states) are not taken for weights."""

    def __init__(self, path: Path):
        self._file = SafetensorsFile(path)
        self.keys, self.info, self.get, self.close = (self._file.keys, self._file.info, self._file.get,
                                                      self._file.close)


def open_checkpoint(directory: str | os.PathLike):
    """HF's order: model.safetensors.index.json, else model.safetensors, else every *.safetensors."""
    d = Path(directory)
    if d.is_dir() and not os.path.lexists(d / INDEX) and os.path.lexists(d / "model.safetensors"):
        return _SingleFileReader(d / "model.safetensors")   # refused there unless a regular file
    return CheckpointReader(d)


def read_checkpoint(directory: str | os.PathLike, config: ModelConfig, dtype=jnp.bfloat16, *,
                    progress: bool | None = None, mesh=None, qcfg: QuantConfig | None = None,
                    check_finite: bool = True, levers=None) -> tuple[dict[str, object], list[str]]:
    """All tensors of an HF checkpoint, validated, cast and in HF names: (tensors, notes). A quantized
    checkpoint (qcfg, default: read from the directory) gives a container per quantized linear module.
    mesh: each tensor goes from the memory map straight to its shards (a sharding.ShardedTensors), each device's
    share read by its rows / columns / experts only: quantized containers too (sharding_quant.read_on_mesh, placed
    for `levers`, default ModelLevers.from_env(): the model's levers decide an FP8 split's refusals).
    check_finite: a tensor holding a NaN or an infinity once loaded is a CheckpointError (see nonfinite_tensors)."""
    qcfg = checkpoint_quantization(directory) if qcfg is None else qcfg
    quantized_ckpt = qcfg.method != "none"
    reader = open_checkpoint(directory)
    try:
        problems, notes = check_checkpoint(reader, config, qcfg)
        if problems:
            raise CheckpointError(problems)
        expected = model_tensors(config, reader.keys())
        if mesh is not None and has_mtp(reader.keys()):
            expected = expected_tensors(config)
            notes.append("the MTP head (mtp.*) is not loaded on a mesh: tensor parallelism splits the main blocks "
                         "only")
        tensors: dict[str, object] = {}
        members: dict[str, list] = {}                 # a layer's experts, stacked once the last one is read
        dequantized_experts: collections.Counter = collections.Counter()
        E = config.n_routed_experts
        bar = tqdm(expected.items(), total=len(expected), desc="loading weights", unit="tensor",
                   disable=None if progress is None else not progress, leave=False)
        if mesh is not None:                          # each view read by its devices' shares only
            from metrale_jax import sharding, sharding_quant     # here: sharding imports this module
            tp, levers = sharding.tensor_parallel(mesh), ModelLevers.from_env() if levers is None else levers
            tensors = sharding_quant.read_on_mesh(reader, config, bar, qcfg, dtype, tp, levers, problems,
                                                  dequantized_experts) if quantized_ckpt else \
                sharding.shard_tensors(config, ((name, reader.get(name)) for name, _ in bar), tp, dtype)
        for name, spec in (bar if mesh is None else ()):
            target = jnp.float32 if spec.keep_f32 else dtype
            m = _EXPERT.match(name)
            module = linear_module(name) if quantized_ckpt else None
            if module is None:
                arr = reader.get(name)                # a read-only view into the memory map
            else:
                try:
                    w = load_linear(reader, module, spec.shape, qcfg, fp8_to_block=True, dtype=target)
                except CheckpointError as e:
                    problems.extend(e.problems)
                    continue
                if isinstance(w, DenseWeight) and m is None:
                    tensors[name] = w.weight          # already in `target`
                    continue
                if isinstance(w, DenseWeight):
                    arr = w.weight
                elif m is not None:                   # a routed expert: stacked below, kept quantized
                    arr = w
                elif isinstance(w, Fp8Weight) and w.format is not WeightQuantFormat.FP8_BLOCK_SCALED:
                    problems.append(f"{module}.weight_scale: a per-row FP8 scale [N]; the FP8 arms take one "
                                    f"scale per tensor or per 128x128 block")
                    continue
                else:
                    tensors[name] = w
                    continue
            if m is None:
                tensors[name] = jnp.array(arr, dtype=target, copy=True)
                continue
            key = f"{m['mixer']}experts.{m['proj']}_proj"
            members.setdefault(key, [None] * E)[int(m["e"])] = arr
            if int(m["e"]) == E - 1:
                tensors[key] = stack_layer_experts(key, members.pop(key), target, dequantized_experts)
        if check_finite:
            problems.extend(nonfinite_tensors(tensors))
        if problems:
            raise CheckpointError(problems)
        if dequantized_experts:
            kinds = ", ".join(f"{n} {f}" for f, n in sorted(dequantized_experts.items()))
            notes.append(f"dequantized {kinds} routed-expert weights to {jnp.dtype(dtype).name} at load: the "
                         f"grouped expert kernels take block-FP8 or NVFP4 experts of one format per layer")
        for note in notes:
            log.info("%s: %s", directory, note)
        return tensors, notes
    finally:
        reader.close()


def _format_name(w) -> str:
    return "nvfp4" if isinstance(w, Nvfp4Weight) else "fp8"


def stack_layer_experts(key: str, members: list, dtype, dequantized: collections.Counter):
    """One layer's routed experts [E, ...]: StackedExperts when every expert is block-FP8 (per-tensor scales
    already expanded to the grid) or every one NVFP4; else a dense stack (quantized ones dequantized and
    counted in `dequantized`), filled on the host and sent at once."""
    kinds = {(type(v), getattr(v, "format", None)) for v in members}
    if len(kinds) == 1 and next(iter(kinds)) in ((Nvfp4Weight, WeightQuantFormat.NVFP4),
                                                  (Fp8Weight, WeightQuantFormat.FP8_BLOCK_SCALED)):
        return stack_experts(key, members)
    dense = None
    for e, v in enumerate(members):
        if is_quantized(v):
            dequantized[_format_name(v)] += 1
            v = v.dequantize(jnp.float32)
        if dense is None:
            dense = np.empty((len(members), *v.shape), np.dtype(dtype))
        dense[e] = np.asarray(v)
    return jnp.asarray(dense)


# ---- saving ----------------------------------------------------------------------------------
def linear_tensors(module: str, w, method: str) -> dict[str, object]:
    """The checkpoint tensors of one linear module's container in the layout of `method` (the inverse of
    load_linear): dense -> weight; fp8_block -> weight + weight_scale_inv; fp8 -> weight + scalar weight_scale
    (a block grid must hold one value) [+ input_scale]; nvfp4 -> weight + weight_scale + weight_scale_2
    [+ input_scale]. A container the method cannot store raises CheckpointError naming the module."""
    if isinstance(w, W4a4Weight):
        w = w.weight
    if isinstance(w, DenseWeight) or not is_container(w):
        return {f"{module}.weight": w.weight if isinstance(w, DenseWeight) else w}
    out: dict[str, object] = {f"{module}.weight": w.packed if isinstance(w, Nvfp4Weight) else w.weight}
    if isinstance(w, Nvfp4Weight) and method == "nvfp4":
        out.update({f"{module}.weight_scale": w.scale, f"{module}.weight_scale_2": jnp.reshape(w.global_scale, ())})
    elif isinstance(w, Fp8Weight) and method == "fp8_block" and w.format is WeightQuantFormat.FP8_BLOCK_SCALED:
        out[f"{module}.weight_scale_inv"] = w.scale
    elif isinstance(w, Fp8Weight) and method == "fp8" and w.format is not WeightQuantFormat.FP8_PER_ROW:
        scale = np.asarray(w.scale, np.float32)
        if scale.size == 0 or np.any(scale != scale.flat[0]):
            raise CheckpointError(f"{module}: FP8 block scales differ across blocks; a ModelOpt FP8 checkpoint "
                                  f"holds one scale per tensor (save as fp8_block)")
        out[f"{module}.weight_scale"] = scale.reshape(-1)[:1].reshape(())
    else:
        held = f"{type(w).__name__} ({w.format.name})"
        hint = (" (FP8 weights requantized to NVFP4 at load with native_fp8_ssm='off' keep no FP8 numbers; load with "
                "native_fp8_ssm='decode' or 'full' to save)" if isinstance(w, Nvfp4Weight) else "")
        raise CheckpointError(f"{module}: holds {held} weights, which a {method!r} checkpoint cannot store{hint}")
    if getattr(w, "input_scale", None) is not None:
        out[f"{module}.input_scale"] = jnp.reshape(w.input_scale, ())
    return out


def checkpoint_tensors(tensors: Mapping[str, object], qcfg: QuantConfig) -> dict[str, np.ndarray]:
    """HF-named tensors whose linear weights may be containers -> host arrays in the checkpoint's layout."""
    out: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        module = linear_module(name)
        parts = linear_tensors(module, value, qcfg.method) if module is not None and is_container(value) \
            else {name: value}
        out.update((n, np.asarray(v)) for n, v in parts.items())
    return out


def write_checkpoint(directory: str | os.PathLike, config: ModelConfig, tensors: Mapping[str, object], *,
                     torch_dtype: str | None = None, max_shard_bytes: int = MAX_SHARD_BYTES,
                     qcfg: QuantConfig | None = None, tokenizer=None, overwrite: bool = False) -> list[Path]:
    """config.json plus model.safetensors, or shards with model.safetensors.index.json when the tensors
    exceed max_shard_bytes, plus the tokenizer's file when one is given. qcfg: the quantization the tensors are in
    (their scale tensors sit beside the weights); it is written to config.json's quantization_config (and
    hf_quant_config.json for ModelOpt). Written atomically (files.staged_directory): a directory that already
    holds a checkpoint is replaced only with overwrite=True, and then whole (no old shard, index or config
    survives); its other files are kept. Returns the weights files."""
    integer("max_shard_bytes", max_shard_bytes, 1)
    qcfg = qcfg or QuantConfig()
    expected = model_tensors(config, tensors)
    scales = {f"{m}.{s}" for m in filter(None, map(linear_module, expected)) for s in QUANTIZED_SUFFIXES} \
        if qcfg.method != "none" else set()
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected) - scales)
    if missing or extra:
        raise CheckpointError([f"{n}: missing from the tensors to save" for n in missing]
                              + [f"{n}: not a tensor of this config" for n in extra])
    order = [*expected, *sorted(set(tensors) - set(expected))]
    arrays = {n: np.asarray(tensors[n]) for n in order}
    hf = dataclasses.replace(config, quantization_config=qcfg.quantization_config()).to_hf_dict()
    if torch_dtype is not None:
        hf["torch_dtype"] = torch_dtype
    with files.staged_directory(directory, overwrite=overwrite, replaces=is_checkpoint_file) as d:
        files.write_json(d / "config.json", hf)
        if qcfg.hf_quant_config() is not None:
            files.write_json(d / "hf_quant_config.json", qcfg.hf_quant_config())
        names = write_shards(d, arrays, max_shard_bytes)
        if tokenizer is not None:
            tokenizer.save(d)
    return [Path(directory) / n for n in names]


def write_shards(d: Path, arrays: Mapping[str, np.ndarray], max_shard_bytes: int) -> list[str]:
    """model.safetensors, or model-0000k-of-0000n.safetensors shards (each up to max_shard_bytes, or one tensor)
    and model.safetensors.index.json, written in the new directory d. Returns the weights files' names."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in arrays.items():
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    if len(shards) == 1:
        save_safetensors(d / "model.safetensors", shards[0], metadata={"format": "pt"})
        return ["model.safetensors"]
    names, weight_map = [], {}
    for k, shard in enumerate(shards, 1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_safetensors(d / name, shard, metadata={"format": "pt"})
        names.append(name)
        weight_map.update(dict.fromkeys(shard, name))
    total = int(sum(a.nbytes for a in arrays.values()))
    files.write_json(d / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return names
