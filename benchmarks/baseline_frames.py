"""Shared by the codec benchmarks: today's hand-written frame helpers (the baseline).

The helpers are written the way SGLang's PD code writes its frames: ``struct`` with native
``Q`` pointer lists, ``pack_int_lists`` (u32 count + u32 byte lengths + payloads) for lists of
lists, ASCII decimal integers, and everything unpacked back to Python lists.
"""

from __future__ import annotations

import struct


def pack_list_of_buffers(bufs: list[bytes]) -> bytes:
    if not bufs:
        return b""
    return struct.pack(f"<{len(bufs) + 1}I", len(bufs), *(len(b) for b in bufs)) + b"".join(bufs)


def unpack_list_of_buffers(buf: bytes) -> list[bytes]:
    if not buf:
        return []
    (n,) = struct.unpack_from("<I", buf, 0)
    lens = struct.unpack_from(f"<{n}I", buf, 4)
    pos, out = 4 + 4 * n, []
    for ln in lens:
        out.append(buf[pos : pos + ln])
        pos += ln
    return out


def pack_int_lists(lists: list[list[int]], fmt: str) -> bytes:
    return pack_list_of_buffers([struct.pack(f"<{len(a)}{fmt}", *a) for a in lists])


def unpack_int_lists(buf: bytes, fmt: str) -> list[list[int]]:
    if not buf:
        return []
    (n,) = struct.unpack_from("<I", buf, 0)
    lens = struct.unpack_from(f"<{n}I", buf, 4)
    pos, size, out = 4 + 4 * n, struct.calcsize(fmt), []
    for ln in lens:
        out.append(list(struct.unpack_from(f"<{ln // size}{fmt}", buf, pos)))
        pos += ln
    return out


def native_u64(ptrs: list[int]) -> bytes:
    return b"".join(struct.pack("Q", p) for p in ptrs)


def unpack_u64(buf: bytes) -> list[int]:
    return list(struct.unpack(f"{len(buf) // 8}Q", buf))


def ascii_int(v: int) -> bytes:
    return str(v).encode("ascii")
