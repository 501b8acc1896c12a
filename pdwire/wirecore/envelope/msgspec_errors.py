"""Translate msgspec's exceptions into :class:`~.errors.BodyError` naming the field.

msgspec reports a path such as ``$[8][1]`` for array_like structs; the first index is the
field's stable id, so it maps straight to a field name.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import msgspec

from ..errors import BadEnumValue, BodyError

_PATH = re.compile(r"at `\$((?:\[\d+\])*)")
_INDEX = re.compile(r"\[(\d+)\]")


def body_error(exc: msgspec.MsgspecError, message: str, slots: Sequence[str]) -> BodyError:
    """Build the error for a body that msgspec refused. ``slots`` are field names by id."""
    text = str(exc)
    field: str | None = None
    m = _PATH.search(text)
    if m is not None and m.group(1):
        idx = [int(x) for x in _INDEX.findall(m.group(1))]
        head = slots[idx[0]] if idx[0] < len(slots) else f"#{idx[0]}"
        field = head + "".join(f"[{i}]" for i in idx[1:])
    cls = BadEnumValue if "Invalid enum value" in text else BodyError
    if isinstance(exc, msgspec.DecodeError) and "truncated" in text:
        text = "body is truncated: " + text
    return cls(text, message=message, field=field, frame=1)
