"""The wire side's types: a protocol ``Version`` and the constrained msgspec types generated
wire structs validate with on decode."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

U8 = Annotated[int, msgspec.Meta(ge=0, le=2**8 - 1)]
U16 = Annotated[int, msgspec.Meta(ge=0, le=2**16 - 1)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
# msgpack cannot carry more than 2**64 - 1, and msgspec bounds must fit int64
U64 = Annotated[int, msgspec.Meta(ge=0)]
I32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]
I64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
# a packed array: inline bytes, or the index of the side frame carrying it (frames 0/1 are header/body)
ArrayRef = bytes | Annotated[int, msgspec.Meta(ge=2, le=2**16 + 1)]

Version = tuple[int, int]
"""A protocol version, ``(major, minor)``: what negotiation agrees on, what a header carries,
what the codegen model and the generated feature tables speak (the wire's ``Version`` struct is
how a Hello lists them)."""


def as_version(v: Any) -> Version | None:
    """A wire ``Version`` struct or a (major, minor) pair of ints as a :data:`Version`; None for
    anything else (never a bool, a str or a float)."""
    if type(getattr(v, "major", None)) is int and type(getattr(v, "minor", None)) is int:
        return v.major, v.minor
    if isinstance(v, tuple | list) and len(v) == 2 and all(type(x) is int for x in v):
        return v[0], v[1]
    return None
