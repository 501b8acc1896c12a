"""Support library of the generated codecs (``pdwire.wire``), and nothing else.

Shared by both layouts: :mod:`.errors` (the ``WireError`` tree), :mod:`.arrays` (packed
arrays and side frames), :mod:`.types` (``Version`` and the range-checked field types),
:mod:`.model` (the base of every message struct). One package per layout:
:mod:`.envelope` (pdwire's header, body and negotiation) and :mod:`.positional` (SGLang's
frame-per-field profiles). The hand-written functions generated code calls live in
:mod:`pdwire.wirehooks`; tools built on the wire in :mod:`pdwire.protocols`.

Generated modules call :func:`require` with the API version they were generated against, so
a checkout whose ``generated/`` is older or newer than this library fails at import with a
message saying to rerun ``pdwire codegen``, instead of misbehaving later (Kaitai Struct's
runtime-version check). Bump :data:`API_VERSION` with any change generated code can notice.
"""

from __future__ import annotations

API_VERSION = 9
"""The contract between generated code and this library; its history is in git (9: each layout's
modules in a package of their own, ``Version`` in :mod:`.types`)."""


def require(version: int, module: str) -> None:
    """Refuse to import generated code written for another :data:`API_VERSION`."""
    if version != API_VERSION:
        raise ImportError(
            f"{module} was generated for pdwire.wirecore API {version}, this library is API "
            f"{API_VERSION}: regenerate it with `pdwire codegen`"
        )
