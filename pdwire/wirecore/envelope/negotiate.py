"""Version agreement between two peers.

Each peer lists, per major it reads, the highest minor it supports (it reads every lower
minor of that major too). The agreed version is the highest common major with the lower
of the two minors; with no common major the handshake fails naming both sides' versions.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import NegotiationError, VersionMismatch
from ..types import Version, as_version


def _pairs(versions: object, side: str) -> list[Version]:
    """``versions`` as (major, minor) pairs; anything else is a typed error naming the side."""
    if isinstance(versions, str | bytes) or not isinstance(versions, Iterable):
        raise NegotiationError(f"{side} versions must be a list of (major, minor) pairs, got {versions!r}")
    out: list[Version] = []
    for v in versions:
        pair = as_version(v)
        if pair is None:
            raise NegotiationError(f"{side} versions: {v!r} is not a (major, minor) pair of ints")
        out.append(pair)
    return out


def newest_minors(versions: Iterable[Version]) -> dict[int, int]:
    """Major -> the highest minor of it that ``versions`` list."""
    out: dict[int, int] = {}
    for major, minor in versions:
        out[major] = max(minor, out.get(major, -1))
    return out


def describe(versions: Iterable[Version]) -> str:
    """``1.0-1.3, 2.0`` style text: every version a list means."""
    parts = []
    for major, minor in sorted(newest_minors(versions).items()):
        parts.append(f"{major}.0" if minor == 0 else f"{major}.0-{major}.{minor}")
    return ", ".join(parts) if parts else "nothing"


def negotiate(ours: Iterable[Version], theirs: Iterable[Version]) -> Version:
    """The highest version both sides read, or :class:`VersionMismatch` naming both lists."""
    ours_l, theirs_l = _pairs(ours, "this side's"), _pairs(theirs, "the peer's")
    a, b = newest_minors(ours_l), newest_minors(theirs_l)
    common = set(a) & set(b)
    if not common:
        raise VersionMismatch(
            f"no common protocol version: this side reads {describe(ours_l)}, "
            f"the peer reads {describe(theirs_l)}",
            ours=sorted(ours_l),
            theirs=sorted(theirs_l),
        )
    major = max(common)
    return major, min(a[major], b[major])
