"""Prefix cache: slot snapshots at block-aligned cut points, keyed by the exact token prefix.

A trie of token blocks (block = a multiple of the SSD chunk size). The node at depth j stands for the
prefix tokens[:j*block]; it holds the keys/values of its own block (positions (j-1)*block .. j*block-1,
shared by every longer prefix) and, when a snapshot was taken there, the Mamba states at that cut.
With an MTP head (MTP drafting) a node also holds the MTP keys/values of the pairs (h_p, tok_{p+1}) whose
next token lies in its block, positions (j-1)*block-1 .. j*block-2 (the pair at a cut's last position needs
the token after the cut, so it belongs to the child block), and a snapshot the main model's final-normed
hidden state at position cut-1 (the h of the MTP's next pair). A lookup returns the deepest snapshot on the
prompt's path with the blocks leading to it. Snapshots are evicted least recently used first until the
bytes held (states + blocks, MTP parts included) fit the budget; a block no remaining snapshot needs goes
with them.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

import jax

from metrale_jax.errors import ConfigError, ShapeError
from metrale_jax.state.kv_pool import KvSlotState
from metrale_jax.state.ssm_pool import SlotState


def tree_nbytes(tree) -> int:
    return int(sum(x.nbytes for x in jax.tree.leaves(tree)))


class _Node:
    __slots__ = ("key", "parent", "depth", "children", "kv", "mtp_kv", "snap", "mtp_hidden")

    def __init__(self, key: tuple, parent: _Node | None, kv: KvSlotState | None, mtp_kv: KvSlotState | None):
        self.key = key
        self.parent = parent
        self.depth = 0 if parent is None else parent.depth + 1
        self.children: dict[tuple, _Node] = {}
        self.kv = kv
        self.mtp_kv = mtp_kv
        self.snap: SlotState | None = None
        self.mtp_hidden: jax.Array | None = None

    def block_bytes(self) -> int:
        return tree_nbytes((self.kv, self.mtp_kv))

    def snap_bytes(self) -> int:
        return tree_nbytes((self.snap, self.mtp_hidden))


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """length tokens are cached: the Mamba states after them and their KV blocks (in order); with an MTP
    head also the hidden state at position length-1 and the MTP KV blocks (block j: positions
    j*block-1 .. (j+1)*block-2; block 0: 0 .. block-1, its last row scratch that block 1 or the prefill
    after a restore rewrites), else None and ()."""

    length: int
    ssm: SlotState
    kv_blocks: tuple[KvSlotState, ...]
    mtp_hidden: jax.Array | None = None
    mtp_blocks: tuple[KvSlotState, ...] = ()


class PrefixCache:
    """LRU trie of snapshots, bounded by max_bytes.  Counters: hits, misses, hit_tokens, inserts, evictions."""

    def __init__(self, block: int, max_bytes: int):
        if block < 1:
            raise ConfigError("prefix_block", f"must be >= 1, got {block}")
        if max_bytes < 0:
            raise ConfigError("prefix_cache_bytes", f"must be >= 0, got {max_bytes}")
        self.block = int(block)
        self.max_bytes = int(max_bytes)
        self.nbytes = 0
        self._root = _Node((), None, None, None)
        self._lru: collections.OrderedDict[int, _Node] = collections.OrderedDict()   # snapshot nodes
        self.hits = self.misses = self.hit_tokens = self.inserts = self.evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def _blocks(self, tokens: Sequence[int], n: int):
        b = self.block
        return [tuple(int(t) for t in tokens[j * b:(j + 1) * b]) for j in range(n)]

    def _find(self, tokens: Sequence[int]) -> _Node | None:
        if len(tokens) % self.block:
            return None
        node = self._root
        for key in self._blocks(tokens, len(tokens) // self.block):
            node = node.children.get(key)
            if node is None:
                return None
        return node

    def contains(self, tokens: Sequence[int]) -> bool:
        """Whether a snapshot of exactly this prefix is cached."""
        node = self._find(tokens)
        return node is not None and node.snap is not None

    def lookup(self, tokens: Sequence[int], limit: int | None = None) -> PrefixHit | None:
        """The longest cached snapshot of a prefix of tokens[:limit]; counts a hit or a miss."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        node, best, path = self._root, None, []
        for key in self._blocks(tokens, limit // self.block):
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
            if node.snap is not None:
                best = node
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self._lru.move_to_end(id(best))
        length = best.depth * self.block
        self.hit_tokens += length
        path = path[:best.depth]
        mtp_blocks = tuple(n.mtp_kv for n in path) if best.mtp_hidden is not None else ()
        return PrefixHit(length, best.snap, tuple(n.kv for n in path), best.mtp_hidden, mtp_blocks)

    def insert(self, tokens: Sequence[int], ssm: SlotState, kv_block: Callable[[int], KvSlotState], *,
               mtp_hidden: jax.Array | None = None, mtp_block: Callable[[int], KvSlotState] | None = None) -> bool:
        """Cache a snapshot of prefix `tokens` (a whole number of blocks): its Mamba states `ssm` and the
        KV blocks on its path that are not cached yet, fetched as kv_block(j) for block index j; with an
        MTP head (both or neither) also the hidden state at the last position and the MTP KV blocks,
        fetched as mtp_block(j). Returns whether it is held after the LRU eviction it triggers (a snapshot
        larger than the budget is not)."""
        if not tokens or len(tokens) % self.block:
            raise ShapeError(f"prefix: length must be a positive multiple of the block {self.block}, "
                             f"got {len(tokens)}")
        if (mtp_hidden is None) != (mtp_block is None):
            raise ConfigError("mtp_hidden", "an MTP snapshot needs both mtp_hidden and mtp_block, or neither")
        node = self._root
        for j, key in enumerate(self._blocks(tokens, len(tokens) // self.block)):
            child = node.children.get(key)
            if child is None:
                child = _Node(key, node, kv_block(j), None if mtp_block is None else mtp_block(j))
                node.children[key] = child
                self.nbytes += child.block_bytes()
            elif mtp_block is not None and child.mtp_kv is None:
                raise ConfigError("mtp_block", "an MTP snapshot over blocks cached without MTP keys/values "
                                               "(one cache serves one kind of engine)")
            node = child
        if node.snap is None:
            node.snap, node.mtp_hidden = ssm, mtp_hidden
            self.nbytes += node.snap_bytes()
            self.inserts += 1
        self._lru[id(node)] = node
        self._lru.move_to_end(id(node))
        while self.nbytes > self.max_bytes and self._lru:
            self._evict(next(iter(self._lru.values())))
        return node.snap is not None

    def _evict(self, node: _Node) -> None:
        del self._lru[id(node)]
        self.nbytes -= node.snap_bytes()
        node.snap = node.mtp_hidden = None
        self.evictions += 1
        while node.parent is not None and node.snap is None and not node.children:
            del node.parent.children[node.key]
            self.nbytes -= node.block_bytes()
            node = node.parent

    def clear(self) -> None:
        while self._lru:
            self._evict(next(iter(self._lru.values())))

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "hit_tokens": self.hit_tokens, "inserts": self.inserts,
                "evictions": self.evictions, "entries": len(self), "bytes": self.nbytes}
