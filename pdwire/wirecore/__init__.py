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
"""The contract between generated code and this library (3: positional decoders read ASCII
decimals with ``encodings.read_int*``; 4: encoders hand large arrays to
``arrays.side_frame(arr, dtype, side, where)``, which makes the array itself the frame;
5: fast decoders take the next side frame's index and return ``(message, index after)``,
and ``envelope.refuse_scalars`` returns the values it accepted; 6: a top-level message's
``MessageSpec.scalars`` lets the encode slow path name a 64-bit field whose bound the encoder
left to msgpack's own range; 7: a flat top-level message's ``MessageSpec.flat`` table for a
compiled encoder; 8: that table and the compiled encoder are gone, every message encodes with
its generated Python encoder; 9: each layout's modules in a package of its own,
``envelope`` (``codec``, ``header``, ``msgspec_errors``, ``negotiate``) and ``positional``
(``codec``, ``encodings``, ``errors``), ``Version`` in :mod:`.types`)."""


def require(version: int, module: str) -> None:
    """Refuse to import generated code written for another :data:`API_VERSION`."""
    if version != API_VERSION:
        raise ImportError(
            f"{module} was generated for pdwire.wirecore API {version}, this library is API "
            f"{API_VERSION}: regenerate it with `pdwire codegen`"
        )
