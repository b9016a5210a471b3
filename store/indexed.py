"""`IndexedStore`: a store that can keep its entries as arrays (`store.index.StoreIndex`) for
compiled drafting. Apart from `store.base`, which `store.index` imports, so that the two do not
import each other; `StoreIndex` is only a type here, so the `isinstance` check imports no numba."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from store.index import StoreIndex


@runtime_checkable
class IndexedStore(Protocol):
    """A store that keeps its entries as arrays for compiled drafting: `InMemoryNgramStore`, and
    a Redis store's local replica (`store.redis_store`: other processes' rows merge into it at
    the decode thread's next merge, so a kernel never reads arrays another thread changes)."""

    topk: int  # ids kept per entry: the most candidates one lookup gives

    def compiled(self) -> StoreIndex | None:
        """Its `store.index.StoreIndex` (made on the first call, its entries' home from then
        on), or None where it cannot keep one."""
