"""The decode server's admin socket: JSON commands over a ZMQ socket on a UNIX path.

``pdwire serve decode --admin PATH`` listens on ``ipc://PATH`` (a file: reachable from every
network namespace of the host, and only by who may open the file). One JSON object per
message; every answer is one JSON object:

* ``{"cmd": "status"}``: the connected prefill engines, the registry's reachability, counts;
* ``{"cmd": "run", "requests": N, "min_tokens": a, "max_tokens": b}``: start N requests and
  answer when all of them ended (``{"ok": k, "failed": [...], ...}``); other commands are
  answered meanwhile;
* ``{"cmd": "stop"}``: stop cleanly (answers first).

A malformed command is answered ``{"error": "..."}``; it never stops the server.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import zmq


class AdminSocket:
    def __init__(self, path: str, ctx: zmq.Context[Any]) -> None:
        self.path = path
        if os.path.exists(path):
            os.unlink(path)  # a stale socket file of a dead server
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"ipc://{path}")

    def receive(self) -> list[tuple[list[bytes], dict[str, Any] | str]]:
        """Every command waiting: (reply address, the command, or the error text for a bad one)."""
        out: list[tuple[list[bytes], dict[str, Any] | str]] = []
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) < 3:
                continue  # not a REQ envelope: nobody to answer
            address, body = frames[:-1], frames[-1]
            try:
                cmd = json.loads(body)
                if not isinstance(cmd, dict) or not isinstance(cmd.get("cmd"), str):
                    raise ValueError('a command is a JSON object with a "cmd" string')
                out.append((address, cmd))
            except ValueError as exc:
                out.append((address, f"bad command: {exc}"))

    def reply(self, address: list[bytes], answer: dict[str, Any]) -> None:
        with contextlib.suppress(zmq.ZMQError):  # the client went away
            self.sock.send_multipart([*address, json.dumps(answer).encode()], zmq.NOBLOCK)

    def close(self) -> None:
        self.sock.close(0)
        if os.path.exists(self.path):
            os.unlink(self.path)


def admin_call(path: str, command: dict[str, Any], timeout_s: float = 60.0) -> dict[str, Any]:
    """Send one command to a decode server's admin socket and return its answer."""
    ctx: zmq.Context[Any] = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"ipc://{path}")
        sock.send(json.dumps(command).encode())
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer from {path} within {timeout_s}s to {command.get('cmd')!r}")
        answer: dict[str, Any] = json.loads(sock.recv())
        return answer
    finally:
        sock.close(0)


def register(subparsers: Any) -> None:
    """``pdwire ctl SOCKET status | run [N] | stop``: talk to a decode server's admin socket."""
    p = subparsers.add_parser("ctl", help="send a command to a `pdwire serve decode --admin SOCKET` server")
    p.add_argument("socket", help="the decode server's --admin path")
    p.add_argument("command", choices=("status", "run", "stop"))
    p.add_argument("requests", nargs="?", type=int, default=8, help="run: how many requests (default 8)")
    p.add_argument("--min-tokens", type=int)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--room-timeout", type=float)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the answer")
    p.set_defaults(func=_ctl)


def _ctl(args: Any) -> int:
    cmd: dict[str, Any] = {"cmd": args.command}
    if args.command == "run":
        given = {
            "min_tokens": args.min_tokens,
            "max_tokens": args.max_tokens,
            "room_timeout_s": args.room_timeout,
        }
        cmd |= {"requests": args.requests} | {k: v for k, v in given.items() if v is not None}
    try:
        answer = admin_call(args.socket, cmd, args.timeout)
    except (TimeoutError, zmq.ZMQError) as exc:
        print(f"pdwire ctl: {exc}")
        return 1
    print(json.dumps(answer, indent=2))
    if "error" in answer:
        return 1
    return 0 if args.command != "run" or answer.get("ok") == answer.get("requests") else 1
