"""What an older minor's reader may refuse in a newer minor's message: an enum value it lacks.

Fields a reader does not know are skipped, but an enum value it does not know cannot be: it is
refused by name (``BadEnumValue``). Writers down-convert to the agreed version, so a real older
peer never receives one; the cross-version tests accept exactly this refusal and nothing else.
"""

from __future__ import annotations

from pathlib import Path

import pdwire.wire as w
from pdwire.codegen.loader import load_file

_PROTOCOL = load_file(Path(__file__).resolve().parents[2] / "schema" / "pdwire.yaml")


def enum_numbers_added(newer: tuple[int, int], older: tuple[int, int]) -> set[int]:
    """Numbers of enum values that exist at ``newer`` but not yet at ``older``."""
    return {
        value.number
        for enum in _PROTOCOL.enums.values()
        for value in enum.values_at(newer)
        if value.since > older
    }


def is_newer_enum_value(error: w.BadEnumValue, newer: tuple[int, int], older: tuple[int, int]) -> bool:
    """Whether ``error`` refuses an enum value that ``older`` lacks and ``newer`` has."""
    text = str(error)
    if "Invalid enum value " not in text:
        return False
    number = int(text.split("Invalid enum value ")[1].split()[0])
    return number in enum_numbers_added(newer, older)
