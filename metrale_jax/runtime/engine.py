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
replicated, and the logits come out split over the vocabulary (sampling reduces over it). On a mesh with
dp > 1, Engine(...) gives a DataParallelEngine (runtime/engine_dp.py): one Engine per replica.
"""

from __future__ import annotations

import collections
import functools
import time
import typing
import weakref
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from metrale_jax import adapters, data_parallel, sharding
from metrale_jax.arguments import integer
from metrale_jax.errors import ConfigError, RequestError, ShapeError
from metrale_jax.layers import lora
from metrale_jax.runtime import steps
from metrale_jax.runtime.batch_jobs import BatchJobs
from metrale_jax.runtime.executables import Executables, bucket, check_buckets, pick_bucket, powers_of_two
from metrale_jax.runtime.engine_prefix import PrefixSnapshots
from metrale_jax.runtime.engine_speculation import Speculation, _groups
from metrale_jax.runtime.prefill_plan import Chunk, chunk_arrays, plan_chunk
from metrale_jax.runtime.request import (Request, check_callback, check_prompt, keep_logprobs, logprobs_bucket,
                                         lp_arrays, stop_string_ends, stops_for)
from metrale_jax.runtime.sampling import SlotSampling, draw_slots, start_request
from metrale_jax.runtime.sampling_params import MAX_LOGPROBS, SamplingParams, resolve, stream_seed
from metrale_jax.runtime.speculative import MtpDrafter, SpeculativeConfig
from metrale_jax.state.slots import SlotAllocator


class _ChunkInputs(typing.NamedTuple):
    """steps.prefill_step's inputs after the cache, on the device."""

    slots: jax.Array
    ids: jax.Array
    lengths: jax.Array
    cuts: jax.Array | None = None
    capture_rows: jax.Array | None = None
    targets: jax.Array | None = None


def _sizes(levers, max_slots: int, max_len: int, prefill_token_budget: int | None) -> tuple[int, int]:
    """(prefill token budget, max_len) checked: the budget defaults to the model's levers."""
    budget = levers.prefill_token_budget if prefill_token_budget is None else prefill_token_budget
    budget = integer("prefill_token_budget", budget, 1)
    integer("max_slots", max_slots, 1)
    return budget, integer("max_len", max_len, 1)


def _eos_ids(eos_ids, vocab_size: int) -> frozenset[int]:
    """The engine's stop tokens as given (a list of token ids in the vocabulary), checked."""
    if isinstance(eos_ids, (str, bytes)) or not isinstance(eos_ids, (Sequence, set, frozenset, np.ndarray)):
        raise ConfigError("eos_ids", f"expected a list of token ids, got {type(eos_ids).__name__}")
    return frozenset(integer("eos_ids", e, 0, vocab_size - 1, "the vocabulary") for e in eos_ids)


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
        if model.adapters:
            raise ConfigError("mesh", "an unsharded model with LoRA adapters is not split over a mesh here (its copy "
                                      "would lose them); build the model on the mesh, then load the adapters")
        return type(model)(model.config, model.checkpoint_containers(), dtype=model.dtype, levers=model.levers,
                           tokenizer=model.tokenizer, notes=model.load_notes, mesh=mesh,
                           quant_config=model.quant_config)
    if tp != want:
        raise ConfigError("mesh", f"the model is split over {tp.size} device(s) {tp.mesh.device_ids.tolist()} "
                                  f"(axis {tp.axis!r}), not over the mesh given ({want.size} device(s) "
                                  f"{want.mesh.device_ids.tolist()}, axis {want.axis!r}); pass the model's own "
                                  "mesh or none")
    return model


def _replicas(model, mesh) -> int:
    """The data-parallel size an engine on (model, mesh) serves: the mesh's, else the model's own."""
    return sharding.tensor_parallel(mesh).dp if mesh is not None else data_parallel.num_replicas(model)


class Engine(PrefixSnapshots, Speculation, BatchJobs):
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
    mesh: serve the model tensor / expert parallel over this mesh (sharding.make_mesh); a mesh (or a model's
    mesh) with dp > 1 gives a DataParallelEngine, one such engine per replica (max_slots each). Default: the model's
    own mesh when it was built with one (from_pretrained / from_config(..., mesh=...)), else one device. An
    unsharded model given a mesh is split over it through the host (engine.model is the split copy).
    ssm_state_dtype: the Mamba state's dtype in the slot pool (default the config's mamba_ssm_cache_dtype,
    float32); see NemotronH.new_cache.
    """

    def __new__(cls, model=None, *args, mesh=None, **kwargs):
        """An Engine, or for a model (or mesh) with several data-parallel replicas a DataParallelEngine: one
        Engine per replica, each with its own slot pool (runtime/engine_dp.py)."""
        if cls is Engine and _replicas(model, mesh) > 1:
            from metrale_jax.runtime.engine_dp import DataParallelEngine

            return DataParallelEngine(model, *args, mesh=mesh, **kwargs)
        return super().__new__(cls)

    def __init__(self, model, *, max_slots: int = 8, max_len: int = 2048, prefill_token_budget: int | None = None,
                 batch_buckets: Sequence[int] | None = None, token_buckets: Sequence[int] | None = None,
                 prefill_batch_buckets: Sequence[int] | None = None,
                 min_token_bucket: int = 16, prefix_cache_bytes: int = 0, prefix_block: int | None = None,
                 capture_rows: int = 1, speculative: SpeculativeConfig | None = None, drafter=None, eos_ids=None,
                 executables: Executables | None = None, decode_executables: Executables | None = None,
                 compiler_options=None, mesh=None, ssm_state_dtype: str | None = None):
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
        self.speculative = speculative
        self.drafter = self._make_drafter(speculative, drafter)        # checked before the pool is allocated
        self.capture_rows = integer("capture_rows", capture_rows, 1)
        self.eos_ids = model.eos_ids() if eos_ids is None else _eos_ids(eos_ids, model.config.vocab_size)
        self._init_buckets(max_slots, batch_buckets, token_buckets, prefill_batch_buckets, min_token_bucket)
        self.prefix_cache = self._make_prefix_cache(prefix_cache_bytes, prefix_block)
        self.cache = model.new_cache(max_slots, max_len, ssm_state_dtype=ssm_state_dtype)
        self.sampling = jax.device_put(SlotSampling.create(self.cache.num_slots), self._replicated)
        self._inflight: collections.deque = collections.deque()   # (device arrays, handler) not read back yet
        self.allocator = SlotAllocator(self.cache.num_slots)
        self.pad = self.cache.padding_slot
        self._init_executables(executables, decode_executables, compiler_options)
        self.replay_tail = self.caps.replay_tail_capture    # every layer: in-pass capture, else two passes
        self.mtp = model.new_mtp_cache(max_slots, max_len) if isinstance(self.drafter, MtpDrafter) else None
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
        self.batch_buckets = check_buckets("batch_buckets", batch_buckets, powers_of_two(1, bucket(max_slots)))
        integer("min_token_bucket", min_token_bucket, 1)
        top = bucket(min(self.budget, self.max_len))
        self.token_buckets = check_buckets("token_buckets", token_buckets, powers_of_two(min(min_token_bucket, top), top))
        self.prefill_buckets = check_buckets("prefill_batch_buckets", prefill_batch_buckets, self.batch_buckets)
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
        max_new_tokens=) replace its fields. on_token(id, token) streams tokens; if it raises, its request ends
        with finish_reason 'error' and the exception as Request.error (the other requests go on).
        stop: token ids and strings (strings need the model's tokenizer) that end the request with
        finish_reason 'stop': a stop token is not kept; with a stop string the tokens through the one that
        completed it are kept and Generation.text ends before it. The model's eos ids end it with 'eos'.
        adapter: the name of a LoRA adapter the model has loaded (None: the base weights); rows with different
        adapters share a step."""
        return self._enqueue(self._request(prompt, params, on_token=on_token, adapter=adapter, **overrides))

    def _request(self, prompt, params=None, *, on_token=None, adapter=None, **overrides) -> Request:
        """submit's request, checked (every error submit raises) but not queued: nothing in the engine changes."""
        tokens = check_prompt(prompt, "prompt", self.model.config.vocab_size)
        adapters.index_of(self.model, adapter)                     # ConfigError naming an unknown adapter
        if adapter is not None and self._slot_adapters is None:
            raise ConfigError("adapter", f"{adapter!r} was loaded after this Engine was made (it serves the model's "
                                         f"weights as they were then); load adapters before creating the Engine")
        check_callback("on_token", on_token, "on_token(id, token)")
        sp = resolve(params, **overrides)
        if len(tokens) + sp.max_new_tokens > self.max_len:
            raise ShapeError(f"prompt: {len(tokens)} tokens + max_new_tokens {sp.max_new_tokens} exceed the engine's "
                             f"max_len {self.max_len}")
        return Request(rid=0, prompt=tokens, max_new_tokens=sp.max_new_tokens, temperature=sp.temperature,
                       top_p=sp.top_p, seed=stream_seed(sp.seed),
                       top_k=min(sp.top_k, self.model.config.vocab_size),   # int32 on the device
                       min_p=sp.min_p, want_logprobs=sp.logprobs, **stops_for(sp.stop, self.model),
                       on_token=on_token, adapter=adapter)

    def submit_score(self, ids) -> int:
        """Queue a scoring request: log p(ids[t+1] | ids[:t+1]) for every t."""
        return self._enqueue(self._score_request(ids))

    def _score_request(self, ids, name: str = "ids") -> Request:
        """submit_score's request, checked (`name`: the argument, for the messages) but not queued."""
        tokens = check_prompt(ids, name, self.model.config.vocab_size)
        if len(tokens) > self.max_len:
            raise ShapeError(f"{name}: {len(tokens)} tokens exceed the engine's max_len {self.max_len}")
        return Request(rid=0, prompt=tokens, max_new_tokens=0, score=True)

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
            raise RequestError(f"rid: request {rid} is {'unknown' if r is None else 'not finished yet (run the engine)'}")
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
                keep_logprobs(r, lp, j)
            self.counters["generated_tokens"] += 1
            if r.drafter is not None:
                r.drafter.append(t)
            if r.on_token is not None:
                try:
                    r.on_token(r.rid, t)
                except Exception as e:                 # the caller's code: it ends its own request only
                    r.error = e
                    return self._finish(r, "error")
            if r.stop_strings and stop_string_ends(r, self.model.tokenizer.decode):
                return self._finish(r, "stop")
            if len(r.tokens) >= r.max_new_tokens:
                return self._finish(r, "length")
        r.pending = r.tokens[-1]

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
        n = logprobs_bucket(r for _, r in rows)
        tokens, self.sampling, lp = self.exe.run(
            "sample", functools.partial(draw_slots, sampling=sampling, logprobs=n), logits, self.sampling, slots,
            self._dev_cached(np.asarray(draw, bool)), donate_argnums=(1,), static=(sampling, n))
        for _, r in rows:
            r.drawn += 1
        if lp is None:
            self._later((tokens,), lambda toks: [self._emit(r, [toks[b]]) for b, r in rows])
        else:
            self._later((tokens, *lp_arrays(lp)), lambda toks, *lps: [
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

    # ---- prefill -------------------------------------------------------------------------------
    def _prefill(self, reqs: list[Request]) -> None:
        """One prefill chunk for the waiting prompts (in order, under the token budget): planned, dispatched,
        then its snapshots inserted and the first tokens of the prompts it completes drawn."""
        chunk = plan_chunk(reqs, budget=self.budget, max_rows=self.prefill_buckets[-1],
                           max_tokens=self.token_buckets[-1], cut=self._cut, capture_rows=self.capture_rows,
                           replay_tail=self.replay_tail)
        entry, arrays = chunk_arrays(chunk, batch_buckets=self.prefill_buckets, token_buckets=self.token_buckets,
                                     pad=self.pad, capture_rows=self.capture_rows)
        inputs = _ChunkInputs(self._dev_cached(arrays.pop("slots")), **{k: self._dev(v) for k, v in arrays.items()})
        out = self._prefill_call(entry, inputs, slots=[r.slot for r, _ in chunk.rows])
        self.counters["prefill_tokens"] += sum(n for _, n in chunk.rows)
        self._insert_snapshots(chunk, out)
        self._after_chunk(chunk, out, inputs.slots)

    def _after_chunk(self, chunk: Chunk, out: steps.PrefillOut, slots) -> None:
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


# executables for model.generate, one registry per model: held while the model lives (a weak key), so that each
# call's engine (built for the batch's buckets) finds the steps its shapes compiled before
_GENERATE_EXECUTABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def generate_engine(model, batch: int, max_len: int) -> Engine:
    """An engine for one model.generate call: slots for `batch` prompts (on a dp mesh, per replica: its share)
    rounded up to a power of two (one batch bucket, so that requests finishing early do not compile smaller decode
    batches), max_len tokens each, on the model's executables registry. The engine itself is fresh (its cache and
    sampling state are the call's own, and it sees the model's current weights)."""
    exe = _GENERATE_EXECUTABLES.get(model)
    if exe is None:
        exe = _GENERATE_EXECUTABLES[model] = Executables(graphs=model.levers.graphs)
    local = len(data_parallel.local_replicas(model)) if _replicas(model, None) > 1 else 1
    B = bucket(-(-batch // max(local, 1)))                       # each of this process's replicas' share
    return Engine(model, max_slots=B, max_len=max_len, batch_buckets=(B,), prefill_batch_buckets=(B,),
                  executables=exe)
