"""Transfer backends: one contract (:mod:`.contract`; errors, values and the metadata envelope
beside it), engines chosen by name (:mod:`.registry`)."""

from pdwire.runtime.backends.contract import Backend
from pdwire.runtime.backends.errors import (
    BackendClosed,
    BackendError,
    BackendUnavailable,
    DescriptorError,
    PeerError,
    RegistrationError,
    TransferError,
)
from pdwire.runtime.backends.registry import available_backends, create_backend, default_backend
from pdwire.runtime.backends.values import (
    EngineNotification,
    HostBuffer,
    Peer,
    PeerMetadata,
    PollResult,
    Revocation,
    TransferHandle,
    TransferState,
)

__all__ = [
    "Backend",
    "BackendClosed",
    "BackendError",
    "BackendUnavailable",
    "DescriptorError",
    "EngineNotification",
    "HostBuffer",
    "Peer",
    "PeerError",
    "PeerMetadata",
    "PollResult",
    "RegistrationError",
    "Revocation",
    "TransferError",
    "TransferHandle",
    "TransferState",
    "available_backends",
    "create_backend",
    "default_backend",
]
