"""DataParallelEngine: continuous batching over the data-parallel replicas of a model on a (dp, tp) mesh.

Each replica (data_parallel.replica: the model's weights on its row of the mesh) is served by an Engine of its own,
with its own slot pool, prefix cache and executables, so a request runs exactly as it would on that replica alone.
A request goes to the least-loaded replica when it is submitted (fewest queued + running requests; ties: the lowest
index) and stays there; Request.replica records which. `step()` steps every replica with work: each dispatches its
step before the next replica's is dispatched, and their devices differ, so the replicas compute side by side.
Request ids are the engine's own (each replica numbers its requests apart). In a multi-process run
(data_parallel.initialize) an engine serves this process's replicas: each process its own requests.
`Engine(model)` returns one of these when the model's mesh (or the mesh given) has dp > 1.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from metrale_jax import data_parallel
from metrale_jax.errors import ConfigError, RequestError
from metrale_jax.runtime.batch_jobs import BatchJobs
from metrale_jax.runtime.request import Request, check_callback


class DataParallelEngine(BatchJobs):
    """One Engine per data-parallel replica of `model` (this process's replicas), each built with the keyword
    arguments an Engine takes (max_slots, max_len, buckets, prefix cache, speculation, ...: per replica).
    engines[k] serves replica replica_ids[k]; its model is that replica."""

    def __init__(self, model, *, mesh=None, **kwargs):
        from metrale_jax.runtime.engine import Engine, _on_mesh

        self.model = _on_mesh(model, mesh)
        self.replica_ids = data_parallel.local_replicas(self.model)
        if not self.replica_ids:
            raise ConfigError("mesh", "no replica of the model lies on this process's devices alone (a replica's "
                                      "tensor-parallel devices must share a process)")
        self.engines = [Engine(data_parallel.replica(self.model, i), **kwargs) for i in self.replica_ids]
        self._where: dict[int, tuple[int, int]] = {}     # rid -> (engine index, the engine's own rid)
        self._rid: dict[tuple[int, int], int] = {}       # the inverse
        self._next_id = 0

    # ---- requests ------------------------------------------------------------------------------
    def _least_loaded(self) -> int:
        loads = [len(e.queue) + len(e.running) for e in self.engines]
        return loads.index(min(loads))

    def _record(self, k: int, local: int) -> int:
        rid, self._next_id = self._next_id, self._next_id + 1
        self._where[rid] = (k, local)
        self._rid[(k, local)] = rid
        r = self.engines[k].requests[local]
        r.replica = self.replica_ids[k]
        return rid

    def submit(self, prompt, params=None, *, on_token: Callable[[int, int], None] | None = None,
               adapter: str | None = None, **overrides) -> int:
        """Engine.submit on the least-loaded replica; returns this engine's request id (on_token gets it)."""
        check_callback("on_token", on_token, "on_token(id, token)")        # before it is wrapped below
        k = self._least_loaded()
        rid = self._next_id
        cb = None if on_token is None else (lambda _local, t: on_token(rid, t))
        local = self.engines[k].submit(prompt, params, on_token=cb, adapter=adapter, **overrides)
        return self._record(k, local)

    def _request(self, prompt, params=None, **kwargs) -> Request:
        """A replica's Engine._request (they share the model and the limits): the checks, nothing queued."""
        return self.engines[0]._request(prompt, params, **kwargs)

    def _score_request(self, ids, name: str = "ids") -> Request:
        return self.engines[0]._score_request(ids, name)

    def submit_score(self, ids) -> int:
        """Engine.submit_score on the least-loaded replica."""
        k = self._least_loaded()
        return self._record(k, self.engines[k].submit_score(ids))

    def pop(self, rid: int) -> Request:
        """Remove and return a finished request (Request.rid: this engine's id; Request.replica: its replica)."""
        if rid not in self._where:
            raise RequestError(f"rid: request {rid} is unknown")
        k, local = self._where[rid]
        try:
            r = self.engines[k].pop(local)
        except RequestError:                             # named by this engine's id, not the replica's
            raise RequestError(f"rid: request {rid} is not finished yet (run the engine)") from None
        del self._where[rid], self._rid[(k, local)]
        r.rid = rid
        return r

    @property
    def requests(self) -> dict[int, Request]:
        """Requests submitted and not popped, by this engine's ids."""
        return {rid: self.engines[k].requests[local] for rid, (k, local) in self._where.items()}

    @property
    def has_work(self) -> bool:
        return any(e.has_work for e in self.engines)

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[int]:
        """One step of every replica with work; the ids of the requests that finished in it."""
        done = []
        for k, e in enumerate(self.engines):
            if e.has_work:
                done += [self._rid[(k, local)] for local in e.step()]
        return done

    def run(self, progress: bool | None = False) -> None:
        """Step until every replica's queue and pool are empty (progress: a tqdm bar over requests)."""
        from tqdm.auto import tqdm

        total = sum(len(e.queue) + len(e.running) for e in self.engines)
        with tqdm(total=total, disable=not progress if progress is not None else None, unit="req",
                  desc="engine") as bar:
            while self.has_work:
                bar.update(len(self.step()))

    def warmup(self, **kwargs) -> int:
        """Engine.warmup on every replica; the number of compiles."""
        return sum(e.warmup(**kwargs) for e in self.engines)

    # ---- counters ------------------------------------------------------------------------------
    @property
    def compiles(self) -> int:
        registries = {id(x): x for e in self.engines for x in (e.exe, e.decode_exe)}
        return sum(x.total_compiles for x in registries.values())

    @property
    def counters(self) -> collections.Counter:
        return sum((e.counters for e in self.engines), collections.Counter())

    def stats(self) -> dict:
        return {"counters": dict(self.counters), "compiles": self.compiles,
                "replicas": {i: e.stats() for i, e in zip(self.replica_ids, self.engines)}}
