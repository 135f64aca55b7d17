"""ModelConfig (parsed from an HF Nemotron-H config.json) and ModelLevers (run-time switches)."""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from metrale_jax.errors import ConfigError
from metrale_jax.files import config_error, read_json

# Block kinds by pattern character: M = Mamba-2, * = attention, - = MLP, E = MoE.
BLOCK_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_BLOCK_NAMES = {
    "mamba": "M", "linear_attention": "M",
    "attention": "*", "full_attention": "*",
    "mlp": "-", "moe": "E",
}
# Legacy (NVIDIA remote-code) key -> current HF key.
_LEGACY_KEYS = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit",
    "mamba_dt_init_floor": "time_step_floor",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
    "attention_head_dim": "head_dim",
    "num_local_experts": "n_routed_experts",
}
_CACHE_DTYPES = ("float32", "bfloat16", "float16")


def _parse_float(field: str, value: Any) -> float:
    """A float from any JSON spelling writers use, infinities included."""
    if isinstance(value, bool):
        raise ConfigError(field, f"expected a number, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, Mapping) and set(value) == {"__float__"}:
        return _parse_float(field, value["__float__"])
    if isinstance(value, str):
        text = value.strip().lower().lstrip("+")
        if text in ("inf", "infinity"):
            return math.inf
        if text in ("-inf", "-infinity"):
            return -math.inf
        try:
            return float(text)
        except ValueError:
            pass
    raise ConfigError(field, f"expected a number (or an infinity), got {value!r}")


def _float_fields(config: ModelConfig) -> list[tuple[str, float]]:
    """(name, value) of every float the config holds that must be finite: each float field, and the low bound
    of time_step_limit (its high bound may be +inf: no upper clamp)."""
    out = [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config) if isinstance(f.default, float)]
    return out + [("time_step_limit", config.time_step_limit[0])]


def _check_finite(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ConfigError(field, f"expected a finite number, got {value!r}")


def _parse_int(field: str, value: Any, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ConfigError(field, f"expected an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(field, f"expected an integer >= {minimum}, got {value}")
    return value


def _parse_bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(field, f"expected true or false, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes and switches of a Nemotron-H model; field names follow HF's NemotronHConfig."""

    vocab_size: int
    hidden_size: int
    hybrid_override_pattern: str
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False
    residual_in_fp32: bool = False
    use_bias: bool = False
    # Mamba-2
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    expand: int = 2
    chunk_size: int = 128
    use_conv_bias: bool = True
    mamba_hidden_act: str = "silu"
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4
    mamba_ssm_cache_dtype: str = "float32"
    # attention
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    # MLP
    intermediate_size: int = 21504
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    # MoE
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    num_experts_per_tok: int = 2
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    # multi-token prediction
    num_nextn_predict_layers: int = 0
    mtp_hybrid_override_pattern: str = "*E"
    # tokens
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    pad_token_id: int | None = 0
    # raw quantization block (ModelOpt / block FP8); interpreted by the weight loader
    quantization_config: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        self._validate()

    # ---- derived sizes -------------------------------------------------------------
    @property
    def num_hidden_layers(self) -> int:
        return len(self.hybrid_override_pattern)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return tuple(BLOCK_KINDS[c] for c in self.hybrid_override_pattern)

    @property
    def d_inner(self) -> int:
        """Mamba inner width I = heads * head_dim."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the depthwise conv: x, B and C."""
        return self.d_inner + 2 * self.n_groups * self.ssm_state_size

    @property
    def in_proj_dim(self) -> int:
        """in_proj output width, split in the order (z, xBC, dt)."""
        return self.d_inner + self.conv_dim + self.mamba_num_heads

    @property
    def mamba_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.hybrid_override_pattern) if c == "M")

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, c in enumerate(self.hybrid_override_pattern) if c == "*")

    @property
    def gated_norm_group_size(self) -> int:
        return self.d_inner // self.n_groups

    # ---- parsing -------------------------------------------------------------------
    @classmethod
    def from_hf(cls, source: str | os.PathLike | Mapping[str, Any]) -> ModelConfig:
        """Parse an HF config.json (a path to the file or its directory, or the dict)."""
        if isinstance(source, Mapping):
            raw = dict(source)
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            elif not os.path.lexists(path):
                raise ConfigError("config.json", f"no such file or directory: {path}")
            raw = read_json(path, config_error)
        return cls._from_dict(raw)

    @classmethod
    def _from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        raw = dict(raw)
        for legacy, current in _LEGACY_KEYS.items():
            if legacy in raw:
                if current in raw and raw[current] != raw[legacy]:
                    raise ConfigError(legacy, f"{raw[legacy]!r} disagrees with {current}={raw[current]!r}")
                raw[current] = raw.pop(legacy)

        pattern = _pattern_from(raw)
        if "num_hidden_layers" in raw and raw["num_hidden_layers"] is not None:
            n = _parse_int("num_hidden_layers", raw["num_hidden_layers"], minimum=1)
            if n != len(pattern):
                raise ConfigError(
                    "num_hidden_layers", f"{n} disagrees with the {len(pattern)}-layer pattern {pattern!r}")

        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {"hybrid_override_pattern": pattern}
        if "mtp_hybrid_override_pattern" in raw or "mtp_layers_block_type" in raw:
            kwargs["mtp_hybrid_override_pattern"] = _pattern_from(
                raw, pattern_key="mtp_hybrid_override_pattern", list_key="mtp_layers_block_type")
        for name, value in raw.items():
            if name not in fields or name in kwargs:
                continue
            kwargs[name] = _coerce(name, fields[name], value)
        for required in ("vocab_size", "hidden_size"):
            if required not in kwargs:
                raise ConfigError(required, "missing from config.json")
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config as an HF config.json dict (current key names)."""
        out: dict[str, Any] = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h"}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "quantization_config" and value is None:
                continue
            if f.name == "time_step_limit":
                value = [v if math.isfinite(v) else "inf" for v in value]
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, Mapping):
                value = dict(value)
            out[f.name] = value
        out["num_hidden_layers"] = self.num_hidden_layers
        return out

    # ---- validation ----------------------------------------------------------------
    def _validate(self):
        for name in ("vocab_size", "hidden_size", "max_position_embeddings"):
            _parse_int(name, getattr(self, name), minimum=1)
        for name, value in _float_fields(self):
            _check_finite(name, value)
        if math.isnan(self.time_step_limit[1]) or self.time_step_limit[1] == -math.inf:
            raise ConfigError("time_step_limit", f"expected a high bound that is a number or +inf, got "
                                                 f"{self.time_step_limit[1]}")
        if not self.hybrid_override_pattern:
            raise ConfigError("hybrid_override_pattern", "the model has no layers")
        self._validate_token_ids()
        if _parse_int("num_nextn_predict_layers", self.num_nextn_predict_layers, minimum=0) and \
                not self.mtp_hybrid_override_pattern:
            raise ConfigError("mtp_hybrid_override_pattern", f"an MTP step has no blocks, but "
                                                             f"num_nextn_predict_layers = {self.num_nextn_predict_layers}")
        bad = sorted(set(self.hybrid_override_pattern) - set(BLOCK_KINDS))
        if bad:
            raise ConfigError("hybrid_override_pattern", f"unknown block characters {bad}; expected M, *, - or E")
        if not self.layer_norm_epsilon > 0:
            raise ConfigError("layer_norm_epsilon", f"expected > 0, got {self.layer_norm_epsilon}")
        kinds = set(self.hybrid_override_pattern)
        if "M" in kinds:
            for name in ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "chunk_size"):
                _parse_int(name, getattr(self, name), minimum=1)
            _parse_int("conv_kernel", self.conv_kernel, minimum=2)
            if self.mamba_num_heads % self.n_groups:
                raise ConfigError(
                    "n_groups", f"{self.n_groups} does not divide mamba_num_heads={self.mamba_num_heads}")
            if self.mamba_hidden_act not in ("silu", "swish"):
                raise ConfigError("mamba_hidden_act", f"only silu is supported, got {self.mamba_hidden_act!r}")
            lo, hi = self.time_step_limit
            if not (0.0 <= lo <= hi):
                raise ConfigError("time_step_limit", f"expected 0 <= low <= high, got {self.time_step_limit}")
            if self.mamba_ssm_cache_dtype not in _CACHE_DTYPES:
                raise ConfigError(
                    "mamba_ssm_cache_dtype", f"expected one of {_CACHE_DTYPES}, got {self.mamba_ssm_cache_dtype!r}")
        if "*" in kinds:
            for name in ("num_attention_heads", "num_key_value_heads", "head_dim"):
                _parse_int(name, getattr(self, name), minimum=1)
            if self.num_attention_heads % self.num_key_value_heads:
                raise ConfigError(
                    "num_key_value_heads",
                    f"{self.num_key_value_heads} does not divide num_attention_heads={self.num_attention_heads}")
        if kinds & {"-", "E"} and self.mlp_hidden_act != "relu2":
            raise ConfigError("mlp_hidden_act", f"only relu2 is supported, got {self.mlp_hidden_act!r}")
        if "-" in kinds:
            _parse_int("intermediate_size", self.intermediate_size, minimum=1)
        if "E" in kinds or self.num_nextn_predict_layers:
            self._validate_moe()

    def _validate_token_ids(self):
        """bos / eos / pad ids (where given) are rows of the embedding table: integers in [0, vocab_size). Outside,
        the padding the model adds to a batch, or the BOS the tokenizer prepends, would index past the table."""
        eos = self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)
        for name, ids in (("bos_token_id", (self.bos_token_id,)), ("eos_token_id", eos),
                          ("pad_token_id", (self.pad_token_id,))):
            for i in ids:
                if i is not None and not (_parse_int(name, i) >= 0 and i < self.vocab_size):
                    raise ConfigError(name, f"expected a token id in [0, {self.vocab_size}) (vocab_size), got {i}")

    def _validate_moe(self):
        e = _parse_int("n_routed_experts", self.n_routed_experts, minimum=1)
        _parse_int("moe_intermediate_size", self.moe_intermediate_size, minimum=1)
        _parse_int("n_shared_experts", self.n_shared_experts, minimum=0)
        if self.n_shared_experts:
            _parse_int("moe_shared_expert_intermediate_size", self.moe_shared_expert_intermediate_size, minimum=1)
        if self.moe_latent_size is not None:
            _parse_int("moe_latent_size", self.moe_latent_size, minimum=1)
        groups = _parse_int("n_group", self.n_group, minimum=1)
        if e % groups:
            raise ConfigError("n_group", f"{groups} does not divide n_routed_experts={e}")
        topk_group = _parse_int("topk_group", self.topk_group, minimum=1)
        if topk_group > groups:
            raise ConfigError("topk_group", f"{topk_group} exceeds n_group={groups}")
        k = _parse_int("num_experts_per_tok", self.num_experts_per_tok, minimum=1)
        if k > topk_group * (e // groups):
            raise ConfigError(
                "num_experts_per_tok",
                f"{k} exceeds the {topk_group * (e // groups)} experts in the topk_group={topk_group} chosen groups")


def _pattern_from(raw: dict[str, Any], pattern_key: str = "hybrid_override_pattern",
                  list_key: str = "layers_block_type") -> str:
    pattern = raw.get(pattern_key)
    blocks = raw.get(list_key)
    from_list = None
    if blocks is not None:
        if not isinstance(blocks, list) or not all(isinstance(b, str) for b in blocks):
            raise ConfigError(list_key, f"expected a list of block names, got {blocks!r}")
        unknown = sorted({b for b in blocks if b not in _BLOCK_NAMES})
        if unknown:
            raise ConfigError(list_key, f"unknown block types {unknown}; expected one of {sorted(_BLOCK_NAMES)}")
        from_list = "".join(_BLOCK_NAMES[b] for b in blocks)
    if pattern is not None:
        if not isinstance(pattern, str):
            raise ConfigError(pattern_key, f"expected a string like 'M-M*-', got {pattern!r}")
        bad = sorted(set(pattern) - set(BLOCK_KINDS))
        if bad:
            raise ConfigError(pattern_key, f"unknown block characters {bad}; expected M, *, - or E")
        if from_list is not None and from_list != pattern:
            raise ConfigError(list_key, f"{from_list!r} disagrees with {pattern_key}={pattern!r}")
        return pattern
    if from_list is None:
        raise ConfigError(pattern_key, f"config.json has neither {pattern_key} nor {list_key}")
    return from_list


def _coerce(name: str, field: dataclasses.Field, value: Any) -> Any:
    if name == "time_step_limit":
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ConfigError(name, f"expected [low, high], got {value!r}")
        return (_parse_float(name, value[0]), _parse_float(name, value[1]))
    if name == "eos_token_id":
        if isinstance(value, list):
            return tuple(_parse_int(name, v) for v in value)
        return None if value is None else _parse_int(name, value)
    if name == "quantization_config":
        if value is not None and not isinstance(value, Mapping):
            raise ConfigError(name, f"expected an object, got {value!r}")
        return value
    default = field.default
    if value is None and name in ("bos_token_id", "pad_token_id", "moe_latent_size"):
        return None
    if isinstance(default, bool):
        return _parse_bool(name, value)
    if isinstance(default, int) or name == "moe_latent_size":
        return _parse_int(name, value)
    if isinstance(default, float):
        return _parse_float(name, value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ConfigError(name, f"expected a string, got {value!r}")
        return value
    return value


# ---- levers ------------------------------------------------------------------------------
_FP8_SSM_MODES = ("off", "decode", "full")
_NVFP4_ACTIVATIONS = ("bf16", "nvfp4")
_FP8_ACTIVATIONS = ("e4m3", "bf16")
_FP8_DECODE_ACTIVATIONS = ("bf16", "e4m3")
_GATED_NORM_QUANT = ("group", "arm", "off")
_KERNEL_MODES = ("auto", "pallas", "triton", "mosaic", "interpret", "reference")  # = registry.MODES


@dataclasses.dataclass(frozen=True)
class ModelLevers:
    """Run-time switches. `from_env` reads the METRALE_* variables named beside each field."""

    native_fp8_ssm: str = "full"      # METRALE_NEMOTRON_NATIVE_FP8_SSM: off | decode | full
    graphs: bool = True               # METRALE_GRAPHS: compiled executables (False: run eagerly)
    kernels: str = "auto"             # METRALE_KERNELS: auto | pallas | triton | mosaic | interpret | reference
    chunk_size: int | None = None     # METRALE_CHUNK_SIZE: SSD chunk length (None: the config's)
    prefill_token_budget: int = 4096  # METRALE_PREFILL_TOKEN_BUDGET: tokens per prefill step
    # METRALE_NVFP4_ACTIVATIONS: NVFP4 weights serve bf16 activations (w4a16, the default: Hopper has no FP4 math,
    # so quantizing activations only adds error) or activations quantized to NVFP4 per 16 on the fly (the W4A4 arm,
    # with the checkpoint's static input_scale where it has one: the numbers a ModelOpt NVFP4 model was calibrated for)
    nvfp4_activations: str = "bf16"
    # METRALE_GATED_NORM_QUANT: what the Mamba gated norm in front of an out_proj arm that quantizes its activations
    # to E4M3 (fp8_gemm_t, w8a16_gemm_pipelined) emits: "group" E4M3 with one scale per row per norm group (the
    # per-group kernel on the bf16 norm's parallel grid; the arm rescales its accumulator per group), "arm" the
    # arm's own quantization (the whole-row kernel: slower end to end than the bf16 norm + the arm's quantizer on
    # the H200, benchmarks/notes/quant_prefill.md), "off" the bf16 norm, the arm quantizes
    gated_norm_quant: str = "group"
    # METRALE_FP8_ACTIVATIONS: what FP8 weights' prefill arms do with the activations: "e4m3" rounds them to E4M3 (per
    # row, or per row per 128 columns) for the FP8 matrix units (fp8_gemm_t, w8a16_gemm_pipelined), as vLLM serves
    # block FP8; "bf16" keeps them (w8a16_gemm: weights dequantized in the kernel, bf16 matrix units), so that
    # prefill has the weight-only W8A16 numerics decode has and forward / score match the dequantized model
    fp8_activations: str = "e4m3"
    # METRALE_FP8_DECODE_ACTIVATIONS: what FP8 weights' decode GEMV does with the activations: "bf16" keeps them
    # (w8a16_gemv, weights widened to bf16 in the kernel: the dequantized model's numbers), "e4m3" rounds them per
    # row per 128 columns as the prefill arms do and runs on the FP8 matrix units (w8a8_gemv). Rows stay
    # batch-invariant either way; a tensor-parallel share keeps w8a16_gemv. benchmarks/notes/gemv.md
    fp8_decode_activations: str = "bf16"

    _ENV = {
        "native_fp8_ssm": "METRALE_NEMOTRON_NATIVE_FP8_SSM",
        "graphs": "METRALE_GRAPHS",
        "kernels": "METRALE_KERNELS",
        "chunk_size": "METRALE_CHUNK_SIZE",
        "prefill_token_budget": "METRALE_PREFILL_TOKEN_BUDGET",
        "nvfp4_activations": "METRALE_NVFP4_ACTIVATIONS",
        "gated_norm_quant": "METRALE_GATED_NORM_QUANT",
        "fp8_activations": "METRALE_FP8_ACTIVATIONS",
        "fp8_decode_activations": "METRALE_FP8_DECODE_ACTIVATIONS",
    }

    def __post_init__(self):
        if self.native_fp8_ssm not in _FP8_SSM_MODES:
            raise ConfigError("native_fp8_ssm", f"expected one of {_FP8_SSM_MODES}, got {self.native_fp8_ssm!r}")
        if self.kernels not in _KERNEL_MODES:
            raise ConfigError("kernels", f"expected one of {_KERNEL_MODES}, got {self.kernels!r}")
        if self.nvfp4_activations not in _NVFP4_ACTIVATIONS:
            raise ConfigError("nvfp4_activations", f"expected one of {_NVFP4_ACTIVATIONS}, "
                                                   f"got {self.nvfp4_activations!r}")
        if self.fp8_activations not in _FP8_ACTIVATIONS:
            raise ConfigError("fp8_activations", f"expected one of {_FP8_ACTIVATIONS}, got {self.fp8_activations!r}")
        if self.fp8_decode_activations not in _FP8_DECODE_ACTIVATIONS:
            raise ConfigError("fp8_decode_activations", f"expected one of {_FP8_DECODE_ACTIVATIONS}, "
                                                        f"got {self.fp8_decode_activations!r}")
        if self.gated_norm_quant not in _GATED_NORM_QUANT:
            raise ConfigError("gated_norm_quant", f"expected one of {_GATED_NORM_QUANT}, got {self.gated_norm_quant!r}")
        if not isinstance(self.graphs, bool):
            raise ConfigError("graphs", f"expected a bool, got {self.graphs!r}")
        if self.chunk_size is not None:
            _parse_int("chunk_size", self.chunk_size, minimum=1)
        _parse_int("prefill_token_budget", self.prefill_token_budget, minimum=1)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> ModelLevers:
        """Levers from METRALE_* variables; keyword overrides win over the environment."""
        env = os.environ if environ is None else environ
        kwargs: dict[str, Any] = {}
        for name, var in cls._ENV.items():
            if var not in env:
                continue
            text = env[var].strip()
            if name == "graphs":
                low = text.lower()
                if low not in ("0", "1", "true", "false", "on", "off"):
                    raise ConfigError(var, f"expected 0/1/true/false/on/off, got {text!r}")
                kwargs[name] = low in ("1", "true", "on")
            elif name in ("chunk_size", "prefill_token_budget"):
                try:
                    kwargs[name] = int(text)
                except ValueError:
                    raise ConfigError(var, f"expected an integer, got {text!r}") from None
            else:
                kwargs[name] = text.lower()
        kwargs.update(overrides)
        try:
            return cls(**kwargs)
        except ConfigError as e:
            var = cls._ENV.get(e.field)
            if var in env and e.field not in overrides:
                raise ConfigError(var, str(e).split(": ", 1)[1]) from None
            raise

    def ssm_chunk_size(self, config: ModelConfig) -> int:
        return self.chunk_size or config.chunk_size
