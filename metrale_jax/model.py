"""NemotronH: the Nemotron-H layer stack (embeddings, one block per pattern character, norm_f, lm_head).

Entry points (all logits float32):
  forward(ids [B, T]) -> [B, T, V]                      no cache
  new_cache(max_slots, max_len) -> ModelCache           slot-indexed Mamba states, keys/values, lengths
  prefill(cache, slots, ids, lengths) -> ([B, V], cache)   right-padded rows; the Mamba layers see them
                                                        packed (cu_seqlens), so padding never enters a state
  decode(cache, slots, tokens) -> ([B, V], cache)       one token per sequence at its own position
  generate(prompts, ...), score(ids, lengths)           batch jobs on top, jit-compiled per shape bucket
The model is an nnx.Module and so a pytree: the compiled steps take it as an argument. A cache passed
to a compiled step is donated (updated in place); use the cache that comes back.
With a mesh (from_pretrained / from_config / NemotronH(..., mesh=...)) the weights and the cache are split
over the mesh's devices (tensor and expert parallelism, sharding.py) and every step runs through shard_map;
the entry points and step functions keep their signatures. On a mesh with a data-parallel axis (make_mesh(tp=,
dp=)) forward and score split their rows over the dp replicas, prefill / decode on a caller's cache run on every
replica alike, and generate serves each replica its share (runtime/engine_dp.py). Such a model's Mamba in_proj /
conv rows are stored in a device-major order: run it through its entry points or step functions, not its layers.
A checkpoint with MTP weights (num_nextn_predict_layers > 0, mtp.* tensors) gives `model.mtp`, a
layers.mtp.NemotronMTP (else None), and `new_mtp_cache` its state: the engine drafts with it
(SpeculativeConfig(method="mtp")); a model split over a mesh keeps no MTP head.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from metrale_jax import adapters as lora_adapters
from metrale_jax import data_parallel, sharding, sharding_quant
from metrale_jax.arguments import as_array, integer, model_dtype, prompts_ids
from metrale_jax.config import ModelConfig, ModelLevers
from metrale_jax.errors import CheckpointError, ConfigError, ShapeError, SlotError
from metrale_jax.init import iter_random_tensors, random_tensors  # noqa: F401  (random_tensors: API)
from metrale_jax.hub import resolve_checkpoint
from metrale_jax.layers.attention import NemotronAttentionLayer
from metrale_jax.layers import lora
from metrale_jax.layers.blocks import open_block
from metrale_jax.layers.capabilities import ModelCapabilities, combine_capabilities
from metrale_jax.layers.install import cast_tensors, infer_quant_config, mamba_layer
from metrale_jax.layers.mamba2 import NemotronMamba2Layer
from metrale_jax.layers.mlp import NemotronMLPLayer
from metrale_jax.layers.moe import NemotronMoELayer
from metrale_jax.layers.mtp import MtpCache, NemotronMTP
from metrale_jax.layers.projection import Projection
from metrale_jax.layers.stack import DecodeRows, PrefillRows, run_blocks
from metrale_jax.runtime.executables import bucket
from metrale_jax.state.cache import ModelCache
from metrale_jax.tokenizer import load_tokenizer
from metrale_jax.weights.checkpoint import (
    EXPERTS_PATTERN, MAX_SHARD_BYTES, QUANTIZED_SUFFIXES, checkpoint_quantization, checkpoint_tensors, has_mtp,
    is_quantized, layer_tensors, layer_weights, missing_tensors, mtp_layer_tensors, mtp_weights,
    parameter_count, read_checkpoint, unsupported, write_checkpoint)
from metrale_jax.weights.containers import DenseWeight, Nvfp4Weight, StackedExperts, W4a4Weight
from metrale_jax.weights.quant_config import QuantConfig
from pallas_kernels import registry

LAYER_CLASSES = {"M": NemotronMamba2Layer, "*": NemotronAttentionLayer, "-": NemotronMLPLayer,
                 "E": NemotronMoELayer}

# How often each compiled step was traced (a trace = a compile); tests assert that buckets hold.
TRACE_COUNTS: collections.Counter = collections.Counter()


@dataclasses.dataclass(frozen=True)
class Generation:
    """One prompt's continuation: new token ids (the stop token excluded), their text when the prompt
    was a string (ending before a stop string), and why it stopped: 'eos' (an eos id), 'stop' (a stop
    token or string the caller gave) or 'length'. With SamplingParams.logprobs: logprobs[i] is tokens[i]'s
    log-probability under the model's raw distribution (log_softmax of the logits, before temperature and
    filters: what `score` gives for the same tokens), and with logprobs = n > 0 top_logprobs[i] the n most
    likely (token id, log-prob) pairs at that position, best first."""

    tokens: list[int]
    text: str | None
    finish_reason: str
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None



def memory_limit(devices) -> int | None:
    """The bytes the devices can hold in all: their allocators' limits (GPU), else the host's physical memory
    (CPU devices share it), else None when neither is known."""
    stats = [d.memory_stats() for d in devices]
    if all(st and st.get("bytes_limit") for st in stats):
        return sum(int(st["bytes_limit"]) for st in stats)
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_cache_fits(config, max_slots: int, max_len: int, dtype, tp) -> None:
    """Refuses (ConfigError naming max_len) a cache larger than the memory of the devices that would hold it, before
    allocating: max_len is bounded only by max_position_embeddings, which a config may set to 10**15."""
    shapes = jax.eval_shape(lambda: ModelCache.for_config(config, max_slots, max_len, dtype))
    need = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(shapes))
    devices = jax.devices() if tp is None else list(tp.mesh.devices.flat)
    limit = memory_limit(devices[:1] if tp is None else devices)
    if limit is not None and need > limit:
        raise ConfigError("max_len", f"a cache of {max_slots} slots x {max_len} positions needs {need / 2**30:,.1f} "
                                     f"GiB, more than the {limit / 2**30:,.1f} GiB its devices hold; ask for fewer "
                                     f"slots or positions")

class NemotronH(nnx.Module):
    """A Nemotron-H causal LM built from HF-named tensors (see weights/checkpoint.py for the names)."""

    def __init__(self, config: ModelConfig, tensors: Mapping[str, object], *, dtype=jnp.bfloat16,
                 levers: ModelLevers | None = None, tokenizer=None, notes: Sequence[str] = (), mesh=None,
                 shard_of: sharding.DeviceShare | None = None, quant_config: QuantConfig | None = None):
        """tensors: HF names -> arrays; a linear module's weight may instead be a container (DenseWeight,
        Fp8Weight, Nvfp4Weight, W4a4Weight), installed in the arms `_mamba_layer` / Projection.set_weight give it.
        quant_config: the quantization those containers came in (what save_pretrained writes); default: inferred
        from the containers. mesh: split the model over the mesh's devices (quantized containers too:
        sharding_quant; tensors are placed on their shards unless they come as sharding.ShardedTensors). shard_of:
        build one device's view instead (sharding.py does)."""
        quantized = sorted(n for n, v in tensors.items() if is_quantized(v))
        scales = sorted(n for n in tensors if n.rsplit(".", 1)[-1] in QUANTIZED_SUFFIXES)
        if scales:
            raise CheckpointError([f"{n}: a scale in the checkpoint layout; give the module's container (Fp8Weight, "
                                   f"Nvfp4Weight) under its .weight name, as from_pretrained does" for n in scales])
        self.quant_config = quant_config if quant_config is not None else infer_quant_config(tensors, quantized)
        self.config = config
        self.tp = None if mesh is None else sharding.tensor_parallel(mesh)   # steps run through shard_map
        self.vocab_axis = shard_of.axis if shard_of is not None and shard_of.vocab else None   # a view's lm_head
        self.levers = ModelLevers.from_env() if levers is None else levers
        if self.levers.nvfp4_activations == "nvfp4":           # every NVFP4 linear on the W4A4 arm
            tensors = {n: W4a4Weight(v) if isinstance(v, Nvfp4Weight) else v for n, v in tensors.items()}
        self.dtype = model_dtype(dtype)
        self.tokenizer = tokenizer
        problems = unsupported(config)
        if problems:
            raise ConfigError("config", "; ".join(problems))
        if has_mtp(tensors) and (mesh is not None or shard_of is not None):
            tensors = {n: v for n, v in tensors.items() if not n.startswith("mtp.")}
            notes = (*notes, "the MTP head (mtp.*) is not kept on a mesh: tensor parallelism splits the main "
                             "blocks only")
        if has_mtp(tensors) and not config.num_nextn_predict_layers:
            raise CheckpointError([f"{n}: an MTP tensor, but the config has num_nextn_predict_layers = 0"
                                   for n in sorted(tensors) if n.startswith("mtp.")])
        self.load_notes = tuple(notes)
        self.adapters: tuple[lora_adapters.AdapterInfo, ...] = ()     # LoRA adapters, in load order
        self.active_adapter: str | None = None                          # the one the entry points apply
        missing = missing_tensors(config, tensors)
        if missing:
            raise CheckpointError(missing)
        self.shard_formats = ()                    # a sharded model's quantized containers (sharding_quant)
        if self.tp is not None and isinstance(tensors, sharding.ShardedTensors):
            self.shard_formats = sharding_quant.container_formats(tensors)
        elif self.tp is not None and any(is_quantized(v) for v in tensors.values()):
            tensors, self.shard_formats = sharding_quant.shard_quantized(config, tensors, self.tp, self.dtype,
                                                                         self.levers)
        elif self.tp is not None:
            tensors = sharding.shard_tensors(config, tensors, self.tp, self.dtype)
        t = cast_tensors(config, tensors, self.dtype)
        self.embeddings = nnx.Param(t["backbone.embeddings.weight"])
        # a sharded model's blocks hold every device's share side by side (groups / kv heads repeated per device)
        stored = config if self.tp is None else sharding.storage_config(config, self.tp.size)
        layers = []
        for i, kind in enumerate(config.hybrid_override_pattern):
            norm, weights = layer_weights(stored, i, t)
            kw = {"expert_shards": shard_of.size} if shard_of is not None and kind == "E" else {}
            if kind == "M":
                layer = mamba_layer(norm, weights, stored, i, self.levers, self.dtype)
            else:
                layer = LAYER_CLASSES[kind](norm, weights, stored, i, levers=self.levers, **kw)
            if shard_of is not None and shard_of.size > 1:    # one device's share of one: the unsplit layer
                layer.tp_axis = shard_of.axis
                if kind == "M" and shard_of.norm_group is not None:
                    layer.norm_group = shard_of.norm_group
            layers.append(layer)
        self.layers = nnx.List(layers)
        self.norm_f = nnx.Param(t["backbone.norm_f.weight"])
        if config.tie_word_embeddings:
            self.lm_head = nnx.data(None)
        else:
            self.lm_head = nnx.data(Projection("lm_head", config.vocab_size, config.hidden_size,
                                               kernels=self.levers.kernels))
            self.lm_head.set_weight(t["lm_head.weight"])
        if has_mtp(t):
            self.mtp = NemotronMTP(config, *mtp_weights(config, t), levers=self.levers)
        else:
            self.mtp = nnx.data(None)              # no MTP head: MTP drafting raises ConfigError
        if self.levers.fp8_activations != "e4m3" or self.levers.fp8_decode_activations != "bf16":
            for _, module in nnx.iter_modules(self):   # every projection (blocks, lm_head, MTP head)
                if isinstance(module, Projection):
                    module.set_fp8_activations(self.levers.fp8_activations)
                    module.set_fp8_decode_activations(self.levers.fp8_decode_activations)
        if self.tp is not None:
            sharding.check_placement(self)

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, dtype=jnp.bfloat16, levers: ModelLevers | None = None,
                        *, progress: bool | None = None, mesh=None, check_finite: bool = True) -> NemotronH:
        """Load config.json + model.safetensors (or a sharded index) and the tokenizer if one is there.
        directory: a checkpoint directory, or a hub repository name 'org/name' (hub.resolve_checkpoint: the local
        HF cache first, then a download unless HF_HUB_OFFLINE; ModelNotFoundError when neither).
        A quantized checkpoint (ModelOpt FP8 / NVFP4, block FP8) keeps its linear weights quantized in the
        arms `_mamba_layer` and Projection.set_weight choose (levers.native_fp8_ssm for the Mamba ones).
        mesh: split the model over its devices, each tensor read from the memory map straight to its shards (each
        device's rows / columns / experts only; quantized containers placed by sharding_quant).
        check_finite: a weight holding a NaN or an infinity (as loaded, after the cast to `dtype`) is a
        CheckpointError naming it, instead of a model whose every logit is NaN. It reads each weight once more,
        where it lives (an elementwise test per tensor, one host sync): on the built-in model (57 tensors, 5 MB,
        CPU) 5-9 ms of a 30-40 ms warm load; on a GPU the read runs at memory bandwidth. On by default: a silent
        NaN model costs far more than that."""
        dtype = model_dtype(dtype)
        directory = resolve_checkpoint(directory)
        config = ModelConfig.from_hf(directory)
        qcfg = checkpoint_quantization(directory)
        levers = ModelLevers.from_env() if levers is None else levers
        tensors, notes = read_checkpoint(directory, config, dtype, progress=progress, mesh=mesh, qcfg=qcfg,
                                         check_finite=check_finite, levers=levers)
        return cls(config, tensors, dtype=dtype, levers=levers, tokenizer=load_tokenizer(directory, config),
                   notes=notes, mesh=mesh, quant_config=qcfg)

    @classmethod
    def from_config(cls, config: ModelConfig, key: jax.Array, dtype=jnp.bfloat16, levers: ModelLevers | None = None,
                    *, tokenizer=None, mesh=None) -> NemotronH:
        """Random weights (see `random_tensors`; the same key gives the same weights with or without a mesh).
        mesh: split the model over its devices, each tensor placed on its shards as it is drawn (no MTP head)."""
        dtype = model_dtype(dtype)
        if mesh is None:
            tensors = random_tensors(config, key, dtype)
        else:
            tensors = sharding.shard_tensors(config, iter_random_tensors(config, key, mtp=False),
                                             sharding.tensor_parallel(mesh), dtype)
        return cls(config, tensors, dtype=dtype, levers=levers, tokenizer=tokenizer, mesh=mesh)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every weight under its HF name in the HF layout (host numpy arrays); a quantized linear module as
        its checkpoint tensors (weight + scales, in `checkpoint_quant_config()`'s layout)."""
        return checkpoint_tensors(self.checkpoint_containers(), self.checkpoint_quant_config())

    def checkpoint_containers(self) -> dict[str, object]:
        """Every weight under its HF name in the checkpoint's shapes and row order, a quantized linear module as its
        container (Fp8Weight, Nvfp4Weight; a routed expert's own): what NemotronH(config, tensors) takes back, e.g.
        to split an unsharded model over a mesh."""
        c = self.config
        out: dict[str, object] = {"backbone.embeddings.weight": self.embeddings[...]}
        stored = c if self.tp is None else sharding.storage_config(c, self.tp.size)
        for i, layer in enumerate(self.layers):
            weights = layer.checkpoint_weights()
            if self.tp is not None:          # to the host whole: slicing a split E4M3 array on the device loses -0
                weights = jax.tree.map(np.asarray, weights)
            out.update(layer_tensors(stored, i, layer.input_norm[...], weights))
        out["backbone.norm_f.weight"] = self.norm_f[...]
        if self.lm_head is not None:
            out["lm_head.weight"] = self.lm_head.base_weight()
        if self.mtp is not None:
            blocks = [(layer.input_norm[...], layer.checkpoint_weights()) for layer in self.mtp.layers]
            out.update(mtp_layer_tensors(c, blocks, self.mtp.step_weights()))
        out = {n: v.weight if isinstance(v, DenseWeight) else v for n, v in out.items()}
        if self.tp is not None:                          # undo the device-major row order and the padding
            out = {n: sharding_quant.unshard(n, v, c, self.tp) for n, v in out.items()}
        return out

    def checkpoint_quant_config(self) -> QuantConfig:
        """The quantization save_pretrained writes: the one the model was loaded in, with routed experts held
        dense (dequantized at load) listed as excluded."""
        q = self.quant_config
        if q is None:
            raise ConfigError("quant_config", "the model's linear weights mix quantization formats; a checkpoint "
                                              "holds one (build the model with quant_config=...)")
        dense_experts = any(isinstance(l, NemotronMoELayer) and not isinstance(l.moe_weights().experts_up,
                                                                                 StackedExperts)
                            for l in self.layers)
        if q.method != "none" and dense_experts and not q.is_excluded("backbone.layers.0.mixer.experts.0.up_proj"):
            q = dataclasses.replace(q, exclude=(*q.exclude, EXPERTS_PATTERN))
        return q

    def save_pretrained(self, directory: str | os.PathLike, *, max_shard_bytes: int = MAX_SHARD_BYTES,
                        overwrite: bool = False) -> list[Path]:
        """config.json + model.safetensors (sharded with an index above max_shard_bytes) + the tokenizer; a
        quantized model writes its quantized tensors and quantization config (loads back to the same weights).
        Atomic (weights/checkpoint.write_checkpoint): a directory holding a checkpoint is replaced only with
        overwrite=True; its other files are kept."""
        tokenizer = self.tokenizer if hasattr(self.tokenizer, "save") else None
        return write_checkpoint(directory, self.config, self.state_dict(), torch_dtype=self.dtype.name,
                                max_shard_bytes=max_shard_bytes, qcfg=self.checkpoint_quant_config(),
                                tokenizer=tokenizer, overwrite=overwrite)

    # ---- properties --------------------------------------------------------------------------
    @property
    def capabilities(self) -> ModelCapabilities:
        return combine_capabilities(self.layers)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_params(self) -> int:
        """Parameters of the checkpoint this model holds (its MTP head's included; quantized weights count their
        logical elements): what `metrale-jax info` counts in the files."""
        return parameter_count(self.config, mtp=self.mtp is not None)

    def new_cache(self, max_slots: int, max_len: int, *, ssm_state_dtype: str | None = None) -> ModelCache:
        """max_slots sequences (plus the padding slot) of up to max_len tokens each; on a sharded model, created
        on its shards (SSM pool by head, conv pool by channel in device-major order, KV pool by kv head).
        max_len is at most the config's max_position_embeddings (ConfigError before anything is allocated).
        ssm_state_dtype: the Mamba state's dtype ('float32', 'bfloat16', 'float16'; default the config's
        mamba_ssm_cache_dtype). bfloat16 halves the state's bytes, which dominate large decode batches, at the
        cost of rounding the state after every step (benchmarks/notes/runtime.md)."""
        integer("max_slots", max_slots, 1)
        integer("max_len", max_len, 1, self.config.max_position_embeddings, "the model's max_position_embeddings")
        config = self.config
        if ssm_state_dtype is not None:
            config = dataclasses.replace(config, mamba_ssm_cache_dtype=str(ssm_state_dtype))
        _check_cache_fits(config, max_slots, max_len, self.dtype, self.tp)
        if self.tp is not None:
            return sharding.new_cache(config, self.tp, max_slots, max_len, self.dtype)
        return ModelCache.for_config(config, max_slots, max_len, self.dtype)

    def new_mtp_cache(self, max_slots: int, max_len: int) -> MtpCache:
        """The MTP head's slot-indexed state (keys/values of its attention blocks, the carried hidden state) for
        a cache of max_slots sequences of up to max_len tokens; ConfigError when the model has no MTP head."""
        if self.mtp is None:
            n = self.config.num_nextn_predict_layers
            why = ("the config has num_nextn_predict_layers = 0" if not n else
                   f"the config has {n} MTP step(s), but the checkpoint held no mtp.* tensors"
                   + (" (or the model is split over a mesh)" if self.tp is not None else ""))
            raise ConfigError("mtp", f"this model has no MTP head: {why}")
        return MtpCache.for_config(self.config, max_slots, max_len, self.dtype)

    def eos_ids(self) -> frozenset[int]:
        eos = self.config.eos_token_id
        ids = set(eos if isinstance(eos, tuple) else () if eos is None else (eos,))
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_id", None) is not None:
            ids.add(int(self.tokenizer.eos_id))
        return frozenset(ids)

    def _step(self, name: str):
        """The compiled step `name`, or the plain function when graphs are off (levers) or vetoed."""
        eager = not self.levers.graphs or (name == "decode" and self.capabilities.decode_graph_veto)
        return _IMPLS[name] if eager else _JITTED[name]

    # ---- LoRA adapters (adapters.py) -----------------------------------------------------------
    def load_adapter(self, directory: str | os.PathLike, name: str | None = None) -> str:
        """Load a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) as an overlay on the
        projections it targets, under `name` (default: the directory's name), and make it the active one.
        CheckpointError (naming each tensor) for an adapter whose modules, shapes or rank do not fit this model."""
        return lora_adapters.load(self, directory, name)

    def add_adapter(self, name: str, *, r: int, lora_alpha: float, target_modules, key: jax.Array,
                    use_rslora: bool = False) -> str:
        """A fresh adapter to train (A random, B zero, as PEFT initialises them), active once made."""
        return lora_adapters.create(self, name, r=r, lora_alpha=lora_alpha, target_modules=target_modules,
                                    key=key, use_rslora=use_rslora)

    def set_adapter(self, name: str | None) -> None:
        """The adapter forward / prefill / decode / score / generate apply to every row (None: the base)."""
        lora_adapters.set_active(self, name)

    def merge_adapter(self, name: str | None = None) -> None:
        """Fold an adapter (default: the active one) into the dense base weights (quantized: WeightFormatError)."""
        lora_adapters.merge(self, name)

    def unload_adapter(self, name: str | None = None) -> None:
        """Remove an adapter (None: all); merged weights are put back as they were, bit for bit."""
        lora_adapters.remove(self, name)

    def save_adapter(self, directory: str | os.PathLike, name: str | None = None, *, overwrite: bool = False
                     ) -> list:
        """An adapter (default: the active one) as a PEFT adapter directory; one that already holds an adapter is
        replaced only with overwrite=True (its other files are kept)."""
        return lora_adapters.save(self, directory, name, overwrite=overwrite)

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, input_ids) -> jax.Array:
        """Logits [B, T, V] float32 for full rows, no cache (the active adapter, if any, on every row)."""
        ids = self._check_ids(input_ids)
        B = ids.shape[0]
        rows = _replica_rows(self, B)                 # a multiple of the replicas (dp): each runs rows / dp
        if rows != B:
            ids = np.concatenate([ids, np.full((rows - B, ids.shape[1]), self.config.pad_token_id or 0, np.int32)])
        out = self._step("forward")(self, jnp.asarray(ids), **self._adapter_table(rows))
        return out if rows == B else out[:B]

    def _adapter_table(self, num_slots: int) -> dict:
        """The `adapters` keyword of a step: every slot on the active adapter; nothing when none is active (so a
        model without adapters runs the very steps it ran before they existed)."""
        table = lora_adapters.slot_table(self, num_slots)
        return {} if table is None else {"adapters": table}

    # ---- prefill / decode --------------------------------------------------------------------
    def prefill(self, cache: ModelCache, slots, ids, lengths=None, *, all_logits: bool = False,
                continue_from_cache: bool = False) -> tuple[jax.Array, ModelCache]:
        """Prefill right-padded rows ids [B, T] (lengths [B], default T) into `slots` [B].

        New sequences start at position 0; with continue_from_cache they continue from each slot's
        cached length (chunked prefill). Returns the logits of each row's last real token [B, V]
        (all_logits: [B, T, V]) and the new cache. A row of the padding slot must have length 0 (a no-op row);
        a row of a live slot at least 1 token (SlotError / ShapeError otherwise).
        """
        ids = self._check_ids(ids)
        B, T = ids.shape
        lengths = _vector("lengths", np.full((B,), T) if lengths is None else lengths, B)
        if lengths.min() < 0 or lengths.max() > T:
            raise ShapeError(f"lengths: each must lie in [0, {T}], got {lengths.tolist()}")
        slots = self._check_slots(cache, slots, B)
        _check_prefill_rows(slots, lengths, cache.padding_slot)
        starts = np.asarray(cache.seq_lens)[slots] if continue_from_cache else np.zeros(B, np.int64)
        self._check_room(cache, slots, starts + lengths)
        return self._step("prefill")(self, cache, jnp.asarray(slots), jnp.asarray(ids), jnp.asarray(lengths),
                                     all_logits=all_logits, continue_=continue_from_cache,
                                     **self._adapter_table(cache.num_slots))

    def decode(self, cache: ModelCache, slots, tokens) -> tuple[jax.Array, ModelCache]:
        """One token per sequence (tokens [B]) at each slot's cached length.  Returns ([B, V], cache). Every row
        decodes a token, so every slot must be a live one: the padding slot is a SlotError."""
        tokens = self._check_ids(np.asarray(tokens)[:, None] if np.ndim(tokens) == 1 else tokens)
        if tokens.shape[1] != 1:
            raise ShapeError(f"tokens: expected [B], got {list(np.shape(tokens))}")
        slots = self._check_slots(cache, slots, tokens.shape[0])
        if (slots == cache.padding_slot).any():
            raise SlotError(f"slots: {slots.tolist()} holds the padding slot {cache.padding_slot}, which holds no "
                            f"sequence to decode; decode live slots only")
        self._check_room(cache, slots, np.asarray(cache.seq_lens)[slots] + 1)
        return self._step("decode")(self, cache, jnp.asarray(slots), jnp.asarray(tokens[:, 0]),
                                    **self._adapter_table(cache.num_slots))

    def _check_ids(self, ids) -> np.ndarray:
        ids = as_array("ids", ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or ids.shape[0] == 0:
            raise ShapeError(f"ids: expected integer token ids [B, T] with B >= 1, got {ids.dtype}{list(ids.shape)}")
        if ids.shape[1] > self.config.max_position_embeddings:       # before any [T, T] or KV allocation
            raise ShapeError(f"ids: {ids.shape[1]} tokens per row exceed the model's max_position_embeddings "
                             f"{self.config.max_position_embeddings}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ShapeError(f"ids: token ids must lie in [0, {self.config.vocab_size}), "
                             f"got range [{ids.min()}, {ids.max()}]")
        return ids.astype(np.int32)

    def _check_slots(self, cache: ModelCache, slots, n: int) -> np.ndarray:
        slots = _vector("slots", slots, n)
        if slots.min() < 0 or slots.max() >= cache.num_slots:
            raise SlotError(f"slots: each must lie in [0, {cache.num_slots}), got {slots.tolist()}")
        live = slots[slots != cache.padding_slot]
        if len(set(live.tolist())) != len(live):
            raise SlotError(f"slots: a live slot appears twice in {slots.tolist()}")
        return slots

    def _check_room(self, cache: ModelCache, slots: np.ndarray, ends: np.ndarray) -> None:
        if cache.kv.num_layers == 0:
            return                                   # only attention layers need room per token
        live = slots != cache.padding_slot
        over = [(int(s), int(e)) for s, e, ok in zip(slots, ends, live) if ok and e > cache.max_len]
        if over:
            raise SlotError(f"cache: max_len is {cache.max_len}, but (slot, tokens) {over} would exceed it")

    # ---- batch jobs ----------------------------------------------------------------------------
    def score(self, ids, lengths=None, *, greedy: bool = False):
        """Per-token log-probs [B, T-1]: log p(ids[t+1] | ids[:t+1]), zero past each row's length.
        Compiled per (batch, length) bucket (powers of two), so nearby shapes reuse one executable.
        greedy: return (log-probs, is_greedy [B, T-1] bool): whether ids[t+1] is the most likely token there
        (ties count as greedy; False past each row's length), as lm-eval's loglikelihood reports."""
        ids = self._check_ids(ids)
        B, T = ids.shape
        if T < 2:
            raise ShapeError(f"ids: need at least 2 tokens per row to score, got {T}")
        lengths = _vector("lengths", np.full((B,), T) if lengths is None else lengths, B)
        if lengths.min() < 0 or lengths.max() > T:
            raise ShapeError(f"lengths: each must lie in [0, {T}], got {lengths.tolist()}")
        Bb, Tb = _replica_rows(self, bucket(B)), bucket(T, 8)
        padded = np.full((Bb, Tb), self.config.pad_token_id or 0, np.int32)
        padded[:B, :T] = ids
        lens = np.zeros(Bb, np.int32)
        lens[:B] = lengths
        out = self._step("score")(self, jnp.asarray(padded), jnp.asarray(lens), greedy=greedy,
                                  **self._adapter_table(Bb))
        if greedy:
            return out[0][:B, :T - 1], out[1][:B, :T - 1]
        return out[:B, :T - 1]

    def generate(self, prompts, params=None, *, progress: bool | None = False, **overrides) -> list[Generation]:
        """Continue each prompt (a list of token ids, or a string when the model has a tokenizer) through the
        engine (runtime/engine.py: one generation loop and one sampler for the library). params: a SamplingParams
        for all prompts, a list of one per prompt, or max_new_tokens (the old second argument); keyword overrides
        (max_new_tokens=, temperature=, top_p=, top_k=, min_p=, seed=, stop=, logprobs=) replace fields. Greedy at
        temperature 0; a row stops at an eos id, a stop id or string, or after max_new_tokens. The engine for
        this batch's (slots, length) buckets is built on executables kept per model (`generate_engine`), so a
        repeated call of the same buckets compiles nothing."""
        from metrale_jax.runtime.sampling_params import per_request

        seqs, as_text = prompts_ids(prompts, self.tokenizer)
        return self._generate_ids(seqs, per_request(params, len(seqs), **overrides), as_text, progress)

    def _generate_ids(self, seqs: list[list[int]], each: list, as_text: bool, progress) -> list[Generation]:
        """generate for prompts as token ids, one SamplingParams each (as_text: Generations with text)."""
        from metrale_jax.runtime.engine import generate_engine

        limit = self.config.max_position_embeddings
        for s, sp in zip(seqs, each):
            if len(s) + sp.max_new_tokens > limit:                    # before a cache is allocated
                raise ConfigError("max_new_tokens", f"a prompt of {len(s)} tokens + {sp.max_new_tokens} new tokens "
                                                    f"exceeds the model's max_position_embeddings {limit}")
        for s in seqs:
            self._check_ids(np.asarray([s]))
        longest = max(len(s) + sp.max_new_tokens for s, sp in zip(seqs, each))
        engine = generate_engine(self, len(seqs), min(bucket(longest, 16), limit))
        return engine.generate_ids(seqs, each, as_text=as_text, progress=progress, adapter=self.active_adapter)

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True, **extra) -> str:
        """The prompt text the tokenizer's chat template (tokenizer_config.json) makes of messages
        ([{"role": ..., "content": ...}, ...]); chat.apply_chat_template."""
        from metrale_jax.chat import apply_chat_template

        if self.tokenizer is None:
            raise ConfigError("tokenizer", "a chat template needs a tokenizer; this model has none")
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt=add_generation_prompt, **extra)

    def chat(self, messages, params=None, *, progress: bool | None = False, **overrides) -> Generation:
        """The assistant's next turn after messages: the chat-template prompt (its special tokens as the template
        writes them, no BOS added on top), continued as `generate` does (params / overrides likewise)."""
        from metrale_jax.runtime.sampling_params import per_request

        ids = self.tokenizer.encode(self.apply_chat_template(messages), add_bos=False)
        return self._generate_ids([ids], per_request(params, 1, **overrides), True, progress)[0]


# ---- the compiled steps (pure functions of the model) ----------------------------------------------
def _rmsnorm(model: NemotronH, x) -> jax.Array:
    """norm_f over the last block's stream x [..., D] (or its PendingResidual: added in the norm, blocks.py)."""
    return open_block(x, model.norm_f[...], eps=model.config.layer_norm_epsilon, kernels=model.levers.kernels)[1]


def _logits(model: NemotronH, x: jax.Array, phase: str = "prefill", slots=None) -> jax.Array:
    """Final-normed rows x [N, D] -> logits [N, V] float32. slots [N]: each row's slot, for a LoRA overlay on
    lm_head to find the row's adapter in the scoped table (layers/lora.py; None: no lm_head adapter)."""
    if model.lm_head is None:
        return registry.get("dense_matmul", model.levers.kernels)(x, model.embeddings[...], out_dtype=jnp.float32)
    if slots is None or model.lm_head.lora is None:
        return model.lm_head(x, phase=phase, out_dtype=jnp.float32)
    with lora.head_rows(slots):
        return model.lm_head(x, phase=phase, out_dtype=jnp.float32)


def prefill_hidden(model: NemotronH, cache, rows: PrefillRows, ids):
    """Every block over right-padded rows ids [B, T] (the block loop, layers/stack.py). Returns (final-normed
    hidden [B, T, D], cache, captured per block: the Mamba states at rows.cuts, else None)."""
    h, cache, captured = run_blocks(model.layers, rows, cache, model.embeddings[...][ids])
    return _rmsnorm(model, h), cache, captured


def forward_step(model: NemotronH, ids, adapters=None):
    """ids [B, T] -> logits [B, T, V] float32 (full rows, no cache). adapters: row b's LoRA adapter index at
    [b] (layers/lora.py; None: none)."""
    if model.tp is not None:                  # rows split over the replicas (dp), logits left split by row
        with lora.slot_adapters(adapters):                # the table goes into the shard_map (adapter_mesh.py)
            return sharding.run_sharded(forward_step, model, ids, batch=True,
                                        out_specs=sharding.logits_spec(model, 3, batch=True))
    TRACE_COUNTS["forward"] += 1
    B, T = ids.shape
    with lora.slot_adapters(adapters):
        h = _hidden_no_cache(model, ids, jnp.full((B,), T, jnp.int32))
        return _logits(model, h.reshape(B * T, -1), slots=jnp.repeat(jnp.arange(B), T)).reshape(B, T, -1)


def _hidden_no_cache(model: NemotronH, ids, lengths):
    """Final-normed hidden [B, T, D] of new sequences, on a throw-away cache."""
    B, T = ids.shape
    cache = ModelCache.for_config(model.config, B, T, model.dtype)
    rows = PrefillRows.make(jnp.arange(B, dtype=jnp.int32), lengths, T, padding_slot=cache.padding_slot)
    h, _, _ = prefill_hidden(model, cache, rows, ids)
    return h


def prefill_step(model: NemotronH, cache: ModelCache, slots, ids, lengths, *, all_logits: bool, continue_: bool,
                 adapters=None):
    """`NemotronH.prefill` without the host-side checks: (logits [B, V] or [B, T, V], new cache). adapters: each
    slot's LoRA adapter index [num_slots] (None: none)."""
    if model.tp is not None:
        out_specs = (sharding.logits_spec(model, 3 if all_logits else 2), sharding.cache_specs(model.config, model.tp))
        with lora.slot_adapters(adapters):
            return sharding.run_sharded(prefill_step, model, cache, slots, ids, lengths, out_specs=out_specs,
                                        all_logits=all_logits, continue_=continue_)
    TRACE_COUNTS["prefill"] += 1
    B, T = ids.shape
    starts = cache.seq_lens[slots] if continue_ else None
    rows = PrefillRows.make(slots, lengths, T, starts, padding_slot=cache.padding_slot)
    with lora.slot_adapters(adapters):
        h, new, _ = prefill_hidden(model, cache, rows, ids)
        if all_logits:
            logits = _logits(model, h.reshape(B * T, -1), slots=jnp.repeat(slots, T)).reshape(B, T, -1)
        else:
            logits = _logits(model, h[jnp.arange(B), jnp.clip(lengths - 1, 0, T - 1)], slots=slots)
    seq_lens = cache.seq_lens.at[slots].set((0 if starts is None else starts) + lengths)
    return logits, dataclasses.replace(new, seq_lens=seq_lens)


def decode_step(model: NemotronH, cache: ModelCache, slots, tokens, adapters=None):
    """`NemotronH.decode` without the host-side checks: (logits [B, V], new cache). adapters: as prefill_step's."""
    if model.tp is not None:
        out_specs = (sharding.logits_spec(model, 2), sharding.cache_specs(model.config, model.tp))
        with lora.slot_adapters(adapters):
            return sharding.run_sharded(decode_step, model, cache, slots, tokens, out_specs=out_specs)
    TRACE_COUNTS["decode"] += 1
    if tokens.shape[0] == 1:
        # XLA compiles a batch of one with its batch axis simplified away, which rounds differently; with a
        # padding row beside it a lone sequence gets the bits it gets in any batch
        logits, cache = decode_step(model, cache, jnp.concatenate([slots, jnp.full((1,), cache.padding_slot,
                                                                                     slots.dtype)]),
                                    jnp.concatenate([tokens, tokens]), adapters)
        return logits[:1], cache
    pos = cache.seq_lens[slots]
    h = model.embeddings[...][tokens]                                       # [B, D]
    with lora.slot_adapters(adapters):
        h, new, _ = run_blocks(model.layers, DecodeRows(slots, pos), cache, h, pending_out=True)
        logits = _logits(model, _rmsnorm(model, h), "decode", slots=slots)
    seq_lens = cache.seq_lens.at[slots].set(pos + 1).at[cache.padding_slot].set(0)   # padding never grows
    return logits, dataclasses.replace(new, seq_lens=seq_lens)


def score_step(model: NemotronH, ids, lengths, adapters=None, *, greedy: bool = False):
    """ids [B, T], lengths [B] -> log p(ids[t+1] | ids[:t+1]) [B, T-1], zero past each length; adapters as
    forward_step's; greedy: also whether each ids[t+1] is the argmax there ([B, T-1] bool, ties count, False past
    each length)."""
    if model.tp is not None:                  # rows split over the replicas (dp), gathered back in the step
        with lora.slot_adapters(adapters):
            return sharding.run_sharded(_score_gathered, model, ids, lengths, out_specs=(P(), P()) if greedy else P(),
                                        batch=True, greedy=greedy,
                                        dp_axis=model.tp.dp_axis if model.tp.dp > 1 else None)
    TRACE_COUNTS["score"] += 1
    B, T = ids.shape
    with lora.slot_adapters(adapters):
        h = _hidden_no_cache(model, ids, lengths)[:, :-1].reshape(B * (T - 1), -1)
        lp, top = _token_logprobs(model, h, ids[:, 1:].reshape(-1), greedy=True,
                                  slots=jnp.repeat(jnp.arange(B), T - 1))
    valid = jnp.arange(1, T)[None, :] < lengths[:, None]
    lp = jnp.where(valid, lp.reshape(B, T - 1), 0.0)
    return (lp, valid & top.reshape(B, T - 1)) if greedy else lp


def _score_gathered(view: NemotronH, ids, lengths, *, greedy: bool, dp_axis: str | None):
    """score_step on one replica's rows, its results gathered from every replica along dp_axis (None: one
    replica): every device then holds the whole batch's, so every process can read them."""
    out = score_step(view, ids, lengths, greedy=greedy)
    if dp_axis is None:
        return out
    return jax.tree.map(lambda x: jax.lax.all_gather(x, dp_axis, axis=0, tiled=True), out)


def _token_logprobs(model: NemotronH, x: jax.Array, targets: jax.Array, chunk: int = 1024, *, greedy: bool = False,
                    slots=None):
    """log_softmax(logits(x))[target] per row, a chunk of rows at a time so [N, V] never exists at once; greedy:
    (that, whether the target's logit is the largest). slots [N]: each row's slot (_logits)."""
    N = x.shape[0]
    C = min(chunk, N)
    pad = -N % C
    xs = jnp.pad(x, ((0, pad), (0, 0))).reshape(-1, C, x.shape[1])
    ts = jnp.pad(targets, (0, pad)).reshape(-1, C)
    ss = jnp.pad(jnp.zeros((N,), jnp.int32) if slots is None else slots, (0, pad)).reshape(-1, C)

    def one(args):
        xc, tc, sc = args
        logits = _logits(model, xc, slots=None if slots is None else sc)
        if model.vocab_axis is not None:
            return _vocab_parallel_logprobs(logits, tc, model.vocab_axis)
        picked = jnp.take_along_axis(logits, tc[:, None], axis=1)[:, 0]
        return picked - jax.nn.logsumexp(logits, axis=-1), picked >= jnp.max(logits, axis=-1)

    lp, top = jax.lax.map(one, (xs, ts, ss))
    lp, top = lp.reshape(-1)[:N], top.reshape(-1)[:N]
    return (lp, top) if greedy else lp


def _vocab_parallel_logprobs(logits: jax.Array, targets: jax.Array, axis: str) -> tuple[jax.Array, jax.Array]:
    """(log_softmax(logits)[target], whether the target's logit is the largest) when this device holds vocabulary
    rows [d*Vl, (d+1)*Vl) of the logits (logits [N, Vl], targets [N] global ids): a max, a sum and the target's
    logit reduced over `axis`."""
    Vl = logits.shape[1]
    m = jax.lax.pmax(jnp.max(logits, axis=1), axis)
    s = jax.lax.psum(jnp.sum(jnp.exp(logits - m[:, None]), axis=1), axis)
    local = targets - jax.lax.axis_index(axis) * Vl
    mine = (local >= 0) & (local < Vl)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, Vl - 1)[:, None], axis=1)[:, 0]
    target = jax.lax.psum(jnp.where(mine, picked, 0.0), axis)
    return target - m - jnp.log(s), target >= m


_IMPLS = {"forward": forward_step, "prefill": prefill_step, "decode": decode_step, "score": score_step}
_JITTED = {
    "forward": jax.jit(forward_step),
    "prefill": jax.jit(prefill_step, static_argnames=("all_logits", "continue_"), donate_argnums=(1,)),
    "decode": jax.jit(decode_step, donate_argnums=(1,)),
    "score": jax.jit(score_step, static_argnames=("greedy",)),
}


# ---- helpers ------------------------------------------------------------------------------------
def _check_prefill_rows(slots: np.ndarray, lengths: np.ndarray, padding_slot: int) -> None:
    """A padding-slot row is a no-op row, so it has no tokens; a live slot's row has at least one (a live slot
    prefilled with nothing would return logits of no token)."""
    pad = slots == padding_slot
    if (lengths[pad] > 0).any():
        raise SlotError(f"slots: the padding slot {padding_slot} is not a live slot; its rows must have length 0, "
                        f"got lengths {lengths[pad].tolist()}")
    if (lengths[~pad] == 0).any():
        empty = slots[~pad & (lengths == 0)].tolist()
        raise ShapeError(f"lengths: live slots {empty} are given 0 tokens; a live row needs at least 1 (rows with "
                         f"nothing to prefill go to the padding slot)")


def _replica_rows(model: NemotronH, rows: int) -> int:
    """rows rounded up to a multiple of the model's replicas (its mesh's dp size; 1 without a mesh)."""
    dp = data_parallel.num_replicas(model)
    return -(-rows // dp) * dp


def _vector(name: str, value, n: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.shape != (n,) or not np.issubdtype(arr.dtype, np.integer):
        raise ShapeError(f"{name}: expected integers [{n}], got {arr.dtype}{list(arr.shape)}")
    return arr.astype(np.int32)


