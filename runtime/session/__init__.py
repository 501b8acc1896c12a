"""The protocol's pure core: per-peer connection machines and per-room state machines.

Everything here takes values and returns values, in the manner of h11: the connection machines
(``prefill_connection``, ``decode_connection``, with ``hello`` and ``registration``) turn decoded
messages into typed ``events`` and actions into messages; the room machines (``prefill_room``,
``prefill_session``, ``decode_room``, ``decode_session``, ``room_table``) turn events into
``actions``; ``group_route`` derives who feeds a decode rank once per prefill group, and
``group_connect`` runs a decode rank's connect to one group without blocking. Sockets,
engines and clocks live only in :mod:`pdwire.runtime.workers`.
"""

from pdwire.runtime.session.actions import (
    Action,
    AuxPart,
    CancelTransfers,
    KvPart,
    Part,
    PeerRef,
    PostTransfer,
    ReleaseRoom,
    ReleaseSlots,
    RevokePeer,
    SendAbort,
    SendAbortAck,
    SendStatus,
    StatePart,
)
from pdwire.runtime.session.decode_room import DecodeRoom, SenderPlan
from pdwire.runtime.session.decode_session import DecodeSession
from pdwire.runtime.session.failures import (
    DuplicateRoomError,
    Failure,
    FailureKind,
    HandshakeError,
    ProtocolViolation,
    RegistrationMismatch,
    RoomFailedError,
    SessionError,
    failure_from_wire,
    failure_to_wire,
)
from pdwire.runtime.session.prefill_room import PrefillRoom, Target
from pdwire.runtime.session.prefill_session import PrefillSession
from pdwire.runtime.session.status import Status, is_terminal, merge_status
from pdwire.wire import NotificationKind

__all__ = [
    "Action",
    "AuxPart",
    "CancelTransfers",
    "DecodeRoom",
    "DecodeSession",
    "DuplicateRoomError",
    "Failure",
    "FailureKind",
    "HandshakeError",
    "KvPart",
    "NotificationKind",
    "Part",
    "PeerRef",
    "PostTransfer",
    "PrefillRoom",
    "PrefillSession",
    "ProtocolViolation",
    "RegistrationMismatch",
    "ReleaseRoom",
    "ReleaseSlots",
    "RevokePeer",
    "RoomFailedError",
    "SendAbort",
    "SendAbortAck",
    "SendStatus",
    "SenderPlan",
    "SessionError",
    "StatePart",
    "Status",
    "Target",
    "failure_from_wire",
    "failure_to_wire",
    "is_terminal",
    "merge_status",
]
