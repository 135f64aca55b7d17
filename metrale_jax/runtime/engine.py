"""Engine: continuous batching over a NemotronH's slot pool, with a prefix cache and speculative decoding.

Each `step()` admits queued requests into free slots (a zeroed slot, or a restored prefix snapshot),
decodes every sequence whose prompt is in (one token each, or a speculative verify of the pending token
plus its drafts), then prefills waiting prompts in chunks under the per-step token budget, each chunk
continuing from the slot's cached length. Tokens are sampled on the device, and each slot's last token
stays there (sampling.SlotSampling) as the next decode step's input, so a step is dispatched before the
previous step's tokens are read back: the host handles step n's tokens (streaming, stop tokens, the
length limit, releases) while the device runs step n+1. A stop token is therefore seen one step late and
the token its request drew meanwhile is discarded; the outputs are those of a loop that reads every token
back before the next step. Speculative steps read back first (drafting needs the last token on the host).
Finished requests release their slots.
Every model call is a compiled executable per (entry point, batch bucket, token bucket) with the cache
donated (runtime/executables.py); inputs are padded with the padding slot to the buckets, so after
`warmup()` no step compiles. The model's capability flags pick the paths: a decode graph veto runs
decode / verify eagerly, a multi-sequence or batched-verify veto runs them one sequence at a time, a
layer whose graphs go stale on a new sequence drops that slot's executables at admission, and a model
without the in-pass replay-tail capture takes prefix snapshots by ending a prefill chunk at the cut.
A model split over a mesh (tensor / expert parallel, sharding.py) is served the same way: its steps run
through shard_map, the cache and prefix snapshots stay split over the devices, host inputs go in
replicated, and the logits come out split over the vocabulary (sampling reduces over it).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
import typing
import weakref
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from metrale_jax import adapters, sharding
from metrale_jax.arguments import prompts_ids
from metrale_jax.errors import ConfigError, ShapeError
from metrale_jax.layers import lora
from metrale_jax.model import Generation
from metrale_jax.runtime import steps
from metrale_jax.runtime.executables import Executables, bucket, pick_bucket
from metrale_jax.runtime.prefix_cache import PrefixCache
from metrale_jax.runtime.sampling import SlotSampling, TokenLogprobs, draw_slots, start_request
from metrale_jax.runtime.sampling_params import MAX_LOGPROBS, SamplingParams, per_request, resolve
from metrale_jax.runtime.speculative import MtpDrafter, SpeculativeConfig, make_drafter
from metrale_jax.state.kv_pool import KvSlotState
from metrale_jax.state.slots import SlotAllocator
from metrale_jax.state.ssm_pool import SlotState


@dataclasses.dataclass(eq=False)
class Request:
    """One request's parameters and progress (host side)."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0                       # 0: off
    min_p: float = 0.0                   # 0: off
    want_logprobs: int | None = None     # SamplingParams.logprobs: None, 0 (chosen tokens) or n (and the top n)
    stop_ids: frozenset = frozenset()    # the caller's stop tokens (finish_reason 'stop'; eos ids: 'eos')
    stop_strings: tuple = ()             # finish_reason 'stop' once the text holds one
    on_token: Callable[[int, int], None] | None = None
    score: bool = False
    adapter: str | None = None          # the LoRA adapter its rows use (model.adapters), None for the base
    slot: int = -1
    done: int = 0                       # prompt tokens in the cache
    drawn: int = 0                      # tokens sampled on the device (read back or not)
    tokens: list[int] = dataclasses.field(default_factory=list)
    pending: int | None = None          # the last emitted token read back, not yet fed to the model
    finish_reason: str | None = None
    text_end: int | None = None          # with a stop string: where it starts in the decoded text
    logprobs: list[float] = dataclasses.field(default_factory=list)    # scoring: the prompt's; else the tokens'
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)   # with want_logprobs n
    drafter: object = None
    prefix_hit: int = 0                 # prompt tokens restored from the prefix cache
    t_submit: float = 0.0
    t_first: float | None = None        # when the first token was emitted (time to first token)
    t_done: float | None = None


@dataclasses.dataclass
class _Chunk:
    """One prefill chunk's plan: rows (request, tokens of it in this chunk), captures (row, request, cut point),
    whether a row scores, and whether the snapshots are taken in the pass (replay tail) or after it."""

    rows: list
    captures: list
    scoring: bool
    in_pass: bool


class _ChunkInputs(typing.NamedTuple):
    """steps.prefill_step's inputs after the cache, on the device."""

    slots: jax.Array
    ids: jax.Array
    lengths: jax.Array
    cuts: jax.Array | None = None
    capture_rows: jax.Array | None = None
    targets: jax.Array | None = None


def _groups(items: list, size: int):
    return [items[i:i + size] for i in range(0, len(items), size)]


def _logprobs_bucket(requests) -> int | None:
    """The log-prob width a sampling / verify executable computes for these requests: None when none asks (the
    plain executable), 0 when they ask for the chosen tokens' only, else MAX_LOGPROBS alternatives (each request
    keeps its own n of them): three variants at most, and top_k over the vocabulary costs about the same for 4
    as for 20."""
    asked = [r.want_logprobs for r in requests if r.want_logprobs is not None]
    if not asked:
        return None
    return MAX_LOGPROBS if max(asked) else 0


def _lp_arrays(lp: TokenLogprobs) -> tuple:
    return lp.chosen, lp.top_ids, lp.top_logprobs


def _powers(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], max(1, lo)
    while b < hi:
        out.append(b)
        b *= 2
    return tuple(out) + (hi,)


def _buckets(name: str, given, default) -> tuple[int, ...]:
    b = tuple(sorted({int(x) for x in (default if given is None else given)}))
    if not b or b[0] < 1:
        raise ConfigError(name, f"expected positive sizes, got {given}")
    return b


def _sizes(levers, max_slots: int, max_len: int, prefill_token_budget: int | None) -> tuple[int, int]:
    """(prefill token budget, max_len) checked: the budget defaults to the model's levers."""
    budget = levers.prefill_token_budget if prefill_token_budget is None else int(prefill_token_budget)
    if budget < 1:
        raise ConfigError("prefill_token_budget", f"must be >= 1, got {budget}")
    if max_slots < 1 or max_len < 1:
        raise ConfigError("max_slots", f"need max_slots >= 1 and max_len >= 1, got {max_slots}, {max_len}")
    return budget, int(max_len)


def _on_mesh(model, mesh):
    """The model to serve: `model`, or with a mesh and an unsharded model, a copy split over the mesh."""
    tp = getattr(model, "tp", None)
    if tp is not None and not isinstance(tp, sharding.TensorParallel):
        raise ConfigError("model", f"a mesh-sharded model carries a sharding.TensorParallel as .tp, got "
                                   f"{type(tp).__name__}")
    if mesh is None:
        return model
    want = sharding.tensor_parallel(mesh)
    if tp is None:                        # through the host: load big checkpoints with from_pretrained(mesh=)
        return type(model)(model.config, model.state_dict(), dtype=model.dtype, levers=model.levers,
                           tokenizer=model.tokenizer, notes=model.load_notes, mesh=mesh)
    if tp != want:
        raise ConfigError("mesh", f"the model is split over {tp.size} device(s) {tp.mesh.device_ids.tolist()} "
                                  f"(axis {tp.axis!r}), not over the mesh given ({want.size} device(s) "
                                  f"{want.mesh.device_ids.tolist()}, axis {want.axis!r}); pass the model's own "
                                  "mesh or none")
    return model


class Engine:
    """Continuous-batching server over one model and one slot pool.

    max_slots sequences at once (more queue), each up to max_len tokens (prompt + new tokens).
    prefill_token_budget: prompt tokens per step (default: the model's levers).
    batch_buckets / token_buckets: the padded shapes steps compile for (default: powers of two up to
    max_slots / the budget, token buckets from min_token_bucket); prefill_batch_buckets: prefill's own
    (default batch_buckets; a prefill step takes at most the largest of them rows).
    prefix_cache_bytes > 0 turns the prefix cache on: snapshots every prefix_block tokens (a multiple of
    the SSD chunk size; default the chunk size), at most capture_rows of them taken per step.
    speculative: a SpeculativeConfig; drafter replaces its drafter (an object whose new_sequence(context)
    returns one with append(token) and propose(limit) -> token list), e.g. a custom or test drafter.
    Method 'mtp' drafts with the model's MTP head on the device: the engine then keeps an MtpCache beside
    the cache (engine.mtp), brought up to date by every prefill and verify; prefix snapshots then hold its
    state at the cut too (the MTP keys/values with the KV blocks, the carried hidden state with the states).
    eos_ids: stop tokens (default: the model's). executables / decode_executables: registries to share
    between engines on the same model and cache shapes (the decode one becomes an eager one when a layer
    vetoes graphs).
    mesh: serve the model tensor / expert parallel over this mesh (sharding.make_mesh). Default: the model's
    own mesh when it was built with one (from_pretrained / from_config(..., mesh=...)), else one device. An
    unsharded model given a mesh is split over it through the host (engine.model is the split copy).
    ssm_state_dtype: the Mamba state's dtype in the slot pool (default the config's mamba_ssm_cache_dtype,
    float32); see NemotronH.new_cache.
    """

    def __init__(self, model, *, max_slots: int = 8, max_len: int = 2048, prefill_token_budget: int | None = None,
                 batch_buckets: Sequence[int] | None = None, token_buckets: Sequence[int] | None = None,
                 prefill_batch_buckets: Sequence[int] | None = None,
                 min_token_bucket: int = 16, prefix_cache_bytes: int = 0, prefix_block: int | None = None,
                 capture_rows: int = 1, speculative: SpeculativeConfig | None = None, drafter=None, eos_ids=None,
                 executables: Executables | None = None, decode_executables: Executables | None = None,
                 compiler_options=None, mesh=None, ssm_state_dtype: str | None = None):
        if mesh is not None and model.adapters:
            raise ConfigError("mesh", "a model with LoRA adapters cannot be split over a mesh (the overlays are not "
                                      "sharded)")
        self.model = model = _on_mesh(model, mesh)
        self.caps = model.capabilities                 # the layers' flags; the engine acts on them where noted
        self.tp = getattr(model, "tp", None)
        # host inputs go in replicated over the mesh (their sharding is part of an executable's key)
        self._replicated = None if self.tp is None else self.tp.sharding(P())
        self._on_device: collections.OrderedDict = collections.OrderedDict()   # small host arrays put lately
        self._logits_sharding = None if self.tp is None else self.tp.sharding(sharding.logits_spec(model, 2))
        # the weights as one flat list: a Module's own pytree flatten costs milliseconds per step at 50 blocks
        self._params, self._treedef = jax.tree_util.tree_flatten(model)
        self._model_keys: dict[int, int] = {}           # id(executables) -> the treedef's interned id there
        self.budget, self.max_len = _sizes(model.levers, max_slots, max_len, prefill_token_budget)
        self.cache = model.new_cache(max_slots, max_len, ssm_state_dtype=ssm_state_dtype)
        self.sampling = jax.device_put(SlotSampling.create(self.cache.num_slots), self._replicated)
        self._inflight: collections.deque = collections.deque()   # (device arrays, handler) not read back yet
        self.allocator = SlotAllocator(self.cache.num_slots)
        self.pad = self.cache.padding_slot
        self._init_buckets(max_slots, batch_buckets, token_buckets, prefill_batch_buckets, min_token_bucket)
        self._init_executables(executables, decode_executables, compiler_options)
        self.replay_tail = self.caps.replay_tail_capture    # every layer: in-pass capture, else two passes
        self.capture_rows = int(capture_rows)
        self.prefix_cache = self._make_prefix_cache(prefix_cache_bytes, prefix_block)
        self.speculative = speculative
        self.drafter = self._make_drafter(speculative, drafter)
        self.mtp = model.new_mtp_cache(max_slots, max_len) if isinstance(self.drafter, MtpDrafter) else None
        self.eos_ids = frozenset(model.eos_ids() if eos_ids is None else (int(e) for e in eos_ids))
        self.queue: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}          # slot -> request, in admission order
        self.requests: dict[int, Request] = {}
        self._next_id = 0
        self._progress = None
        self._finished: list[int] = []
        self.counters = collections.Counter()
        # each slot's LoRA adapter index (0: none), a step argument when the model has adapters
        self._slot_adapters = np.zeros(self.cache.num_slots, np.int32) if model.adapters else None

    def _init_buckets(self, max_slots: int, batch_buckets, token_buckets, prefill_batch_buckets,
                      min_token_bucket: int) -> None:
        """The padded shapes steps compile for; a layer without batched decode / verify gets batches of one."""
        self.batch_buckets = _buckets("batch_buckets", batch_buckets, _powers(1, bucket(max_slots)))
        top = bucket(min(self.budget, self.max_len))
        self.token_buckets = _buckets("token_buckets", token_buckets, _powers(min(min_token_bucket, top), top))
        self.prefill_buckets = _buckets("prefill_batch_buckets", prefill_batch_buckets, self.batch_buckets)
        self.decode_buckets = (1,) if self.caps.multi_seq_per_sequence else self.batch_buckets
        self.verify_buckets = (1,) if self.caps.verify_per_sequence else self.batch_buckets

    def _init_executables(self, executables, decode_executables, compiler_options) -> None:
        """The registries: decode / verify run eagerly when a layer vetoes graphs (or levers turn them off)."""
        graphs = self.model.levers.graphs
        self.exe = executables or Executables(graphs=graphs, compiler_options=compiler_options)
        if self.caps.decode_graph_veto or not graphs:
            self.decode_exe = Executables(graphs=False)
        else:
            self.decode_exe = decode_executables or self.exe

    def _make_prefix_cache(self, nbytes: int, block: int | None) -> PrefixCache | None:
        """A prefix cache of `nbytes` snapshotting every `block` tokens (default the SSD chunk), or None; refused
        when a layer's state or prefill would make a snapshot wrong."""
        if not nbytes:
            return None
        chunk = self.model.levers.ssm_chunk_size(self.model.config)
        block = chunk if block is None else int(block)
        if block < 1 or block % chunk:
            raise ConfigError("prefix_block", f"must be a positive multiple of the SSD chunk size {chunk}, got {block}")
        if self.caps.has_aux_state:
            raise ConfigError("prefix_cache_bytes", "a layer carries aux state (has_aux_state), which snapshots do "
                                                    "not hold yet; turn the prefix cache off")
        if any(getattr(l, "uses_local_mla_prefill", False) for l in self.model.layers):
            raise ConfigError("prefix_cache_bytes", "a layer's prefill attends only to its own tokens "
                                                    "(uses_local_mla_prefill); a prefix skip would hide the prefix "
                                                    "from it")
        if self.capture_rows < 1:
            raise ConfigError("capture_rows", f"must be >= 1, got {self.capture_rows}")
        return PrefixCache(block, nbytes)

    def _make_drafter(self, speculative: SpeculativeConfig | None, drafter):
        """The drafter speculative decoding uses (the config's, or the one given), or None without speculation;
        refused when a layer declines rollback."""
        if speculative is None:
            if drafter is not None:
                raise ConfigError("drafter", "a drafter needs speculative=SpeculativeConfig(...) (num_draft)")
            return None
        if self.caps.rollback_unsupported:
            raise ConfigError("speculative", "a layer declines rollback (decode_rollback_unsupported); "
                                             "speculative decoding commits an earlier state")
        return make_drafter(self.model, speculative) if drafter is None else drafter

    def _dev(self, x, dtype=np.int32):
        """A host array onto the device (replicated over the model's mesh)."""
        return jax.device_put(np.asarray(x, dtype), self._replicated)

    def _devs(self, *arrays):
        """Several host arrays onto the device(s) in one batched transfer."""
        return jax.device_put(tuple(np.asarray(a) for a in arrays), self._replicated)

    def _dev_cached(self, x) -> jax.Array:
        """`_dev` for the small arrays steps repeat (a batch's slots, its live rows): the device copy of the
        same values is reused, so a steady decode step transfers nothing."""
        x = np.asarray(x)
        key = (x.dtype.str, x.shape, x.tobytes())
        hit = self._on_device.get(key)
        if hit is None:
            hit = self._on_device[key] = jax.device_put(x, self._replicated)
            if len(self._on_device) > 256:
                self._on_device.popitem(last=False)
        else:
            self._on_device.move_to_end(key)
        return hit

    def _state_op(self, entry: str, fn: Callable, *args, **kw):
        """A slot helper of runtime/steps.py (no model) through the executables; on a mesh, run on every
        device's share of the state (sharding.run_sharded_state) so that the cache and snapshots stay split."""
        if self.tp is not None:
            fn = functools.partial(sharding.run_sharded_state, fn, self.tp, self.model.config)
        return self.exe.run(entry, fn, *args, **kw)

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, prompt, params: SamplingParams | int | None = None, *,
               on_token: Callable[[int, int], None] | None = None, adapter: str | None = None, **overrides) -> int:
        """Queue a generation request (token ids); returns its id. params: a SamplingParams (or, as before,
        max_new_tokens); keyword overrides (temperature=, top_p=, top_k=, min_p=, seed=, stop=, logprobs=,
        max_new_tokens=) replace its fields. on_token(id, token) streams tokens.
        stop: token ids and strings (strings need the model's tokenizer) that end the request with
        finish_reason 'stop': a stop token is not kept; with a stop string the tokens through the one that
        completed it are kept and Generation.text ends before it. The model's eos ids end it with 'eos'.
        adapter: the name of a LoRA adapter the model has loaded (None: the base weights); rows with different
        adapters share a step."""
        tokens = self._check_prompt(prompt, "prompt")
        adapters.index_of(self.model, adapter)                     # ConfigError naming an unknown adapter
        if adapter is not None and self._slot_adapters is None:
            raise ConfigError("adapter", f"{adapter!r} was loaded after this Engine was made (it serves the model's "
                                         f"weights as they were then); load adapters before creating the Engine")
        sp = resolve(params, **overrides)
        if len(tokens) + sp.max_new_tokens > self.max_len:
            raise ShapeError(f"prompt: {len(tokens)} tokens + max_new_tokens {sp.max_new_tokens} exceed the engine's "
                             f"max_len {self.max_len}")
        return self._enqueue(Request(rid=0, prompt=tokens, max_new_tokens=sp.max_new_tokens,
                                     temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed % 2**31,
                                     top_k=min(sp.top_k, self.model.config.vocab_size),   # int32 on the device
                                     min_p=sp.min_p, want_logprobs=sp.logprobs,
                                     **self._stops(sp.stop), on_token=on_token, adapter=adapter))

    def _stops(self, stop: tuple) -> dict:
        """A request's stop ids and stop strings from SamplingParams.stop (checked there; here against the model:
        ids in the vocabulary, strings only with a tokenizer)."""
        V = self.model.config.vocab_size
        for s in stop:
            if isinstance(s, str) and self.model.tokenizer is None:
                raise ConfigError("stop", f"stop string {s!r} needs a tokenizer; this model has none (pass stop "
                                          "token ids)")
            if isinstance(s, int) and s >= V:
                raise ConfigError("stop", f"expected token ids in [0, {V}) or non-empty strings, got {s!r}")
        return dict(stop_ids=frozenset(s for s in stop if isinstance(s, int)),
                    stop_strings=tuple(s for s in stop if isinstance(s, str)))

    def submit_score(self, ids) -> int:
        """Queue a scoring request: log p(ids[t+1] | ids[:t+1]) for every t."""
        tokens = self._check_prompt(ids, "ids")
        if len(tokens) > self.max_len:
            raise ShapeError(f"ids: {len(tokens)} tokens exceed the engine's max_len {self.max_len}")
        return self._enqueue(Request(rid=0, prompt=tokens, max_new_tokens=0, score=True))

    def _check_prompt(self, prompt, name: str) -> list[int]:
        arr = np.asarray(prompt)
        if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise ShapeError(f"{name}: expected a non-empty list of token ids, got {arr.dtype}{list(arr.shape)}")
        V = self.model.config.vocab_size
        if arr.min() < 0 or arr.max() >= V:
            raise ShapeError(f"{name}: token ids must lie in [0, {V}), got range [{arr.min()}, {arr.max()}]")
        return [int(t) for t in arr]

    def _enqueue(self, r: Request) -> int:
        r.rid, self._next_id = self._next_id, self._next_id + 1
        r.t_submit = time.perf_counter()
        if self.drafter is not None and not r.score:
            r.drafter = self.drafter.new_sequence(r.prompt)
        self.requests[r.rid] = r
        self.queue.append(r)
        return r.rid

    def pop(self, rid: int) -> Request:
        """Remove and return a finished request (tokens, finish_reason, logprobs, prefix_hit, timings)."""
        r = self.requests.get(rid)
        if r is None or r.finish_reason is None:
            raise KeyError(f"request {rid} is {'unknown' if r is None else 'not finished'}")
        return self.requests.pop(rid)

    @property
    def has_work(self) -> bool:
        return bool(self.queue or self.running or self._inflight)

    def call(self, entry: str, fn: Callable, *args, decode: bool = False, **kw):
        """fn(model, *args) through the engine's executables (decode=True: the decode registry, eager under a
        graph veto). The model goes in as its flattened weights; donate_argnums count it as argument 0."""
        treedef = self._treedef

        def with_model(params, *rest):
            if self._slot_adapters is None:
                return fn(jax.tree_util.tree_unflatten(treedef, params), *rest)
            *rest, table = rest                           # each slot's adapter, scoped for the blocks
            with lora.slot_adapters(table):
                return fn(jax.tree_util.tree_unflatten(treedef, params), *rest)

        exe = self.decode_exe if decode else self.exe
        key = self._model_keys.get(id(exe))
        if key is None:      # the model's static data (levers, config) is in its treedef, not in its leaves
            key = self._model_keys[id(exe)] = exe.intern(self._treedef)
        if not self.caps.stale_on_new_sequence:
            kw.pop("slots", None)                      # which slots an executable served matters only then
        if self._slot_adapters is not None:
            args = (*args, self._dev_cached(self._slot_adapters))
        return exe.run(entry, with_model, self._params, *args, frozen_argnums=(0,),
                       **{**kw, "static": (key, kw.get("static"))})

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[int]:
        """One engine iteration; returns the ids of the requests that finished in it (seen in it: a request
        is found finished when its tokens are read back, one step after they were drawn)."""
        self._finished: list[int] = []
        self._admit()
        if self.speculative:
            self._read_back(len(self._inflight))       # drafting needs every last token on the host
        earlier = len(self._inflight)
        live = list(self.running.values())
        decoding = [r for r in live if r.done == len(r.prompt) and r.drawn < r.max_new_tokens]
        prefilling = [r for r in live if r.done < len(r.prompt)]
        if decoding:
            (self._speculate if self.speculative else self._decode)(decoding)
        if prefilling:
            self._prefill(prefilling)
        self._read_back(earlier)                       # the previous step's tokens, while this one runs
        if not decoding and not prefilling:
            self._read_back(len(self._inflight))       # nothing dispatched: take the last tokens now
        self.counters["steps"] += 1
        return self._finished

    def _later(self, arrays: tuple, handle: Callable) -> None:
        """Hand `arrays` (results of work just dispatched) to handle(*host arrays) when they are read back; their
        copy to the host is queued now, behind the work that makes them and ahead of the next step's."""
        for a in arrays:
            a.copy_to_host_async()
        self._inflight.append((arrays, handle))

    def _read_back(self, n: int) -> None:
        """Read back the n oldest dispatched results (blocking on each) and hand them to their handlers."""
        for _ in range(n):
            arrays, handle = self._inflight.popleft()
            handle(*(np.asarray(a) for a in arrays))

    def run(self, progress: bool | None = False) -> None:
        """Step until the queue and the pool are empty (progress: a tqdm bar over requests)."""
        from tqdm.auto import tqdm

        total = len(self.queue) + len(self.running)
        with tqdm(total=total, disable=not progress if progress is not None else None, unit="req",
                  desc="engine") as bar:
            self._progress = bar
            try:
                while self.has_work:
                    self.step()
            finally:
                self._progress = None

    def _admit(self) -> None:
        while self.queue and self.allocator.free_count:
            r = self.queue.popleft()
            (slot,) = self.allocator.alloc()
            if self.caps.stale_on_new_sequence:
                self.counters["dropped_executables"] += self.exe.drop_slot(slot)
                if self.decode_exe is not self.exe:
                    self.counters["dropped_executables"] += self.decode_exe.drop_slot(slot)
            self.cache = self._state_op("zero_slot", steps.zero_slot, self.cache, self._dev(slot),
                                        donate_argnums=(0,))
            self.sampling = self.exe.run("start_request", start_request, self.sampling,
                                         *self._devs(np.int32(slot), np.float32(r.temperature), np.float32(r.top_p),
                                                     np.int32(r.top_k), np.float32(r.min_p), np.int32(r.seed)),
                                         donate_argnums=(0,))
            r.slot = slot
            self.running[slot] = r
            if self._slot_adapters is not None:
                self._slot_adapters[slot] = adapters.index_of(self.model, r.adapter)
            if self.prefix_cache is not None and not r.score and r.adapter is None:   # snapshots are the base's
                hit = self.prefix_cache.lookup(r.prompt, len(r.prompt) - 1)
                if hit is not None:
                    self._restore(slot, hit)
                    r.done = r.prefix_hit = hit.length

    def _restore(self, slot: int, hit) -> None:
        self.cache = self._state_op("restore_ssm", steps.restore_ssm, self.cache, self._dev(slot), hit.ssm,
                                    self._dev(hit.length), donate_argnums=(0,))
        if self.cache.kv.num_layers:
            for j, blk in enumerate(hit.kv_blocks):
                self.cache = self._state_op("kv_block_put", steps.kv_block_put, self.cache, self._dev(slot),
                                            self._dev(j * self.prefix_cache.block), blk, donate_argnums=(0,))
        if self.mtp is not None:
            self.mtp = self.exe.run("mtp_restore_hidden", steps.mtp_restore_hidden, self.mtp, self._dev(slot),
                                    hit.mtp_hidden, donate_argnums=(0,))
            if self.mtp.kv.num_layers:                 # in order: block j rewrites block j-1's scratch last row
                for j, blk in enumerate(hit.mtp_blocks):
                    self.mtp = self.exe.run("mtp_block_put", steps.mtp_block_put, self.mtp, self._dev(slot),
                                            self._dev(self._mtp_block_start(j)), blk, donate_argnums=(0,))

    def _kv_block(self, slot: int, j: int) -> KvSlotState:
        block = self.prefix_cache.block
        return self._state_op("kv_block_get", functools.partial(steps.kv_block_get, block=block), self.cache,
                              self._dev(slot), self._dev(j * block), static=block)

    def _mtp_block_start(self, j: int) -> int:
        """Block j's MTP keys/values are those of the pairs whose next token lies in the block: positions
        j*block-1 .. (j+1)*block-2. Block 0 starts at 0, so its last row (the pair after the cut) is scratch,
        rewritten by block 1 or by the prefill after a restore."""
        return max(j * self.prefix_cache.block - 1, 0)

    def _mtp_block(self, slot: int, j: int) -> KvSlotState:
        block = self.prefix_cache.block
        return self.exe.run("mtp_block_get", functools.partial(steps.mtp_block_get, block=block), self.mtp,
                            self._dev(slot), self._dev(self._mtp_block_start(j)), static=block)

    # ---- emitting and finishing ------------------------------------------------------------------
    def _emit(self, r: Request, tokens, lp: tuple | None = None) -> None:
        """Append tokens read back for r (up to a stop token or max_new_tokens), stream them, finish r. A
        request that finished already drew them after its end: they are discarded. lp: the tokens' log-probs
        as read back (chosen [m], top ids [m, n], top log-probs [m, n]) when r asked for them."""
        if r.finish_reason is not None:
            return
        for j, t in enumerate(tokens):
            t = int(t)
            if r.t_first is None:
                r.t_first = time.perf_counter()
            if t in self.eos_ids or t in r.stop_ids:
                return self._finish(r, "eos" if t in self.eos_ids else "stop")
            r.tokens.append(t)
            if r.want_logprobs is not None:
                self._keep_logprobs(r, lp, j)
            self.counters["generated_tokens"] += 1
            if r.drafter is not None:
                r.drafter.append(t)
            if r.on_token is not None:
                r.on_token(r.rid, t)
            if r.stop_strings and self._stop_string_ends(r):
                return self._finish(r, "stop")
            if len(r.tokens) >= r.max_new_tokens:
                return self._finish(r, "length")
        r.pending = r.tokens[-1]

    @staticmethod
    def _keep_logprobs(r: Request, lp: tuple, j: int) -> None:
        """Token j's log-prob (and its request's top n of the step's bucket of alternatives) onto r."""
        chosen, top_ids, top_lp = lp
        r.logprobs.append(float(chosen[j]))
        if r.want_logprobs:
            n = r.want_logprobs
            r.top_logprobs.append([(int(i), float(v)) for i, v in zip(top_ids[j, :n], top_lp[j, :n])])

    def _stop_string_ends(self, r: Request) -> bool:
        """Whether r's last token completed one of its stop strings; if so r.text_end marks where the first
        one starts. Only the last few tokens are decoded per check: a token holds at least one byte, a
        character at most four."""
        decode = self.model.tokenizer.decode
        window = 4 * max(len(s) for s in r.stop_strings) + 4
        if not any(s in decode(r.tokens[-window:]) for s in r.stop_strings):
            return False
        text = decode(r.tokens)
        starts = [i for i in (text.find(s) for s in r.stop_strings) if i >= 0]
        if starts:
            r.text_end = min(starts)
        return bool(starts)

    def _finish(self, r: Request, reason: str) -> None:
        r.finish_reason = reason
        r.pending = None
        r.t_done = time.perf_counter()
        del self.running[r.slot]
        self.allocator.release(r.slot)
        self.counters["finished"] += 1
        self._finished.append(r.rid)
        if self._progress is not None:
            self._progress.update(1)

    def _sample(self, logits, group: list[Request], slots, draw) -> None:
        """Draw the next token of each row whose `draw` is set (on the device, into self.sampling); the
        tokens (and their log-probs, when a row asks) are read back a step later and emitted to their requests."""
        rows = [(b, r) for b, (r, d) in enumerate(zip(group, draw)) if d]
        sampling = any(r.temperature > 0 for _, r in rows)
        n = _logprobs_bucket(r for _, r in rows)
        tokens, self.sampling, lp = self.exe.run(
            "sample", functools.partial(draw_slots, sampling=sampling, logprobs=n), logits, self.sampling, slots,
            self._dev_cached(np.asarray(draw, bool)), donate_argnums=(1,), static=(sampling, n))
        for _, r in rows:
            r.drawn += 1
        if lp is None:
            self._later((tokens,), lambda toks: [self._emit(r, [toks[b]]) for b, r in rows])
        else:
            self._later((tokens, *_lp_arrays(lp)), lambda toks, *lps: [
                self._emit(r, [toks[b]], tuple(a[b:b + 1] for a in lps)) for b, r in rows])

    # ---- decode --------------------------------------------------------------------------------
    def _decode(self, reqs: list[Request]) -> None:
        for group in _groups(reqs, self.decode_buckets[-1]):
            B = pick_bucket(len(group), self.decode_buckets, "decode batch")
            slots = self._dev_cached(np.array([r.slot for r in group] + [self.pad] * (B - len(group)), np.int32))
            logits, self.cache = self.call("decode", steps.decode_pending_step, self.cache, self.sampling.pending,
                                           slots, decode=True, donate_argnums=(1,), slots=[r.slot for r in group])
            self.counters["decode_rows"] += len(group)
            self._sample(logits, group, slots, [True] * len(group) + [False] * (B - len(group)))

    def _speculate(self, reqs: list[Request]) -> None:
        nd_max = self.speculative.num_draft
        limits = {r.rid: min(nd_max, r.max_new_tokens - len(r.tokens) - 1) for r in reqs}
        if self.mtp is None:
            drafts = {r.rid: r.drafter.propose(limits[r.rid]) for r in reqs}
            if not any(drafts.values()):
                return self._decode(reqs)
        elif max(limits.values()) <= 0:
            return self._decode(reqs)                  # each emits its last token: the MTP state is not needed
        k = nd_max + 1
        for group in _groups(reqs, self.verify_buckets[-1]):
            n = pick_bucket(len(group), self.verify_buckets, "verify batch")
            slots = [r.slot for r in group] + [self.pad] * (n - len(group))
            if self.mtp is not None:
                drafts = self._mtp_drafts(group, slots, limits)
            tokens = np.zeros((n, k), np.int32)
            num_draft = np.zeros(n, np.int32)
            for i, r in enumerate(group):
                d = drafts[r.rid]
                tokens[i, 0] = r.pending
                tokens[i, 1:1 + len(d)] = d
                tokens[i, 1 + len(d):] = tokens[i, len(d)]          # filler rows: never accepted
                num_draft[i] = len(d)
            sampling = any(r.temperature > 0 for r in group)
            nlp = _logprobs_bucket(group)
            live = np.arange(n) < len(group)
            inputs = self._devs(np.array(slots, np.int32), tokens, num_draft, live)
            out, accepted, lp = self._verify(sampling, nlp, *inputs, slots=slots[:len(group)])
            out, accepted = np.asarray(out), np.asarray(accepted)
            lp = None if lp is None else tuple(np.asarray(a) for a in _lp_arrays(lp))
            self.counters["verify_rows"] += len(group)
            self.counters["drafted_tokens"] += int(num_draft.sum())
            self.counters["accepted_tokens"] += int(accepted[:len(group)].sum())
            for i, r in enumerate(group):
                r.drawn += int(accepted[i]) + 1
                self._emit(r, out[i, :accepted[i] + 1], None if lp is None else tuple(a[i] for a in lp))

    def _verify(self, sampling: bool, logprobs: int | None, *inputs, slots=()):
        """steps.verify_sampled on self.cache and self.sampling (and self.mtp with MTP drafting, all donated);
        returns (out, accepted, TokenLogprobs or None) and keeps the new state."""
        fn = functools.partial(steps.verify_sampled, sampling_rows=sampling, logprobs=logprobs)
        mtp = () if self.mtp is None else (self.mtp,)
        donate = (1, 2) if self.mtp is None else (1, 2, 7)
        out, accepted, self.cache, self.sampling, new_mtp, lp = self.call(
            "verify", fn, self.cache, self.sampling, *inputs, *mtp, decode=True, donate_argnums=donate, slots=slots,
            static=(sampling, logprobs))
        if self.mtp is not None:
            self.mtp = new_mtp
        return out, accepted, lp

    def _mtp_drafts(self, group: list[Request], slots: list[int], limits: dict[int, int]) -> dict[int, list[int]]:
        """Each request's MTP drafts (up to its limit) from its pending token, for one verify batch."""
        nd = self.speculative.num_draft
        pending = [r.pending for r in group] + [0] * (len(slots) - len(group))
        d, self.mtp = self.call("mtp_draft", functools.partial(steps.mtp_draft_step, num_draft=nd), self.cache,
                                self.mtp, *self._devs(np.array(slots, np.int32), np.array(pending, np.int32)),
                                decode=True, donate_argnums=(2,), slots=slots[:len(group)], static=nd)
        d = np.asarray(d)
        return {r.rid: d[i, :max(limits[r.rid], 0)].tolist() for i, r in enumerate(group)}

    # ---- prefill -------------------------------------------------------------------------------
    def _cut(self, r: Request, n: int) -> int | None:
        """The snapshot point in r's next n prompt tokens: the last block boundary in (done, done+n] not
        cached yet, or None."""
        if self.prefix_cache is None or r.score:
            return None
        b = self.prefix_cache.block
        m = (r.done + n) // b * b
        if m <= r.done or m < b or self.prefix_cache.contains(r.prompt[:m]):
            return None
        return m

    def _prefill(self, reqs: list[Request]) -> None:
        """One prefill chunk for the waiting prompts (in order, under the token budget): planned, dispatched,
        then its snapshots inserted and the first tokens of the prompts it completes drawn."""
        chunk = self._plan_chunk(reqs)
        entry, inputs = self._chunk_inputs(chunk)
        out = self._prefill_call(entry, inputs, slots=[r.slot for r, _ in chunk.rows])
        self.counters["prefill_tokens"] += sum(n for _, n in chunk.rows)
        self._insert_snapshots(chunk, out)
        self._after_chunk(chunk, out, inputs.slots)

    def _plan_chunk(self, reqs: list[Request]) -> _Chunk:
        """Which prompts go into this chunk and how many tokens of each; where a snapshot is cut."""
        budget, rows, captures = self.budget, [], []
        max_rows, max_tokens = self.prefill_buckets[-1], self.token_buckets[-1]
        for r in reqs:
            if budget <= 0 or len(rows) == max_rows:
                break
            n = min(len(r.prompt) - r.done, budget, max_tokens)
            m = self._cut(r, n) if len(captures) < self.capture_rows else None
            if m is not None:
                if not self.replay_tail:
                    n = m - r.done                     # two-pass split: this chunk ends at the cut
                captures.append((len(rows), r, m))
            rows.append((r, n))
            budget -= n
        scoring = any(r.score for r, _ in rows)
        if scoring and self.replay_tail:
            captures = []                              # one variant fewer: no in-pass capture beside scoring
        return _Chunk(rows, captures, scoring, in_pass=bool(captures) and self.replay_tail)

    def _chunk_inputs(self, chunk: _Chunk) -> tuple[str, _ChunkInputs]:
        """The chunk's padded device inputs and the executable's entry name (capture and scoring variants)."""
        B = pick_bucket(len(chunk.rows), self.prefill_buckets, "prefill batch")
        T = pick_bucket(max(n for _, n in chunk.rows), self.token_buckets, "prefill chunk")
        ids, lengths = np.zeros((B, T), np.int32), np.zeros(B, np.int32)
        slots = np.full(B, self.pad, np.int32)
        for b, (r, n) in enumerate(chunk.rows):
            ids[b, :n] = r.prompt[r.done:r.done + n]
            lengths[b], slots[b] = n, r.slot
        inputs = _ChunkInputs(self._dev_cached(slots), self._dev(ids), self._dev(lengths))
        entry = "prefill"
        if chunk.in_pass:
            cuts, rows = lengths.copy(), np.zeros(self.capture_rows, np.int32)
            for c, (b, r, m) in enumerate(chunk.captures):
                cuts[b], rows[c] = m - r.done, b
            inputs = inputs._replace(cuts=self._dev(cuts), capture_rows=self._dev(rows))
            entry = "prefill_capture"
        if chunk.scoring:
            targets = np.zeros((B, T), np.int32)
            for b, (r, n) in enumerate(chunk.rows):
                nxt = r.prompt[r.done + 1:r.done + n + 1]
                targets[b, :len(nxt)] = nxt
            inputs = inputs._replace(targets=self._dev(targets))
            entry += "_score"
        return entry, inputs

    def _insert_snapshots(self, chunk: _Chunk, out: steps.PrefillOut) -> None:
        """Each capture's state at its cut into the prefix cache (from the pass, or read from the slot after a
        two-pass chunk that ended at the cut)."""
        for c, (b, r, m) in enumerate(chunk.captures):
            if r.adapter is not None:                  # an adapter's states are not the base's: not cached
                continue
            state = out.captured[c] if chunk.in_pass else self._slot_state(r.slot)
            mtp = {}
            if self.mtp is not None:                   # the hidden state at position m-1, the MTP blocks before it
                hidden = out.captured_hidden[c] if chunk.in_pass else self._mtp_hidden(r.slot)
                mtp = dict(mtp_hidden=hidden, mtp_block=functools.partial(self._mtp_block, r.slot))
            self.prefix_cache.insert(r.prompt[:m], state, functools.partial(self._kv_block, r.slot), **mtp)

    def _after_chunk(self, chunk: _Chunk, out: steps.PrefillOut, slots) -> None:
        """Advance each prompt; scoring rows get their log-probs (read back later), a completed prompt its first
        token (drawn on the device), a request for no new tokens its end."""
        draw, scored = np.zeros(slots.shape[0], bool), []
        for b, (r, n) in enumerate(chunk.rows):
            if r.score:
                scored.append((b, r, min(n, len(r.prompt) - 1 - r.done), r.done + n == len(r.prompt)))
            r.done += n
            if r.done == len(r.prompt) and not r.score:
                if r.max_new_tokens == 0:
                    self._finish(r, "length")
                else:
                    draw[b] = True
        if scored:
            self._later((out.target_logprobs,), lambda lp: self._scored(lp, scored))
        if draw.any():
            self._sample(out.logits, [r for r, _ in chunk.rows], slots, draw)

    def _scored(self, lp: np.ndarray, scored: list) -> None:
        """A prefill chunk's log-probs read back: each scoring row keeps those of its real next tokens."""
        for b, r, keep, last in scored:
            r.logprobs.extend(lp[b, :max(keep, 0)].tolist())
            if last:
                self._finish(r, "score")

    def _prefill_call(self, entry: str, inputs: _ChunkInputs, slots=()) -> steps.PrefillOut:
        """steps.prefill_step on self.cache (and self.mtp with MTP drafting, both donated); keeps the new state."""
        if self.mtp is None:
            out = self.call(entry, steps.prefill_step, self.cache, *inputs, donate_argnums=(1,), slots=slots)
        else:
            out = self.call(entry, steps.prefill_step, self.cache, *inputs, self.mtp, donate_argnums=(1, 8),
                            slots=slots)
            self.mtp = out.mtp
        self.cache = out.cache
        return out

    def _slot_state(self, slot: int) -> SlotState:
        return self._state_op("slot_ssm_state", steps.slot_ssm_state, self.cache, self._dev(slot))

    def _mtp_hidden(self, slot: int):
        return self.exe.run("mtp_slot_hidden", steps.mtp_slot_hidden, self.mtp, self._dev(slot))

    # ---- warm-up -------------------------------------------------------------------------------
    def warmup(self, *, sampling: bool = False, score: bool = False, logprobs: bool = False) -> int:
        """Compile every executable the engine can reach (all on the padding slot, so no live state changes).
        sampling / score / logprobs: also the sampling, scoring and log-prob returning variants. Returns the number
        of compiles."""
        lp_variants = [None, 0, MAX_LOGPROBS] if logprobs else [None]
        before = self.compiles
        pad = self.pad
        mb = max(self.capture_rows, 1)
        for B in self.prefill_buckets:
            slots = self._dev(np.full(B, pad))
            for T in self.token_buckets:
                ids, lengths = self._dev(np.zeros((B, T))), self._dev(np.zeros(B))
                variants = [("prefill", None, None, None)]
                if self.prefix_cache is not None and self.replay_tail:
                    variants.append(("prefill_capture", self._dev(np.zeros(B)), self._dev(np.zeros(mb)), None))
                if score:
                    variants.append(("prefill_score", None, None, self._dev(np.zeros((B, T)))))
                for entry, cuts, rows, targets in variants:
                    self._prefill_call(entry, _ChunkInputs(slots, ids, lengths, cuts, rows, targets))
        V = self.model.config.vocab_size
        for B in sorted(set(self.prefill_buckets) | set(self.decode_buckets)):
            logits = jax.device_put(np.zeros((B, V), np.float32), self._logits_sharding)
            for s in ([False, True] if sampling else [False]):
                for n in lp_variants:
                    _, self.sampling, _ = self.exe.run(
                        "sample", functools.partial(draw_slots, sampling=s, logprobs=n), logits, self.sampling,
                        self._dev_cached(np.full(B, pad, np.int32)), self._dev_cached(np.zeros(B, bool)),
                        donate_argnums=(1,), static=(s, n))
        self.sampling = self.exe.run("start_request", start_request, self.sampling,
                                     *self._devs(np.int32(pad), np.float32(0), np.float32(1), np.int32(0),
                                                 np.float32(0), np.int32(0)), donate_argnums=(0,))
        if self.decode_exe.graphs:
            for B in self.decode_buckets:
                _, self.cache = self.call("decode", steps.decode_pending_step, self.cache, self.sampling.pending,
                                          self._dev_cached(np.full(B, pad, np.int32)), decode=True,
                                          donate_argnums=(1,))
            if self.speculative is not None:
                k = self.speculative.num_draft + 1
                for n in self.verify_buckets:
                    if self.mtp is not None:
                        self._mtp_drafts([], [pad] * n, {})
                    for s in ([False, True] if sampling else [False]):
                        for nlp in lp_variants:
                            self._verify(s, nlp, *self._devs(np.full(n, pad, np.int32), np.zeros((n, k), np.int32),
                                                             np.zeros(n, np.int32), np.zeros(n, bool)))
        self.cache = self._state_op("zero_slot", steps.zero_slot, self.cache, self._dev(pad), donate_argnums=(0,))
        if self.prefix_cache is not None:
            state = self._state_op("slot_ssm_state", steps.slot_ssm_state, self.cache, self._dev(pad))
            self.cache = self._state_op("restore_ssm", steps.restore_ssm, self.cache, self._dev(pad), state,
                                        self._dev(0), donate_argnums=(0,))
            if self.cache.kv.num_layers:
                blk = self._kv_block(pad, 0)
                self.cache = self._state_op("kv_block_put", steps.kv_block_put, self.cache, self._dev(pad),
                                            self._dev(0), blk, donate_argnums=(0,))
            if self.mtp is not None:
                self.mtp = self.exe.run("mtp_restore_hidden", steps.mtp_restore_hidden, self.mtp, self._dev(pad),
                                        self._mtp_hidden(pad), donate_argnums=(0,))
                if self.mtp.kv.num_layers:
                    self.mtp = self.exe.run("mtp_block_put", steps.mtp_block_put, self.mtp, self._dev(pad),
                                            self._dev(0), self._mtp_block(pad, 0), donate_argnums=(0,))
        return self.compiles - before

    # ---- batch jobs ----------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | int | None = None, *,
                 stream: Callable[[int, int], None] | None = None, progress: bool | None = False,
                 adapter: str | None = None, **overrides) -> list[Generation]:
        """Continue each prompt (token ids, or strings when the model has a tokenizer) through the engine.
        params: one SamplingParams for all (request i then samples with its own stream (seed, i)), a list of one
        per prompt (each with its own seed as given), or max_new_tokens as before; keyword overrides (temperature=,
        stop=, logprobs=, ...) apply to each. stream(i, token) gets tokens as they come. adapter: a loaded LoRA
        adapter for every prompt (`submit` takes one per request)."""
        seqs, as_text = prompts_ids(prompts, self.model.tokenizer)
        return self.generate_ids(seqs, per_request(params, len(seqs), **overrides), as_text=as_text, stream=stream,
                                 progress=progress, adapter=adapter)

    def generate_ids(self, seqs: list[list[int]], params: list[SamplingParams], *, as_text: bool = False,
                     stream: Callable[[int, int], None] | None = None, progress: bool | None = False,
                     adapter: str | None = None) -> list[Generation]:
        """`generate` for prompts already as token ids, one SamplingParams each; as_text: give each Generation its
        text (the model's tokenizer)."""
        rids = []
        for i, (p, sp) in enumerate(zip(seqs, params)):
            cb = None if stream is None else (lambda _rid, t, i=i: stream(i, t))
            rids.append(self.submit(p, sp, on_token=cb, adapter=adapter))
        self._run_until(rids, progress)
        return [generation(self.pop(rid), self.model.tokenizer if as_text else None) for rid in rids]

    def score(self, ids, lengths=None, *, progress: bool | None = False) -> np.ndarray:
        """log p(ids[b, t+1] | ids[b, :t+1]) [B, T-1] float32, zero past each row's length."""
        ids = np.asarray(ids)
        if ids.ndim != 2 or ids.shape[1] < 2:
            raise ShapeError(f"ids: expected [B, T] token ids with T >= 2, got {list(ids.shape)}")
        B, T = ids.shape
        lengths = np.full(B, T) if lengths is None else np.asarray(lengths)
        if lengths.shape != (B,) or lengths.min() < 1 or lengths.max() > T:
            raise ShapeError(f"lengths: expected [{B}] integers in [1, {T}], got {lengths.tolist()}")
        rids = [self.submit_score(ids[b, :lengths[b]]) for b in range(B)]
        self._run_until(rids, progress)
        out = np.zeros((B, T - 1), np.float32)
        for b, rid in enumerate(rids):
            lp = self.pop(rid).logprobs
            out[b, :len(lp)] = lp
        return out

    def _run_until(self, rids: list[int], progress) -> None:
        from tqdm.auto import tqdm

        pending = set(rids)
        with tqdm(total=len(rids), disable=not progress if progress is not None else None, unit="req",
                  desc="engine") as bar:
            while pending:
                if not self.has_work:
                    raise RuntimeError(f"requests {sorted(pending)} are neither queued nor running")
                done = pending.intersection(self.step())
                pending -= done
                bar.update(len(done))

    # ---- counters ------------------------------------------------------------------------------
    @property
    def compiles(self) -> int:
        n = self.exe.total_compiles
        return n + (self.decode_exe.total_compiles if self.decode_exe is not self.exe else 0)

    def stats(self) -> dict:
        out = {"counters": dict(self.counters), "compiles": self.compiles, "executables": self.exe.stats()}
        if self.decode_exe is not self.exe:
            out["decode_executables"] = self.decode_exe.stats()
        if self.prefix_cache is not None:
            out["prefix_cache"] = self.prefix_cache.stats()
        return out


def generation(r: Request, tokenizer=None) -> Generation:
    """A finished request as a Generation: its text (cut before a stop string) when a tokenizer is given, its
    tokens' log-probs when it asked for them."""
    lp = r.want_logprobs is not None
    return Generation(tokens=list(r.tokens), text=tokenizer.decode(r.tokens)[:r.text_end] if tokenizer else None,
                      finish_reason=r.finish_reason, logprobs=list(r.logprobs) if lp else None,
                      top_logprobs=list(r.top_logprobs) if lp and r.want_logprobs else None)


# executables for model.generate, one registry per model: held while the model lives (a weak key), so that each
# call's engine (built for the batch's buckets) finds the steps its shapes compiled before
_GENERATE_EXECUTABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def generate_engine(model, batch: int, max_len: int) -> Engine:
    """An engine for one model.generate call: slots for `batch` prompts rounded up to a power of two (one batch
    bucket, so that requests finishing early do not compile smaller decode batches), max_len tokens each, on the
    model's executables registry. The engine itself is fresh (its cache and sampling state are the call's own,
    and it sees the model's current weights)."""
    exe = _GENERATE_EXECUTABLES.get(model)
    if exe is None:
        exe = _GENERATE_EXECUTABLES[model] = Executables(graphs=model.levers.graphs)
    B = bucket(batch)
    return Engine(model, max_slots=B, max_len=max_len, batch_buckets=(B,), prefill_batch_buckets=(B,),
                  executables=exe)
