"""The fixed 12-byte header frame that starts every pdwire message.

Layout, little-endian: magic ``b"PDWR"`` (4), protocol id u16, major u8, minor u8,
message type id u16, number of side frames u16. It is read before the body is touched,
so a version or type this build does not know is refused without parsing anything else.
"""

from __future__ import annotations

import struct

from ..errors import BadMagic, HeaderError

MAGIC = b"PDWR"
HEADER = struct.Struct("<4sHBBHH")
HEADER_SIZE = HEADER.size  # 12
MAX_SIDE_FRAMES = 2**16 - 1

pack_header = HEADER.pack


def parse_header(buf: bytes | bytearray | memoryview) -> tuple[int, int, int, int, int]:
    """Return ``(protocol_id, major, minor, type_id, side_frames)`` or raise :class:`HeaderError`."""
    if len(buf) != HEADER_SIZE:
        raise HeaderError(f"header frame is {len(buf)} bytes, expected {HEADER_SIZE}", frame=0)
    magic, proto, major, minor, type_id, side = HEADER.unpack(buf)
    if magic != MAGIC:
        raise BadMagic(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}", frame=0)
    return proto, major, minor, type_id, side
