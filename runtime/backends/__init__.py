"""Transfer backends: one interface (:mod:`.base`), engines chosen by name (:mod:`.registry`)."""

from pdwire.runtime.backends.base import (
    Backend,
    BackendClosed,
    BackendError,
    BackendUnavailable,
    DescriptorError,
    HostBuffer,
    Notification,
    Peer,
    PeerError,
    PeerMetadata,
    RegistrationError,
    TransferError,
    TransferHandle,
    TransferState,
    TransferStatus,
)
from pdwire.runtime.backends.registry import available_backends, create_backend, default_backend

__all__ = [
    "Backend",
    "BackendClosed",
    "BackendError",
    "BackendUnavailable",
    "DescriptorError",
    "HostBuffer",
    "Notification",
    "Peer",
    "PeerError",
    "PeerMetadata",
    "RegistrationError",
    "TransferError",
    "TransferHandle",
    "TransferState",
    "TransferStatus",
    "available_backends",
    "create_backend",
    "default_backend",
]
