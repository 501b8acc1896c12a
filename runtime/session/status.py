"""Room status codes and the one merge rule every side applies to them."""

from __future__ import annotations

from enum import IntEnum


class RoomStatus(IntEnum):
    """The protocol's per-room status, numbered as on the wire (KVPoll order)."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4

    @property
    def terminal(self) -> bool:
        return self in (RoomStatus.FAILED, RoomStatus.SUCCESS)


def merge_status(current: RoomStatus, new: RoomStatus) -> RoomStatus:
    """Status only moves forward, except that Failed always wins (and a terminal status is final).

    A late Transferring report must never undo Success, and a Success report must never
    hide a Failed one that arrived first.
    """
    if current.terminal:
        return current
    if new is RoomStatus.FAILED:
        return new
    return max(current, new)
