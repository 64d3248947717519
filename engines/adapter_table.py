"""Which adapters an engine serves, and which requests hold each: the bookkeeping both engines
share, so a drained unload means the same thing on the local engine and on the fleet.

An adapter unloaded while requests use it is retired: new requests on its name are refused at
once, and it leaves the table when its last request ends.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar

from core.errors import AdapterNotFound

T = TypeVar("T")


class AdapterTable(Generic[T]):
    """Loaded adapters by versioned name (least recently used first), each with what the engine
    keeps for it (weights, a folder), the requests in flight on it, and the retired ones.

    Not locked: the owning engine holds its own lock around every call.
    """

    def __init__(self) -> None:
        self._loaded: OrderedDict[str, T] = OrderedDict()
        self._in_use: dict[str, int] = {}
        self._retired: set[str] = set()

    def __contains__(self, name: object) -> bool:
        """Loaded, retired or not: a retired adapter still holds its place until it drains."""
        return name in self._loaded

    def __len__(self) -> int:
        return len(self._loaded)

    def serving(self, name: str) -> bool:
        """Loaded and taking new requests."""
        return name in self._loaded and name not in self._retired

    def names(self) -> list[str]:
        """The adapters taking new requests, least recently used first."""
        return [n for n in self._loaded if n not in self._retired]

    def held(self) -> list[str]:
        """Every adapter loaded, retired ones still draining included."""
        return list(self._loaded)

    def serving_items(self) -> dict[str, T]:
        return {n: v for n, v in self._loaded.items() if n not in self._retired}

    def values(self) -> Iterator[T]:
        """Everything loaded, retired adapters included (they still hold memory)."""
        return iter(self._loaded.values())

    def idle(self) -> list[str]:
        """Loaded adapters no request holds, least recently used first."""
        return [n for n in self._loaded if not self._in_use.get(n)]

    def put(self, name: str, value: T) -> None:
        """Serve ``name``; a retired adapter loaded again serves again."""
        self._loaded[name] = value
        self._retired.discard(name)

    def evict(self, name: str) -> None:
        del self._loaded[name]
        self._retired.discard(name)

    def acquire(self, name: str) -> T:
        """Count one more request on ``name``; ``AdapterNotFound`` unless it is serving."""
        if not self.serving(name):
            raise AdapterNotFound(f"adapter {name} is not loaded")
        self._loaded.move_to_end(name)
        self._in_use[name] = self._in_use.get(name, 0) + 1
        return self._loaded[name]

    def release(self, name: str) -> bool:
        """One request on ``name`` ended; True when that drained a retired adapter out."""
        self._in_use[name] -= 1
        if self._in_use[name]:
            return False
        del self._in_use[name]
        if name not in self._retired:
            return False
        self._retired.discard(name)
        self._loaded.pop(name, None)
        return True

    def unload(self, name: str) -> bool:
        """Stop serving ``name``: True when it left at once, False when it drains (requests
        still hold it). ``AdapterNotFound`` unless it is serving."""
        if not self.serving(name):
            raise AdapterNotFound(f"adapter {name} is not loaded")
        if self._in_use.get(name):
            self._retired.add(name)
            return False
        del self._loaded[name]
        return True
