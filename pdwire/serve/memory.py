"""What ``pdwire serve`` needs of a model's memory, and the registry of models it can serve.

Serve knows no model: which memory a rank holds (tensors, pools, content, verification) lives
behind :class:`ServeMemory`, registered under a name (``memory: {model: NAME}``) with
:func:`register_memory_model`. The command layer (:mod:`pdwire.serve_command`) registers the
demo's hybrid model as ``demo``: the demo depends on serve, not the reverse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pdwire import wire
    from pdwire.runtime.engine import Backend, RankMemory, RequestIndices
    from pdwire.serve.config import MemorySettings


class ServeRank(Protocol):
    """One rank's memory: registered with the backend, with a pool of free slots.

    A *lease* is whatever the model uses to say where one room lives on this rank (opaque to
    serve); :meth:`take` raises :class:`MemoryError` when the pools are short for now.
    """

    @property
    def memory(self) -> RankMemory: ...

    def take(self, tokens: int) -> Any: ...

    def give(self, lease: Any) -> None: ...

    def request(self, lease: Any) -> RequestIndices:
        """The lease as a request's indices (KV pages in prompt order, state, aux)."""
        ...

    def fill(self, lease: Any, content: Any) -> None:
        """Prefill: write this rank's part of a room's content into the lease."""
        ...

    def verify(self, lease: Any, content: Any) -> list[str]:
        """Decode: one line per mismatch between the lease and this rank's part of ``content``."""
        ...

    def clear(self, lease: Any) -> None:
        """Decode: wipe a released lease (and, before any room, :meth:`prepare` the pools)."""
        ...

    def prepare(self) -> None: ...


class ServeMemory(Protocol):
    """A model as serve runs it, built from the config's ``memory`` settings."""

    @property
    def fingerprint(self) -> wire.ModelFingerprint: ...

    def check_tp(self, tp: int) -> None:
        """Raise ValueError when the model cannot be split ``tp`` ways."""
        ...

    def pages_needed(self, tokens: int) -> int:
        """KV pages a prompt of ``tokens`` tokens occupies on one rank."""
        ...

    def open_rank(self, tp: int, tp_rank: int, backend: Backend, seed: int) -> ServeRank:
        """Allocate (through ``backend``) and describe one rank's memory."""
        ...

    def content(self, room: int, tokens: int) -> Any:
        """A room's full content, the same on both roles (derived from the settings' seed)."""
        ...


MemoryFactory = Callable[["MemorySettings"], ServeMemory]
_MODELS: dict[str, MemoryFactory] = {}


def register_memory_model(name: str, factory: MemoryFactory) -> None:
    """Make ``memory: {model: name}`` build its memory with ``factory`` (last one wins)."""
    _MODELS[name] = factory


def open_memory_model(settings: MemorySettings) -> ServeMemory:
    """The model ``settings`` name; ValueError naming the registered ones when none is."""
    factory = _MODELS.get(settings.model)
    if factory is None:
        known = ", ".join(repr(n) for n in sorted(_MODELS)) or "none registered"
        raise ValueError(f"memory.model {settings.model!r}: serve knows {known}")
    return factory(settings)
