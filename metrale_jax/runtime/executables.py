"""Compiled executables: the JAX form of the seed's CUDA graphs.

An executable is compiled ahead of time (`jax.jit(fn).lower(args).compile()`) once per entry point and
argument shapes (the caller pads inputs to batch / token buckets) and reused for every later step;
the state pool is donated so XLA updates it in place. When graphs are off (a layer vetoes them, or
ModelLevers.graphs is False) the same function is called directly: op by op, no executable.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence

import jax
from jax.sharding import NamedSharding

FROZEN_KEPT = 8              # frozen arguments whose signature id is remembered (see Executables._frozen_signature)


def bucket(n: int, minimum: int = 1, maximum: int | None = None) -> int:
    """The smallest power of two >= max(n, minimum); inputs are padded to it."""
    b = max(int(minimum), 1)
    while b < n:
        b *= 2
    if maximum is not None and b > maximum:
        if n > maximum:
            raise ValueError(f"{n} exceeds the largest bucket {maximum}")
        b = maximum
    return b


def pick_bucket(n: int, buckets: Sequence[int], what: str = "size") -> int:
    """The smallest of `buckets` (sorted ascending) that holds n."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{what} {n} exceeds the largest bucket {buckets[-1]}")


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2 lo, 4 lo, ... below hi, then hi: the default buckets of a size up to hi."""
    out, b = [], max(1, lo)
    while b < hi:
        out.append(b)
        b *= 2
    return tuple(out) + (hi,)


def check_buckets(name: str, given, default) -> tuple[int, ...]:
    """Buckets as a sorted tuple of positive sizes (`default` when none are given); ConfigError naming `name`."""
    from metrale_jax.arguments import integer
    from metrale_jax.errors import ConfigError

    if given is not None and (isinstance(given, (str, bytes)) or not isinstance(given, Iterable)):
        raise ConfigError(name, f"expected a list of positive sizes, got {type(given).__name__}")
    b = tuple(sorted({integer(name, x, 1) for x in (default if given is None else given)}))
    if not b:
        raise ConfigError(name, f"expected positive sizes, got {given}")
    return b


def _placement(x) -> Hashable:
    """An array's sharding as a key: a NamedSharding by mesh and spec without trailing Nones, since a compiled
    step returns P(None, 'tp') for an input placed as P(None, 'tp', None) (the same layout)."""
    s = getattr(x, "sharding", None)
    if not isinstance(s, NamedSharding):
        return s
    spec = tuple(s.spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return "named", s.mesh, spec, s.memory_kind


def _signature(args: Sequence) -> tuple:
    leaves, tree = jax.tree_util.tree_flatten(args)
    return tree, tuple((tuple(x.shape), x.dtype, _placement(x)) if hasattr(x, "shape")
                       else ("python", type(x).__name__) for x in leaves)


class Executables:
    """Compile-once cache of executables with compile / hit / eager counters per entry point.

    Plain Python values in the arguments are keyed by type only: bind static options with
    functools.partial and name them in `static` (part of the cache key). Arguments in frozen_argnums
    (e.g. a model's weights, passed as the same list every step) have their part of the key computed
    once per object. compiler_options are passed to every compile (e.g. a lower XLA optimisation level
    for CPU tests).
    """

    def __init__(self, *, graphs: bool = True, compiler_options: Mapping[str, object] | None = None):
        self.graphs = graphs
        self.compiler_options = dict(compiler_options) if compiler_options else None
        self.compiles: collections.Counter[str] = collections.Counter()
        self.hits: collections.Counter[str] = collections.Counter()
        self.eager_runs: collections.Counter[str] = collections.Counter()
        self._cache: dict[tuple, jax.stages.Compiled] = {}
        self._by_slot: dict[int, set[tuple]] = collections.defaultdict(set)
        # id -> (the object, its signature's id), the latest few objects (an engine per model.generate call passes
        # a new weights list each time; older ones are dropped rather than kept alive)
        self._frozen: collections.OrderedDict[int, tuple[object, int]] = collections.OrderedDict()
        self._signature_ids: dict[tuple, int] = {}

    def _frozen_signature(self, arg) -> int:
        """A small id standing for the argument's signature (equal signatures, equal ids): the cache key stays
        cheap to hash, though a model's signature has hundreds of leaves (tuples do not cache their hash, and
        the key is hashed once per call and once per slot it serves)."""
        hit = self._frozen.get(id(arg))
        if hit is None or hit[0] is not arg:
            sig = _signature((arg,))
            hit = self._frozen[id(arg)] = (arg, self._signature_ids.setdefault(sig, len(self._signature_ids)))
            if len(self._frozen) > FROZEN_KEPT:
                self._frozen.popitem(last=False)
        else:
            self._frozen.move_to_end(id(arg))
        return hit[1]

    def intern(self, obj: Hashable) -> int:
        """A small id standing for a hashable object (equal objects, equal ids), e.g. a model's treedef, whose
        static data (levers, config) the frozen leaves' signature does not show; pass it in `static`."""
        return self._signature_ids.setdefault(("interned", obj), len(self._signature_ids))

    def run(self, entry: str, fn: Callable, *args, donate_argnums: tuple[int, ...] = (),
            slots: Iterable[int] = (), static: Hashable = None, frozen_argnums: tuple[int, ...] = ()):
        """fn(*args) through its executable for these argument shapes (compiled on first use)."""
        if not self.graphs:
            self.eager_runs[entry] += 1
            return fn(*args)
        if frozen_argnums:
            sig = (tuple(self._frozen_signature(args[i]) for i in frozen_argnums),
                   _signature([a for i, a in enumerate(args) if i not in frozen_argnums]))
        else:
            sig = _signature(args)
        key = (entry, static, donate_argnums, frozen_argnums, sig)
        exe = self._cache.get(key)
        if exe is None:
            lowered = jax.jit(fn, donate_argnums=donate_argnums).lower(*args)
            exe = lowered.compile(compiler_options=self.compiler_options) if self.compiler_options \
                else lowered.compile()
            self._cache[key] = exe
            self.compiles[entry] += 1
        else:
            self.hits[entry] += 1
        for s in slots:
            self._by_slot[int(s)].add(key)
        return exe(*args)

    def drop_slot(self, slot: int) -> int:
        """Forget the executables that served `slot` (graph_stale_on_new_sequence); returns how many."""
        keys = self._by_slot.pop(int(slot), set())
        for k in keys:
            self._cache.pop(k, None)
        for other in self._by_slot.values():
            other.difference_update(keys)
        return len(keys)

    def compiled(self, entry: str) -> list[jax.stages.Compiled]:
        """The executables compiled for `entry` (e.g. to read their HLO)."""
        return [exe for key, exe in self._cache.items() if key[0] == entry]

    @property
    def size(self) -> int:
        return len(self._cache)

    @property
    def total_compiles(self) -> int:
        return sum(self.compiles.values())

    def stats(self) -> dict[str, dict[str, int]]:
        return {"compiles": dict(self.compiles), "hits": dict(self.hits), "eager_runs": dict(self.eager_runs)}
