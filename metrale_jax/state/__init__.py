"""Slot-indexed state pools and the slot allocator."""

from metrale_jax.state.slots import SlotAllocator  # noqa: F401
from metrale_jax.state.ssm_pool import SlotState, SsmPool  # noqa: F401
from metrale_jax.state.kv_pool import KvPool, KvSlotState  # noqa: F401
from metrale_jax.state.cache import CacheSlotState, ModelCache  # noqa: F401
