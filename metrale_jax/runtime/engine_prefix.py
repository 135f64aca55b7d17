"""The Engine's side of the prefix cache: where a prompt's snapshot is cut, taking it (in the prefill pass or from
the slot after a chunk that ended at the cut), and restoring a hit into a fresh slot (Mamba states, KV blocks, the
MTP head's state with MTP drafting)."""

from __future__ import annotations

import functools

from metrale_jax.arguments import integer, is_int
from metrale_jax.errors import ConfigError
from metrale_jax.runtime import steps
from metrale_jax.runtime.prefill_plan import Chunk
from metrale_jax.runtime.prefix_cache import PrefixCache
from metrale_jax.runtime.request import Request
from metrale_jax.state.kv_pool import KvSlotState
from metrale_jax.state.ssm_pool import SlotState


class PrefixSnapshots:
    """Engine methods for the prefix cache (the engine's model, caps, cache, mtp, prefix_cache, executables)."""

    def _make_prefix_cache(self, nbytes: int, block: int | None) -> PrefixCache | None:
        """A prefix cache of `nbytes` snapshotting every `block` tokens (default the SSD chunk), or None; refused
        when a layer's state or prefill would make a snapshot wrong."""
        if not integer("prefix_cache_bytes", nbytes, 0):
            return None
        chunk = self.model.levers.ssm_chunk_size(self.model.config)
        block = chunk if block is None else block
        if not is_int(block) or block < 1 or block % chunk:
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

    def _insert_snapshots(self, chunk: Chunk, out: steps.PrefillOut) -> None:
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

    def _slot_state(self, slot: int) -> SlotState:
        return self._state_op("slot_ssm_state", steps.slot_ssm_state, self.cache, self._dev(slot))

    def _mtp_hidden(self, slot: int):
        return self.exe.run("mtp_slot_hidden", steps.mtp_slot_hidden, self.mtp, self._dev(slot))
