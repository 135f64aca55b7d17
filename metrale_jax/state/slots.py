"""SlotAllocator: hands out pool slots to sequences (host side); one slot is reserved for padding."""

from __future__ import annotations

from metrale_jax.errors import PoolExhaustedError, SlotError


class SlotAllocator:
    """Free list over `num_slots` slots; the last one is the padding slot and is never handed out.

    `alloc(pool)` zeroes the slot it returns in every pool it is given (SSM and KV pools alike), so a
    released slot never leaks state into its next sequence.
    """

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise SlotError(f"num_slots must be >= 2 (one live slot plus the padding slot), got {num_slots}")
        self.num_slots = num_slots
        self.padding_slot = num_slots - 1
        self._free = list(range(num_slots - 2, -1, -1))   # pop() hands out the lowest first
        self._used: set[int] = set()

    @property
    def capacity(self) -> int:
        return self.num_slots - 1

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> frozenset[int]:
        return frozenset(self._used)

    def alloc(self, *pools):
        """Take a free slot and zero it in each pool.  Returns (slot, *new_pools)."""
        if not self._free:
            raise PoolExhaustedError(
                f"all {self.capacity} slots are in use; release a sequence or build a larger pool")
        slot = self._free.pop()
        self._used.add(slot)
        return (slot, *(p.zero_slot(slot) for p in pools))

    def release(self, slot: int) -> None:
        if slot == self.padding_slot:
            raise SlotError(f"slot {slot} is the padding slot; it is never allocated")
        if slot not in self._used:
            raise SlotError(f"slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)
