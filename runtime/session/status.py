"""Room status: the wire's own ``Status`` (SGLang's KVPoll numbers) and the one merge rule every
side applies to it."""

from __future__ import annotations

from pdwire.wire import Status

__all__ = ["Status", "is_terminal", "merge_status"]


def is_terminal(status: Status) -> bool:
    """Failed or Success: the room is over."""
    return status in (Status.FAILED, Status.SUCCESS)


def merge_status(current: Status, new: Status) -> Status:
    """Status only moves forward, except that Failed always wins (and a terminal status is final).

    A late Transferring report must never undo Success, and a Success report must never
    hide a Failed one that arrived first.
    """
    if is_terminal(current):
        return current
    if new == Status.FAILED:
        return new
    return max(current, new)
