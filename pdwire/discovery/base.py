"""The discovery interface: announce this rank, learn about the others (docs/deployment.md).

An implementation (:mod:`.static`, :mod:`.etcd`) only produces
:data:`~.membership.RegistryEvent` values (:meth:`Discovery._events`); turning them into
changes and a view is the pure :class:`~.membership.Membership`, owned by the caller's thread.
Losing the registry is a change (:class:`~.membership.RegistryLost`), never an exception.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from types import TracebackType

from pdwire import wire
from pdwire.discovery.entry import DEFAULT_PREFIX, ROLES, RankEntry
from pdwire.discovery.membership import (
    Change,
    Membership,
    RegistryBack,
    RegistryEvent,
    RegistryLost,
    Rejected,
    describe,
)

log = logging.getLogger("pdwire.discovery")


class DiscoveryError(Exception):
    """A discovery configuration that cannot work (bad spec, unreadable static file)."""


class Discovery(ABC):
    """Registration of this rank plus a membership view of the watched roles."""

    kind: str = ""

    def __init__(self, prefix: str = DEFAULT_PREFIX, roles: tuple[wire.Role, ...] = ROLES) -> None:
        self.membership = Membership(prefix, roles)
        self.entries: dict[str, RankEntry] = {}  # key -> what this process registered

    @property
    def prefix(self) -> str:
        return self.membership.prefix

    @abstractmethod
    def register(self, entry: RankEntry) -> None:
        """Announce ``entry`` (validated first; an invalid one raises RegistryEntryError). A
        process may register several ranks; they are withdrawn together."""

    @abstractmethod
    def withdraw(self) -> None:
        """Remove this process's entries now (best effort: an unreachable registry lets them expire)."""

    @abstractmethod
    def _events(self, timeout_s: float) -> list[RegistryEvent]:
        """Registry events read since the last call; waits up to ``timeout_s`` for the first."""

    @abstractmethod
    def close(self) -> None:
        """Withdraw, stop every background thread. Idempotent."""

    def poll(self, timeout_s: float = 0.0) -> list[Change]:
        """Apply what the registry said since the last call; membership changes are also logged.

        (Reachability changes are logged by the implementation when they happen, since a rank
        that only registers may poll rarely.)
        """
        changes = self.membership.apply_all(self._events(timeout_s))
        for c in changes:
            if not isinstance(c, RegistryLost | RegistryBack):
                log.log(logging.WARNING if isinstance(c, Rejected) else logging.INFO, "%s", describe(c))
        return changes

    def __enter__(self) -> Discovery:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
