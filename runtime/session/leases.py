"""A decode rank's leases: the rooms its engine still queues, renewed on their prefill groups.

Pure: values in, values out (the edge, :mod:`pdwire.runtime.workers.decode_rooms`, sends). A
prefill rank holds a room nobody asked for yet for its lease (``RegisterAck.lease_ms``, its
room timeout) from its production or the last ``Lease`` naming it, so a request that waits in a
decode queue longer than that would find its room expired. While the engine holds such a
request (:meth:`Leases.hold`), its room is renewed on its group, every room of a group in one
``Lease`` per prefill rank and renewal interval; once the engine asks for it (``start_room``)
or declines it (``decline``) the room is dropped here. A group is renewed at once when it has
rooms and was never renewed, then once per ``every(group)`` seconds (a third of the shortest
lease of its ranks, so two renewals may be lost before a room expires); ``every`` answers None
for a group that cannot be renewed now (still connecting, or no rank of it takes leases).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

RENEWALS_PER_LEASE = 3
"""Renewals sent per lease: a room survives the loss (or lateness) of all but one of them."""


@dataclass(frozen=True, slots=True)
class Renew(Generic[K]):
    """Send one ``Lease`` naming ``rooms`` to every rank of ``group`` that takes leases."""

    group: K
    rooms: tuple[int, ...]


class Leases(Generic[K]):
    """Held rooms by group (a group: whatever the edge names prefill groups by)."""

    def __init__(self) -> None:
        self._group_of: dict[int, K] = {}
        self._rooms: dict[K, dict[int, None]] = {}  # insertion-ordered: rooms renew oldest first
        self._renewed: dict[K, float] = {}  # group -> when its last renewal was due

    def __len__(self) -> int:
        return len(self._group_of)

    def __contains__(self, room: object) -> bool:
        return room in self._group_of

    @property
    def groups(self) -> tuple[K, ...]:
        return tuple(self._rooms)

    def hold(self, room: int, group: K) -> None:
        """The engine queues the request of ``room``, whose KV waits on ``group``."""
        self.drop(room)
        self._group_of[room] = group
        self._rooms.setdefault(group, {})[room] = None

    def drop(self, room: int) -> K | None:
        """The engine asked for ``room`` or declined it: no more renewals. Its group, if held."""
        group = self._group_of.pop(room, None)
        if group is not None:
            rooms = self._rooms[group]
            del rooms[room]
            if not rooms:
                del self._rooms[group]
                self._renewed.pop(group, None)
        return group

    def forget(self, group: K) -> tuple[int, ...]:
        """``group`` can never be renewed (its connect failed): drop its rooms, returned."""
        rooms = tuple(self._rooms.pop(group, ()))
        for room in rooms:
            del self._group_of[room]
        self._renewed.pop(group, None)
        return rooms

    def due(self, now: float, every: Callable[[K], float | None]) -> list[Renew[K]]:
        """The renewals due at ``now``; each group's renewal is then counted as sent."""
        out: list[Renew[K]] = []
        for group, rooms in self._rooms.items():
            interval = every(group)
            if interval is None or now - self._renewed.get(group, -math.inf) < interval:
                continue
            self._renewed[group] = now
            out.append(Renew(group, tuple(rooms)))
        return out


def renewal_interval(leases_s: list[float]) -> float | None:
    """How often a group whose ranks hold rooms for ``leases_s`` is renewed (None: never, no rank
    of it takes leases)."""
    taken = [s for s in leases_s if s > 0]
    return min(taken) / RENEWALS_PER_LEASE if taken else None
