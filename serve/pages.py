"""The page pool on the host: which pages are free, and each slot's page table.

The device holds the pages' keys and values (`models.PagedKVCache`); the host decides
which page each slot's next positions go to, and sends the tables with every step. A slot
takes a page when its length crosses a page boundary and gives all of them back when its
request ends or is preempted.

    page_size 4, slot 0 holds 6 positions: table[0] = [3, 0, P, P]
    ensure(0, 9) -> a third page for positions 8 .. 11: table[0] = [3, 0, 5, P]
"""

from __future__ import annotations

import jax
import numpy as np

from models.cache_int8 import bytes_per_token
from models.errors import UserError


class PagePool:
    """`num_pages` pages of `page_size` positions shared by `slots` page tables of
    `pages_per_slot` entries; `num_pages` in a table means no page."""

    def __init__(self, num_pages: int, page_size: int, slots: int, pages_per_slot: int):
        self.num_pages, self.page_size = num_pages, page_size
        self.table = np.full((slots, pages_per_slot), num_pages, np.int32)
        self._held = [0] * slots                       # pages held by each slot
        self._free = list(range(num_pages - 1, -1, -1))   # popped from the end: 0 first

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_pages - len(self._free)

    def held(self, slot: int) -> int:
        return self._held[slot]

    def pages_for(self, positions: int) -> int:
        """The pages that hold `positions` positions."""
        return -(-positions // self.page_size)

    def needed(self, slot: int, positions: int) -> int:
        """The pages `slot` lacks to hold `positions` positions."""
        return max(0, self.pages_for(positions) - self._held[slot])

    def ensure(self, slot: int, positions: int) -> bool:
        """Gives `slot` the pages for `positions` positions; False (nothing taken) when the
        pool has too few free pages.

        Raises:
            UserError: more positions than a table addresses.
        """
        want = self.pages_for(positions)
        if want > self.table.shape[1]:
            raise UserError(f"{positions} positions need {want} pages; a slot's table has "
                            f"{self.table.shape[1]}")
        missing = want - self._held[slot]
        if missing > len(self._free):
            return False
        for m in range(self._held[slot], want):
            self.table[slot, m] = self._free.pop()
        self._held[slot] = max(want, self._held[slot])
        return True

    def release(self, slot: int) -> None:
        """Returns every page of `slot` to the pool and clears its table."""
        held = self._held[slot]
        self._free.extend(int(p) for p in self.table[slot, :held][::-1])
        self.table[slot] = self.num_pages
        self._held[slot] = 0


def default_num_pages(config, slots: int, pages_per_slot: int, page_size: int,
                      kv_cache_dtype: str = "auto") -> int:
    """Pages for every slot at the model's full window; fewer when the device reports less
    free memory than that needs (90% of what is free goes to the pool, whose pages hold
    `kv_cache_dtype` keys and values: `models.cache_int8.bytes_per_token`)."""
    full = slots * pages_per_slot
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)() or {}
    if "bytes_limit" not in stats:
        return full
    per_page = page_size * bytes_per_token(config, kv_cache_dtype)
    free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    return max(1, min(full, int(0.9 * free) // per_page))
