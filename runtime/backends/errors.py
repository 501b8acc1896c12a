"""The one error family every backend raises on purpose (:class:`BackendError` and its kinds)."""

from __future__ import annotations


class BackendError(Exception):
    """Base of every error a backend raises on purpose."""


class BackendUnavailable(BackendError):
    """The named backend does not exist or its engine cannot be imported here."""


class BackendClosed(BackendError):
    """The backend was used after ``close()``."""


class RegistrationError(BackendError):
    """A region could not be registered (overlap, not backend memory, engine refusal)."""


class PeerError(BackendError):
    """Bad peer metadata, an unknown or removed peer, or a peer that is gone."""


class DescriptorError(BackendError):
    """A descriptor row lies outside the region it names; raised before anything moves."""


class TransferError(BackendError):
    """The engine refused to start a transfer or an unknown handle was used."""
