"""The one error type of the generator: a schema that cannot be used."""

from __future__ import annotations


class SchemaError(Exception):
    """A schema is malformed or breaks an evolution rule.

    The message always starts with the file and, where known, the message and field.
    """

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where = where
        self.problem = problem


def where(file: str, message: str | None = None, field: str | None = None) -> str:
    """Human-readable location: ``file``, ``file: message Foo``, ``file: message Foo, field bar``."""
    out = file
    if message is not None:
        out += f": message {message}"
    if field is not None:
        out += f", field {field}"
    return out
