"""The request_ids claimed by the batches in flight of one worker: the batch path counts
its claims in and out, and the own-leak GC (``service.runtime.maintenance``) spares every one of
them (``StoreSeam.gc_own_leaks``)."""

from __future__ import annotations

import collections
from collections.abc import Iterator


class ClaimsRegistry:
    """A request_id stays held while any batch in flight holds a claim on it."""

    def __init__(self) -> None:
        self._held: collections.Counter[str] = collections.Counter()

    def hold(self, request_id: str) -> None:
        self._held[request_id] += 1

    def drop(self, request_id: str) -> None:
        self._held[request_id] -= 1
        if self._held[request_id] <= 0:
            del self._held[request_id]

    def __iter__(self) -> Iterator[str]:
        """The request_ids held now (iterate a copy: ``list(registry)``)."""
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)
