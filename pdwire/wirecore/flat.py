"""The compiled fast path of flat messages' encoders, and the switch that turns it off.

A message is *flat* when every position of its newest body is a scalar (int, bool, str, enum,
optional or not), a 1-D array, a list of (optional) arrays or a placeholder: the generator
writes a table of those positions (``_FLAT_<Message>``) beside the Python encoder. The C
extension ``_flatenc`` reads the fields at their slot offsets, checks them exactly as the
Python encoder's inline tests do and builds the same body list; anything those tests would
not pass raises ``FlatBail``, and the registry runs the generated Python encoder, which
converts what it can and names what is wrong. The Python encoders stay the reference: every
older minor, the single-buffer form and every error go through them, and the differential
tests (tests/wire/test_flat_encoder.py) hold the two to the same bytes.

Set ``PDWIRE_PURE_PYTHON=1`` before importing ``pdwire.wire`` (the registry picks its encoders
when it is built) to encode with the Python encoders only; where the extension was not built
(no C compiler at install), that is what happens anyway.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .arrays import SIDE_FRAME_MIN_BYTES

try:
    from . import _flatenc
except ImportError:  # built without a C compiler: the Python encoders do all the work
    _flatenc = None  # type: ignore[assignment]

# (kind, field name or None, optional, dtype / type / constant or None, lo, hi): what
# _flatenc.FlatEncoder reads; kinds "const", "int", "bool", "str", "type", "array",
# "array_list", "any" (passed as it is, as the Python encoder passes bytes and lists of scalars)
FlatSlot = tuple[str, str | None, bool, Any, int, int]

AVAILABLE = _flatenc is not None
"""Whether this install has the compiled encoder (``PDWIRE_PURE_PYTHON`` aside)."""


def enabled() -> bool:
    return AVAILABLE and os.environ.get("PDWIRE_PURE_PYTHON", "") in ("", "0")


def encoder(cls: type, table: Sequence[FlatSlot] | None) -> Any | None:
    """The compiled encoder of ``cls`` (called like the generated one: ``enc(msg, side)``), or
    None where the message is not flat, the extension is missing or switched off."""
    if table is None or not enabled():
        return None
    return _flatenc.FlatEncoder(cls, tuple(table), SIDE_FRAME_MIN_BYTES)
