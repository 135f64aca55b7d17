"""SlotAllocator: hands out pool slots to sequences (host side); one slot is reserved for padding."""

from __future__ import annotations

from metrale_jax.arguments import is_int
from metrale_jax.errors import PoolExhaustedError, SlotError
from metrale_jax.state.slot_pool import slot_index


class SlotAllocator:
    """Free list over `num_slots` slots; the last one is the padding slot and is never handed out.

    `alloc(pool)` zeroes the slot it returns in every pool it is given (SSM and KV pools alike), so a
    released slot never leaks state into its next sequence. The free list holds only released slots; slots never
    handed out are the range [_next, capacity), so an allocator costs memory for the slots in use, not num_slots.
    """

    def __init__(self, num_slots: int):
        if not is_int(num_slots) or num_slots < 2:
            raise SlotError(f"num_slots: expected an integer >= 2 (one live slot plus the padding slot), "
                            f"got {num_slots!r:.60}")
        self.num_slots = int(num_slots)
        self.padding_slot = self.num_slots - 1
        self._free: list[int] = []     # released slots; pop() hands out the last released first
        self._next = 0                 # the lowest slot never handed out
        self._used: set[int] = set()

    @property
    def capacity(self) -> int:
        return self.num_slots - 1

    @property
    def free_count(self) -> int:
        return len(self._free) + self.capacity - self._next

    @property
    def in_use(self) -> frozenset[int]:
        return frozenset(self._used)

    def alloc(self, *pools):
        """Take a free slot and zero it in each pool.  Returns (slot, *new_pools)."""
        if self._free:
            slot = self._free[-1]
        elif self._next < self.capacity:
            slot = self._next
        else:
            raise PoolExhaustedError(
                f"all {self.capacity} slots are in use; release a sequence or build a larger pool")
        zeroed = tuple(p.zero_slot(slot) for p in pools)     # a pool that refuses the slot leaves it free
        if self._free:
            self._free.pop()
        else:
            self._next += 1
        self._used.add(slot)
        return (slot, *zeroed)

    def release(self, slot: int) -> None:
        slot = slot_index("slot", slot, self.num_slots)
        if slot == self.padding_slot:
            raise SlotError(f"slot {slot} is the padding slot; it is never allocated")
        if slot not in self._used:
            raise SlotError(f"slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)
