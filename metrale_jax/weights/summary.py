"""A checkpoint's summary from config.json and its safetensors headers (no tensor data is read): layers, sizes,
parameters, weight formats, quantization and tokenizer, as `metrale-jax info` prints it."""

from __future__ import annotations

import collections
import math
from pathlib import Path

from metrale_jax.config import ModelConfig
from metrale_jax.errors import CheckpointError
from metrale_jax.files import config_error, read_json
from metrale_jax.tokenizer import BYTE_TOKENIZER_FILE
from metrale_jax.weights.checkpoint import open_checkpoint
from metrale_jax.weights.quant_config import read_quant_config
from metrale_jax.weights.safetensors_io import DTYPES

_SCALES = ("weight_scale", "weight_scale_2", "weight_scale_inv", "input_scale")


def checkpoint_summary(directory: Path) -> dict:
    """Layers, sizes and weight formats of a checkpoint from config.json and the safetensors headers
    (no tensor data is read)."""
    config = ModelConfig.from_hf(directory)
    raw = read_json(directory / "config.json", config_error)
    reader = open_checkpoint(directory)
    try:
        infos = {name: reader.info(name) for name in reader.keys()}
    finally:
        reader.close()
    bytes_by_dtype: collections.Counter = collections.Counter()
    formats: collections.Counter = collections.Counter()
    params = 0
    for name, (dtype, shape) in infos.items():
        numel = math.prod(shape)
        bytes_by_dtype[dtype] += numel * DTYPES[dtype].itemsize
        base, _, leaf = name.rpartition(".")
        if leaf in _SCALES:
            continue                                           # scales are bytes, not parameters
        params += 2 * numel if dtype == "U8" and leaf == "weight" else numel
        if leaf != "weight" or len(shape) < 2:
            continue
        if dtype == "U8":
            formats["nvfp4"] += 1
        elif dtype.startswith("F8_"):
            formats["fp8 block-scaled" if f"{base}.weight_scale_inv" in infos else "fp8 per-tensor"] += 1
        else:
            formats[f"dense {dtype.lower()}"] += 1
    kinds = collections.Counter(config.hybrid_override_pattern)
    names = {"M": "mamba2", "*": "attention", "-": "mlp", "E": "moe"}
    c = config
    highlights = {"hidden_size": c.hidden_size, "vocab_size": c.vocab_size,
                  "tie_word_embeddings": c.tie_word_embeddings, "dtype": raw.get("dtype") or raw.get("torch_dtype")}
    if kinds["M"]:
        highlights["mamba"] = (f"{c.mamba_num_heads} heads x {c.mamba_head_dim}, state {c.ssm_state_size}, "
                               f"{c.n_groups} groups, conv {c.conv_kernel}, chunk {c.chunk_size}")
    if kinds["*"]:
        highlights["attention"] = (f"{c.num_attention_heads} heads / {c.num_key_value_heads} kv heads "
                                   f"x {c.head_dim}")
    if kinds["-"]:
        highlights["mlp"] = f"intermediate {c.intermediate_size}, {c.mlp_hidden_act}"
    if kinds["E"]:
        highlights["moe"] = (f"{c.n_routed_experts} experts (top {c.num_experts_per_tok}, {c.n_group} groups / "
                             f"top {c.topk_group}), intermediate {c.moe_intermediate_size}, "
                             f"{c.n_shared_experts} shared ({c.moe_shared_expert_intermediate_size})"
                             + (f", latent {c.moe_latent_size}" if c.moe_latent_size else ""))
    if c.num_nextn_predict_layers:
        mtp = sum(1 for n in infos if n.startswith("mtp."))
        highlights["mtp"] = (f"{c.num_nextn_predict_layers} step(s) of {c.mtp_hybrid_override_pattern!r}, "
                             + (f"{mtp} tensors (speculative method 'mtp')" if mtp else "no mtp.* tensors"))
    if c.quantization_config is not None:
        highlights["quantization"] = dict(c.quantization_config).get("quant_method", "?")
    tokenizer = ("tokenizer.json" if (directory / "tokenizer.json").is_file()
                 else "bytes" if (directory / BYTE_TOKENIZER_FILE).is_file() else None)
    return {"path": str(directory), "pattern": c.hybrid_override_pattern, "layers": c.num_hidden_layers,
            "layer_kinds": {names[k]: kinds[k] for k in "M*-E" if kinds[k]}, "params": params,
            "tensors": len(infos), "bytes": sum(bytes_by_dtype.values()),
            "bytes_by_dtype": dict(sorted(bytes_by_dtype.items())), "weight_formats": dict(sorted(formats.items())),
            "quantization": _quantization(directory), "tokenizer": tokenizer, "config": highlights}


def _quantization(directory: Path) -> dict:
    """What the loader will make of the checkpoint's quantization config: method, exclusions and the file it
    comes from, or the loader's complaint (info reports it rather than failing)."""
    try:
        q = read_quant_config(directory)
    except CheckpointError as e:
        return {"method": "unsupported", "problem": "; ".join(p.strip() for p in str(e).splitlines() if p.strip())}
    if q.method == "none":
        return {"method": "none"}
    return {"method": q.method, "exclude": list(q.exclude), "source": Path(q.source.split(":")[0]).name}
