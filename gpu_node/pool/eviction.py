"""The eviction policy of a pool tier: which unreferenced block leaves first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from gpu_node.pool.vocabulary import CacheEntry


class LRUEvictionStrategy:
    """Least recently used first, one instance per tier (SGLang's ``LRUStrategy``).

    It only orders entries; the pool skips candidates it may not touch
    (referenced ones), so the strategy needs no knowledge of refcounts.
    """

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, CacheEntry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def insert(self, entry: CacheEntry) -> None:
        assert entry.block_hash not in self._order, "an entry is ordered in one tier at most once"
        self._order[entry.block_hash] = entry

    def touch(self, entry: CacheEntry) -> None:
        self._order.move_to_end(entry.block_hash)

    def remove(self, entry: CacheEntry) -> None:
        del self._order[entry.block_hash]

    def candidates(self) -> Iterator[CacheEntry]:
        """Entries in eviction order; the caller must stop iterating before it changes the order."""
        return iter(self._order.values())
