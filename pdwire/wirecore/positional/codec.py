"""Runtime of generated positional profiles: message table, recognition and dispatch.

A positional profile (SGLang's frames) has no header: a message is recognised by its fixed
frames (guard, ``"None"`` register marker, status tag) and a few frame predicates
(``dec``: a canonical decimal, ``not_dec``: anything else), always within one profile
version the caller chooses. The generated version modules list one :class:`MessageSpec`
per message; :class:`ProfileCodec` finds, decodes and encodes with them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from ..types import Version
from .encodings import Buf, as_buffers, frame_count
from .errors import ProfileEncodeError, ProfileFrameCountError, UnrecognisedMessage, Where

Problems = list[tuple[str, str]]  # (field, problem) pairs found by a profile's cross-frame checks


@dataclass(frozen=True)
class MessageSpec:
    backend: str
    name: str
    cls: type[Any]
    min_frames: int
    max_frames: int
    consts: tuple[tuple[int, bytes], ...]
    match: tuple[tuple[int, str], ...]
    decode: Callable[[list[Buf]], Any]
    encode: Callable[[Any], list[bytes]]
    check: Callable[[Any], Problems]
    derived: tuple[str, ...] = ()
    # recognition beyond a frame-0 literal (other fixed frames, predicates) over bytes frames
    # known to be present; None: nothing more to test. Generated straight-line code.
    rest: Callable[[list[bytes]], bool] | None = None

    @property
    def reach(self) -> int:
        """Frames recognition reads: with fewer, :meth:`matches` is False."""
        return 1 + max((i for i, _ in (*self.consts, *self.match)), default=-1)

    def fits(self, frames: Sequence[Buf]) -> bool:
        """Fixed frames and frame count fit (predicates not checked)."""
        if not self.min_frames <= len(frames) <= self.max_frames:
            return False
        return all(i < len(frames) and frames[i] == lit for i, lit in self.consts)

    def matches(self, frames: Sequence[Buf]) -> bool:
        for i, lit in self.consts:
            if i >= len(frames) or frames[i] != lit:
                return False
        return all(i < len(frames) and _PREDICATES[p](frames[i]) for i, p in self.match)


class _Dispatch:
    """Recognition of one version's messages from bytes frames, precomputed.

    Candidates are keyed by frame 0 (the fixed literal of guarded messages; any other frame 0
    selects the messages without one) and by the frame count up to the deepest frame any
    message's recognition reads, so the candidates list holds exactly the messages whose
    frame-0 literal fits and whose recognised frames are present. :meth:`find` returns the one
    candidate whose remaining tests pass, or None (none, or several: the caller's full path
    reports it), which makes it agree with :meth:`ProfileCodec._recognise` whenever it answers.
    """

    __slots__ = ("by_head", "head_len", "other", "reach")

    def __init__(self, specs: Sequence[MessageSpec]) -> None:
        self.reach = max((s.reach for s in specs), default=0)
        heads: dict[bytes | None, list[MessageSpec]] = {}
        for s in specs:
            heads.setdefault(dict(s.consts).get(0), []).append(s)
        loose = heads.pop(None, [])

        def by_count(group: list[MessageSpec]) -> tuple[tuple[MessageSpec, ...], ...]:
            ordered = [s for s in specs if s in group]  # schema order
            return tuple(tuple(s for s in ordered if s.reach <= n) for n in range(self.reach + 1))

        # a loose message whose frame-0 predicate refuses a literal is no candidate for it
        self.by_head = {
            head: by_count(group + [s for s in loose if _head_fits(s, head)])
            for head, group in heads.items()
            if head is not None
        }
        self.other = by_count(loose)
        self.head_len = max((len(h) for h in self.by_head), default=0)

    def find(self, frames: list[bytes], backend: str | None) -> MessageSpec | None:
        n = len(frames)
        if not n:
            return None
        head = frames[0]
        table = self.by_head.get(head, self.other) if len(head) <= self.head_len else self.other
        hit = None
        for s in table[n if n < self.reach else self.reach]:
            if (backend is None or s.backend == backend) and (s.rest is None or s.rest(frames)):
                if hit is not None:
                    return None  # ambiguous: the full path names the messages
                hit = s
        return hit


def _head_fits(spec: MessageSpec, head: bytes) -> bool:
    return all(_PREDICATES[p](head) for i, p in spec.match if i == 0)


def _is_dec(b: Buf) -> bool:
    raw = bytes(b)
    return 0 < len(raw) <= 20 and raw.isdigit() and (len(raw) == 1 or raw[0] != 0x30)


_PREDICATES: dict[str, Callable[[Buf], bool]] = {"dec": _is_dec, "not_dec": lambda b: not _is_dec(b)}
PREDICATES = frozenset(_PREDICATES)


def count_error(profile: str, spec: MessageSpec, n: int) -> ProfileFrameCountError | None:
    problem = frame_count(n, spec.min_frames, spec.max_frames)
    if problem is None:
        return None
    return ProfileFrameCountError(problem, profile=profile, backend=spec.backend, message=spec.name)


def raise_problems(problems: Problems, where: Mapping[str, Where], *, decode: bool) -> None:
    """Raise the first cross-frame problem as the typed error of its field's frame."""
    if problems:
        field, problem = problems[0]
        w = where[field]
        raise w.decode_error(problem) if decode else w.encode_error(problem)


class ProfileCodec:
    """Every message of every version of one positional profile."""

    def __init__(self, profile: str, versions: Mapping[Version, Sequence[MessageSpec]]) -> None:
        self.profile = profile
        self.versions = dict(versions)
        self.newest = max(self.versions)
        self._by_class: dict[type[Any], MessageSpec] = {
            s.cls: s for specs in self.versions.values() for s in specs
        }
        self._dispatch = {v: _Dispatch(specs) for v, specs in self.versions.items()}
        self._newest = self._dispatch[self.newest]
        self.encoders: dict[type[Any], Callable[[Any], list[bytes]]] = {
            cls: s.encode for cls, s in self._by_class.items()
        }
        """Message class -> its encoder (what :meth:`encode` dispatches on)."""

    def specs(self, version: Version | None = None) -> Sequence[MessageSpec]:
        v = self.newest if version is None else version
        if v not in self.versions:
            known = ", ".join(f"{a}.{b}" for a, b in sorted(self.versions))
            raise UnrecognisedMessage(
                f"no profile version {v[0]}.{v[1]} (known: {known})", profile=self.profile, backend=None
            )
        return self.versions[v]

    def recognise(
        self,
        frames: Sequence[object],
        backend: str | None = None,
        version: Version | None = None,
        message: str | None = None,
    ) -> MessageSpec:
        """The message these frames are, or :class:`UnrecognisedMessage` saying why none fits."""
        return self._recognise(as_buffers(frames, self.profile, backend), backend, version, message)

    def _recognise(
        self, bufs: list[Buf], backend: str | None, version: Version | None, message: str | None
    ) -> MessageSpec:
        specs = [s for s in self.specs(version) if backend is None or s.backend == backend]
        if backend is not None and not specs:
            backends = sorted({s.backend for s in self.specs(version)})
            raise UnrecognisedMessage(
                f"unknown backend (known: {', '.join(backends)})", profile=self.profile, backend=backend
            )
        if message is not None:
            named = [s for s in specs if s.name == message]
            if not named:
                names = ", ".join(s.name for s in specs)
                raise UnrecognisedMessage(
                    f"no message {message} here (known: {names})", profile=self.profile, backend=backend
                )
            return named[0]
        hits = [s for s in specs if s.matches(bufs)]
        if len(hits) == 1:
            return hits[0]
        if not hits and backend is not None:
            # told the backend: a malformed predicate frame (a room that is not a decimal) is
            # reported by the one message whose fixed frames and frame count fit, naming the frame
            fits = [s for s in specs if s.fits(bufs)]
            if len(fits) == 1:
                return fits[0]
        start = ", ".join(repr(bytes(b[:16])) for b in bufs[:3]) or "no frames"
        if not hits:
            raise UnrecognisedMessage(
                f"no message matches {len(bufs)} frames starting {start}",
                profile=self.profile,
                backend=backend,
            )
        raise UnrecognisedMessage(
            f"ambiguous: frames match {', '.join(s.name for s in hits)}; name the message",
            profile=self.profile,
            backend=backend,
        )

    def decode(
        self,
        frames: Sequence[object],
        backend: str | None = None,
        *,
        version: Version | None = None,
        message: str | None = None,
    ) -> Any:
        if message is None and type(frames) is list:
            for f in frames:
                if type(f) is not bytes:
                    break
            else:  # the common case (zmq copy=True): one dict lookup, then the unique candidate
                d = self._newest if version is None else self._dispatch.get(version)
                if d is not None:
                    spec = d.find(frames, backend)
                    if spec is not None:
                        return spec.decode(frames)
        bufs = as_buffers(frames, self.profile, backend)
        return self._recognise(bufs, backend, version, message).decode(bufs)

    def encode(self, msg: object) -> list[bytes]:
        return self.spec_of(msg).encode(msg)

    def spec_of(self, msg: object) -> MessageSpec:
        spec = self._by_class.get(type(msg))
        if spec is None:
            raise ProfileEncodeError(
                f"{type(msg).__name__} is not a message of this profile", profile=self.profile, backend=None
            )
        return spec

    def problems(self, msg: object) -> Problems:
        """What the profile's cross-frame checks find wrong with a message (empty: encodable)."""
        return self.spec_of(msg).check(msg)

    def to_dict(self, msg: object) -> dict[str, Any]:
        """Fields (then derived properties) as JSON-friendly values: arrays as lists, blobs as hex."""
        spec = self.spec_of(msg)
        out = {f.name: to_jsonable(getattr(msg, f.name)) for f in msgspec.structs.fields(spec.cls)}
        for name in spec.derived:
            out[name] = to_jsonable(getattr(msg, name))
        return out


def to_jsonable(v: object) -> Any:
    if isinstance(v, np.ndarray):
        return [int(x) for x in v.tolist()]
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, list):
        return [to_jsonable(x) for x in v]
    if isinstance(v, int) and not isinstance(v, bool) and type(v) is not int:
        return v.name if hasattr(v, "name") else int(v)  # IntEnum members by name
    return v
