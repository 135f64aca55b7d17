"""PrefixCache: a trie of token blocks with snapshots, exact-prefix lookup, shared KV blocks, LRU by bytes
(the MTP head's hidden state and KV blocks included when a snapshot carries them)."""

import jax.numpy as jnp
import numpy as np
import pytest

from metrale_jax.errors import ConfigError, ShapeError
from metrale_jax.runtime.prefix_cache import PrefixCache, tree_nbytes
from metrale_jax.state.kv_pool import KvSlotState
from metrale_jax.state.ssm_pool import SlotState

B = 4                    # block tokens
SNAP = 2 * 3 * 4 * 4 + 2 * 5 * 4 * 4       # bytes of one state below
BLK = 2 * 2 * B * 3 * 4                    # bytes of one KV block below
HID = 6 * 4                                # bytes of one MTP hidden state below
MBLK = 2 * 1 * B * 3 * 4                   # bytes of one MTP KV block below (one MTP attention layer)


def _state(rng):
    return SlotState(conv=jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.float32),
                     ssm=jnp.asarray(rng.standard_normal((2, 5, 4)), jnp.float32))


def _hidden(rng):
    return jnp.asarray(rng.standard_normal(6), jnp.float32)


class _Blocks:
    """kv_block(j) for one sequence, recording which blocks were fetched (layers: 2, or 1 for the MTP's)."""

    def __init__(self, rng, layers=2):
        self.rng, self.layers, self.fetched, self.made = rng, layers, [], {}

    def __call__(self, j):
        self.fetched.append(j)
        blk = KvSlotState(jnp.asarray(self.rng.standard_normal((self.layers, B, 3)), jnp.float32),
                          jnp.asarray(self.rng.standard_normal((self.layers, B, 3)), jnp.float32))
        self.made[j] = blk
        return blk


def test_sizes_of_the_fixtures(rng):
    assert tree_nbytes(_state(rng)) == SNAP and tree_nbytes(_Blocks(rng)(0)) == BLK
    assert tree_nbytes(_hidden(rng)) == HID and tree_nbytes(_Blocks(rng, 1)(0)) == MBLK


def test_lookup_returns_the_deepest_snapshot_of_an_exact_prefix(rng):
    pc = PrefixCache(B, 1 << 20)
    toks = rng.integers(0, 50, 20).tolist()
    s8, s16 = _state(rng), _state(rng)
    blocks = _Blocks(rng)
    assert pc.insert(toks[:8], s8, blocks) and blocks.fetched == [0, 1]
    assert pc.insert(toks[:16], s16, blocks) and blocks.fetched == [0, 1, 2, 3]    # blocks 0, 1 shared
    assert pc.nbytes == 2 * SNAP + 4 * BLK
    hit = pc.lookup(toks)
    assert hit.length == 16 and hit.ssm is s16
    assert [h.k is blocks.made[j].k for j, h in enumerate(hit.kv_blocks)] == [True] * 4
    assert pc.lookup(toks, limit=15).length == 8 and pc.lookup(toks[:16], limit=16).length == 16
    other = toks[:8] + [(toks[8] + 1) % 50] + toks[9:]                     # differs in block 2
    assert pc.lookup(other).length == 8
    assert pc.lookup(toks[:7]) is None and pc.lookup([(toks[0] + 1) % 50] + toks[1:]) is None
    assert pc.contains(toks[:16]) and pc.contains(toks[:8]) and not pc.contains(toks[:12])
    assert not pc.contains(toks[:10])
    assert pc.stats() == {"hits": 4, "misses": 2, "hit_tokens": 48, "inserts": 2, "evictions": 0, "entries": 2,
                          "bytes": 2 * SNAP + 4 * BLK}


def test_lru_eviction_by_bytes_frees_blocks_no_snapshot_needs(rng):
    a, b, c = (rng.integers(0, 50, 8).tolist() for _ in range(3))
    pc = PrefixCache(B, 2 * (SNAP + 2 * BLK))          # room for two 8-token snapshots
    pc.insert(a, _state(rng), _Blocks(rng))
    pc.insert(b, _state(rng), _Blocks(rng))
    assert pc.lookup(a + [1]).length == 8               # a is now the most recently used
    pc.insert(c, _state(rng), _Blocks(rng))             # evicts b with both its blocks
    assert pc.contains(a) and pc.contains(c) and not pc.contains(b)
    assert pc.nbytes == 2 * (SNAP + 2 * BLK) and pc.evictions == 1
    assert pc.lookup(b + [1]) is None


def test_evicting_an_ancestor_keeps_the_blocks_its_descendants_need(rng):
    toks = rng.integers(0, 50, 16).tolist()
    pc = PrefixCache(B, 2 * SNAP + 5 * BLK)            # a third snapshot with its block is one SNAP over
    blocks = _Blocks(rng)
    pc.insert(toks[:8], _state(rng), blocks)
    pc.insert(toks[:16], _state(rng), blocks)
    pc.insert(rng.integers(0, 50, 4).tolist(), _state(rng), _Blocks(rng))   # over budget: the 8-prefix goes
    assert not pc.contains(toks[:8]) and pc.contains(toks[:16])
    hit = pc.lookup(toks)
    assert hit.length == 16 and len(hit.kv_blocks) == 4
    pc.clear()
    assert pc.nbytes == 0 and len(pc) == 0 and pc.lookup(toks) is None


def test_a_snapshot_larger_than_the_budget_is_not_held(rng):
    pc = PrefixCache(B, SNAP)                            # the state fits, its block does not
    assert not pc.insert(rng.integers(0, 50, 4).tolist(), _state(rng), _Blocks(rng))
    assert pc.nbytes == 0 and len(pc) == 0


def test_insert_needs_a_whole_number_of_blocks(rng):
    pc = PrefixCache(B, 1 << 20)
    with pytest.raises(ShapeError, match="multiple of the block"):
        pc.insert([1, 2, 3], _state(rng), _Blocks(rng))
    with pytest.raises(ShapeError, match="multiple of the block"):
        pc.insert([], _state(rng), _Blocks(rng))
    assert np.isclose(pc.nbytes, 0)


def test_mtp_parts_are_returned_shared_and_counted_in_the_bytes(rng):
    toks = rng.integers(0, 50, 16).tolist()
    pc = PrefixCache(B, 2 * (SNAP + HID) + 5 * (BLK + MBLK))          # two snapshots, five blocks
    blocks, mblocks = _Blocks(rng), _Blocks(rng, 1)
    h8, h16 = _hidden(rng), _hidden(rng)
    assert pc.insert(toks[:8], _state(rng), blocks, mtp_hidden=h8, mtp_block=mblocks)
    assert pc.insert(toks[:16], _state(rng), blocks, mtp_hidden=h16, mtp_block=mblocks)
    assert mblocks.fetched == [0, 1, 2, 3] and pc.nbytes == 2 * (SNAP + HID) + 4 * (BLK + MBLK)
    hit8 = pc.lookup(toks, limit=12)
    assert hit8.mtp_hidden is h8 and len(hit8.mtp_blocks) == 2
    hit = pc.lookup(toks)                                              # the 16-prefix: most recently used
    assert hit.length == 16 and hit.mtp_hidden is h16
    assert [m.k is mblocks.made[j].k for j, m in enumerate(hit.mtp_blocks)] == [True] * 4
    pc.insert(rng.integers(0, 50, 4).tolist(), _state(rng), _Blocks(rng), mtp_hidden=_hidden(rng),
              mtp_block=_Blocks(rng, 1))                              # over budget: the 8-prefix goes, not its blocks
    assert not pc.contains(toks[:8]) and pc.nbytes == 2 * (SNAP + HID) + 5 * (BLK + MBLK)
    pc.clear()
    assert pc.nbytes == 0


def test_mtp_parts_come_in_pairs_and_do_not_mix_with_plain_blocks(rng):
    toks = rng.integers(0, 50, 8).tolist()
    pc = PrefixCache(B, 1 << 20)
    with pytest.raises(ConfigError, match="mtp_hidden"):
        pc.insert(toks, _state(rng), _Blocks(rng), mtp_hidden=_hidden(rng))
    pc.insert(toks[:4], _state(rng), _Blocks(rng))                    # plain: no MTP parts in the hit
    hit = pc.lookup(toks)
    assert hit.mtp_hidden is None and hit.mtp_blocks == ()
    with pytest.raises(ConfigError, match="without MTP keys/values"):
        pc.insert(toks, _state(rng), _Blocks(rng), mtp_hidden=_hidden(rng), mtp_block=_Blocks(rng, 1))
