"""Control plane and sessions: pure per-room state machines plus the pyzmq edge that drives them.

The pure core (``status``, ``failures``, ``actions``, ``prefill_room``, ``prefill_session``,
``decode_room``, ``decode_session``, ``room_table``) takes values and returns actions, in the
manner of h11; sockets, engines and clocks live only in the driver modules.
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
    SendAbort,
    SendAbortAck,
    SendStatus,
    StatePart,
)
from pdwire.runtime.session.decode_room import DecodeRoom, PartKind, SenderPlan
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
from pdwire.runtime.session.status import RoomStatus, merge_status

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
    "Part",
    "PartKind",
    "PeerRef",
    "PostTransfer",
    "PrefillRoom",
    "PrefillSession",
    "ProtocolViolation",
    "RegistrationMismatch",
    "ReleaseRoom",
    "ReleaseSlots",
    "RoomFailedError",
    "RoomStatus",
    "SendAbort",
    "SendAbortAck",
    "SendStatus",
    "SenderPlan",
    "SessionError",
    "StatePart",
    "Target",
    "failure_from_wire",
    "failure_to_wire",
    "merge_status",
]
