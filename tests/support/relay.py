"""A user-space wire between two tap devices, with a delay: ``TwoHosts(..., link="relay")``.

``python -m tests.support.relay TAP_A TAP_B CONTROL_SOCKET`` creates the two tap devices in
the namespace it runs in (the fixture then moves each into its host's namespace: an open
tap keeps working there), prints ``ready``, and copies every Ethernet frame from one tap to
the other, each held for the current delay (frames keep their order; a change of delay
applies to frames read after it). It is the stand-in for netem's delay, which this kernel
lacks. Loss and cuts still come from nftables and ``ip link``, which act on taps as on veths.

The control socket (a UNIX stream socket) takes one line per connection and answers ``ok``
or an error: ``delay MS`` sets the one-way delay in milliseconds (each direction),
``stats`` answers ``ok frames=<n> bytes=<n>``.
"""

from __future__ import annotations

import collections
import fcntl
import os
import select
import socket
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000


def open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def main() -> None:
    name_a, name_b, control = sys.argv[1], sys.argv[2], sys.argv[3]
    fa, fb = open_tap(name_a), open_tap(name_b)
    other = {fa: fb, fb: fa}
    queues: dict[int, collections.deque[tuple[float, bytes]]] = {
        fa: collections.deque(),
        fb: collections.deque(),
    }
    last_due = {fa: 0.0, fb: 0.0}
    delay_s = 0.0
    frames = nbytes = 0
    ctl = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ctl.bind(control)
    ctl.listen()
    print("ready", flush=True)
    while True:
        now = time.monotonic()
        due = [q[0][0] for q in queues.values() if q]
        timeout = max(0.0, min(due) - now) if due else 1.0
        readable, _, _ = select.select([fa, fb, ctl], [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            if fd is ctl:
                conn, _ = ctl.accept()
                with conn:
                    words = conn.recv(200).decode().split()
                    if words[:1] == ["delay"] and len(words) == 2:
                        delay_s = float(words[1]) / 1000
                        conn.sendall(b"ok\n")
                    elif words == ["stats"]:
                        conn.sendall(f"ok frames={frames} bytes={nbytes}\n".encode())
                    else:
                        conn.sendall(b"error: expected 'delay MS' or 'stats'\n")
                continue
            assert isinstance(fd, int)
            while True:  # drain the tap: many frames per wake-up
                try:
                    frame = os.read(fd, 65536)
                except BlockingIOError:
                    break
                except OSError:  # the device is down (a cut): nothing to read
                    break
                out = other[fd]
                t = max(now + delay_s, last_due[out])
                last_due[out] = t
                queues[out].append((t, frame))
        now = time.monotonic()
        for out, q in queues.items():
            while q and q[0][0] <= now:
                _, frame = q.popleft()
                try:
                    os.write(out, frame)
                    frames += 1
                    nbytes += len(frame)
                except OSError:  # the far end is down (a cut) or full: the frame is lost, as on a wire
                    pass


if __name__ == "__main__":
    main()
