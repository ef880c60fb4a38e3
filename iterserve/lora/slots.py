"""Which adapter sits in which resident slot, least recently used first: the residency rule the
engine's LoRAManager applies to real weights and the simulator to none (sim/lora.py)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Acquired:
    slot: int
    loaded: bool  # the adapter was not resident: the slot's weights must be (re)filled
    evicted: str | None = None  # the adapter that left the slot for it


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        self.slots: list[str | None] = [None] * num_slots
        self.slot_of: dict[str, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # slots, least recently used first

    def acquire(self, name: str, busy: set[str]) -> Acquired | None:
        """Makes `name` resident: its slot, else a free one, else the least recently used slot
        whose adapter is not in `busy`; marks it used now. None when every slot is busy."""
        slot = self.slot_of.get(name)
        loaded, evicted = False, None
        if slot is None:
            free = [i for i, n in enumerate(self.slots) if n is None]
            evictable = [i for i in self._lru if self.slots[i] not in busy]
            if not free and not evictable:
                return None
            slot = free[0] if free else evictable[0]
            evicted = self.slots[slot]
            if evicted is not None:
                del self.slot_of[evicted]
            self.slots[slot], self.slot_of[name], loaded = name, slot, True
        self._lru[slot] = None
        self._lru.move_to_end(slot)
        return Acquired(slot, loaded, evicted)

    def release(self, name: str) -> int | None:
        """Empties the adapter's slot (it was unloaded); returns the slot, or None if not resident."""
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            self.slots[slot] = None
            self._lru.pop(slot, None)
        return slot
