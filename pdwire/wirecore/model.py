"""The base class of every generated message struct."""

from __future__ import annotations

import msgspec

from .arrays import values_equal


class Model(msgspec.Struct, kw_only=True, eq=False):
    """A message struct: keyword construction, and equality that compares numpy arrays by
    dtype and content (msgspec's own ``__eq__`` would compare them element-wise)."""

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(
            values_equal(getattr(self, f), getattr(other, f)) for f in self.__struct_fields__
        )

    def __ne__(self, other: object) -> bool:  # msgspec's Struct would compare field by field
        return not self.__eq__(other)
