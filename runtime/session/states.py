"""Every sans-IO machine's states and its transition table, in one place (as h11's ``_state.py``).

A table maps each state to the states the machine may move to from it, each with the events
that make that move. A machine declares its state attribute as a :class:`StateField` of its
table, so every assignment goes through :meth:`StateTable.move`, which raises
:class:`TransitionError` for a move the table does not list: a bug in the machine, never a
peer's doing (a message that does not fit the current state is refused or reported before the
machine moves). ``tests/session/test_transitions.py`` checks the other direction: driving the
machines through their entry points makes every move of every table.

The room machines share the wire's :class:`~.status.Status`: Bootstrapping, WaitingForInput,
Transferring, then Success or Failed, both final. A failed prefill room may still *drain* (its
cancelled transfers not yet confirmed stopped) and a failed decode room may be *quarantined*
(a writer not fenced yet); both are facts of the room, not states of these tables.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any, Generic, TypeVar

from pdwire.runtime.session.failures import SessionError
from pdwire.runtime.session.status import Status

S = TypeVar("S", bound=Enum)


class TransitionError(SessionError):
    """A machine tried a move its table does not list (an internal error)."""


class StateTable(Generic[S]):
    """``moves[old][new]``: the events that move the machine from ``old`` to ``new``."""

    def __init__(self, machine: str, initial: S, moves: Mapping[S, Mapping[S, str]]) -> None:
        self.machine = machine
        self.initial = initial
        self.moves = moves

    def move(self, old: S | None, new: S) -> S:
        """``new``, if the table lets the machine move there from ``old`` (None: it starts)."""
        allowed = new is self.initial if old is None else new in self.moves[old]
        if allowed:
            return new
        raise TransitionError(
            f"{self.machine}: {'(start)' if old is None else old.name} -> {new.name} is not in its table"
        )

    def rows(self) -> set[tuple[S, S]]:
        return {(old, new) for old, targets in self.moves.items() for new in targets}


class StateField(Generic[S]):
    """A machine's state attribute; every assignment is checked against ``table``."""

    def __init__(self, table: StateTable[S]) -> None:
        self.table = table
        self._name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = f"_{name}_value"

    def __get__(self, obj: Any, owner: type | None = None) -> S:
        value: S = obj.__dict__[self._name]
        return value

    def __set__(self, obj: Any, new: S) -> None:
        obj.__dict__[self._name] = self.table.move(obj.__dict__.get(self._name), new)


class DecodeConnState(Enum):
    HELLO_SENT = "hello_sent"
    REGISTERING = "registering"
    READY = "ready"
    REFUSED = "refused"
    REREGISTERING = "reregistering"  # registered again after a revocation, no answer yet
    RETRY = "retry"  # that registration was refused: the edge tries again later


class PrefillConnState(Enum):
    AWAIT_HELLO = "await_hello"
    REFUSED = "refused"  # the Hello was refused: a RegisterInfo gets the refusal, nothing else works
    AWAIT_REGISTRATION = "await_registration"
    ADDING_PEER = "adding_peer"  # the engine is adding the peer (AddPeer; the edge answers at once)
    READY = "ready"


class GroupState(Enum):
    CONNECTING = "connecting"
    READY = "ready"
    FAILED = "failed"


B, W, T = Status.BOOTSTRAPPING, Status.WAITING_FOR_INPUT, Status.TRANSFERRING
OK, FAILED = Status.SUCCESS, Status.FAILED
_FAIL = "engine error, abort, peer gone, timeout, a request or chunk that does not fit"
_LOST = "a Failed status, an abort, a lost or revoked sender, the deadline, a part it cannot account for"

PREFILL_ROOM = StateTable(
    "PrefillRoom",
    B,
    {
        B: {W: "the last of required_dst_info_num requests", FAILED: _FAIL},
        W: {T: "a part posted", OK: "nothing to post (dummy targets only)", FAILED: _FAIL},
        T: {T: "a part posted", OK: "last chunk seen, every transfer done", FAILED: _FAIL},
        OK: {},
        FAILED: {},
    },
)

DECODE_ROOM = StateTable(
    "DecodeRoom",
    B,
    {
        B: {W: "every TransferRequest sent", T: "a completion (or vouching Success) first", FAILED: _LOST},
        W: {T: "a completion, or a Success status that vouches for its sender", FAILED: _LOST},
        T: {T: "another completion", OK: "every expected completion in", FAILED: _LOST},
        OK: {},
        FAILED: {},
    },
)

_REFUSE = "a bad answer, an undecodable one, the transport refused, the handshake deadline"
DECODE_CONNECTION = StateTable(
    "DecodeConnection",
    DecodeConnState.HELLO_SENT,
    {
        DecodeConnState.HELLO_SENT: {
            DecodeConnState.REGISTERING: "their Hello passed: RegisterInfo sent",
            DecodeConnState.REFUSED: f"the Hello refused; {_REFUSE}",
        },
        DecodeConnState.REGISTERING: {
            DecodeConnState.READY: "the registration accepted",
            DecodeConnState.REFUSED: f"the registration refused; {_REFUSE}",
        },
        DecodeConnState.REFUSED: {DecodeConnState.REGISTERING: "register_again (a refused registration)"},
        DecodeConnState.READY: {DecodeConnState.REREGISTERING: "reregister (after a revocation)"},
        DecodeConnState.REREGISTERING: {
            DecodeConnState.READY: "the new registration accepted",
            DecodeConnState.RETRY: "the new registration refused",
        },
        DecodeConnState.RETRY: {DecodeConnState.REREGISTERING: "reregister (tried again)"},
    },
)

_HELLO = {
    PrefillConnState.AWAIT_REGISTRATION: "a Hello accepted",
    PrefillConnState.REFUSED: "a Hello refused",
}
PREFILL_CONNECTION = StateTable(
    "PrefillConnection",
    PrefillConnState.AWAIT_HELLO,
    {
        PrefillConnState.AWAIT_HELLO: _HELLO,
        PrefillConnState.REFUSED: _HELLO,
        PrefillConnState.AWAIT_REGISTRATION: {**_HELLO, PrefillConnState.ADDING_PEER: "a RegisterInfo valid"},
        PrefillConnState.ADDING_PEER: {
            PrefillConnState.READY: "peer_added",
            PrefillConnState.AWAIT_REGISTRATION: "peer_refused",
        },
        PrefillConnState.READY: {**_HELLO, PrefillConnState.ADDING_PEER: "a RegisterInfo valid (again)"},
    },
)

GROUP_CONNECT = StateTable(
    "GroupConnect",
    GroupState.CONNECTING,
    {
        GroupState.CONNECTING: {
            GroupState.READY: "every rank registered, one group, its layers covered",
            GroupState.FAILED: "a rank refused or of another group, layers uncovered, the deadline",
        },
        GroupState.READY: {},
        GroupState.FAILED: {},
    },
)

TABLES: tuple[StateTable[Any], ...] = (
    PREFILL_ROOM,
    DECODE_ROOM,
    PREFILL_CONNECTION,
    DECODE_CONNECTION,
    GROUP_CONNECT,
)
