"""CURVE on the workers' control sockets: which keys a worker uses (:func:`resolve`), the ZAP
handler that admits clients, and the socket events that say why a handshake was refused.

The connection machines never see any of this: an unauthenticated or unknown peer is refused by
libzmq during the ZMTP handshake, before a single frame of it reaches a worker. ZAP is per ZMQ
context, so one :class:`ZapHandler` thread serves every worker socket of a context, each server
socket with its own ZAP domain and key set.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from itertools import count
from typing import Any, ClassVar

import zmq
from zmq.auth.thread import ThreadAuthenticator

from pdwire.runtime.config import ConfigError, WorkerConfig
from pdwire.runtime.control_auth import ENV_INSECURE, ENV_KEYS, ControlAuth
from pdwire.runtime.workers.failure_log import log as failure_log

log = logging.getLogger("pdwire.auth")

HANDSHAKE_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def resolve(config: WorkerConfig) -> ControlAuth | None:
    """The keys a worker's control sockets use; None: unauthenticated, as explicitly asked."""
    if config.control_auth is not None:
        return config.control_auth
    if config.insecure_control:
        return None
    keys = os.environ.get(ENV_KEYS)
    if keys:
        return ControlAuth.from_directory(keys)
    if os.environ.get(ENV_INSECURE, "") in ("1", "true", "yes"):
        return None
    raise ConfigError(
        f"{type(config).__name__}: the control plane is authenticated (CURVE) and no keys were given: "
        f"set control_auth (ControlAuth.from_directory(DIR), DIR from `pdwire keys generate DIR`) or "
        f"{ENV_KEYS}=DIR; to run it unauthenticated say so with insecure_control=True or "
        f"{ENV_INSECURE}=1"
    )


class ZapHandler:
    """The ZAP authenticator of one ZMQ context, shared by every server socket in it."""

    _lock = threading.Lock()
    _by_context: ClassVar[dict[int, ZapHandler]] = {}
    _domains = count(1)

    def __init__(self, context: zmq.Context[Any]) -> None:
        self.context = context
        self.users = 0
        self._keys: dict[str, ControlAuth] = {}
        self.denied: dict[str, int] = {}  # domain -> keys refused
        self._auth = ThreadAuthenticator(context, log=logging.getLogger("pdwire.auth.zap"))
        self._auth.start()

    @classmethod
    def attach(cls, context: zmq.Context[Any], auth: ControlAuth) -> tuple[ZapHandler, str]:
        """The context's handler (started on first use) and a new ZAP domain admitting ``auth``'s keys."""
        with cls._lock:
            handler = cls._by_context.get(id(context))
            if handler is None or handler.context is not context:
                handler = cls._by_context[id(context)] = ZapHandler(context)
            handler.users += 1
            domain = f"pdwire-{os.getpid()}-{next(cls._domains)}"
            handler._keys[domain] = auth
            handler._auth.configure_curve_callback(domain, handler)
            return handler, domain

    def detach(self, domain: str) -> None:
        """The socket of ``domain`` is closed; the last one stops the thread (before the context
        is terminated: its ZAP socket lives in the context)."""
        with self._lock:
            self._keys.pop(domain, None)
            self.users -= 1
            if self.users == 0:
                self._auth.stop()
                if self._by_context.get(id(self.context)) is self:
                    del self._by_context[id(self.context)]

    def callback(self, domain: str, key: bytes) -> bool:
        """pyzmq's credentials provider: is ``key`` (Z85) admitted in ``domain``?"""
        auth = self._keys.get(domain)
        if auth is not None and auth.admits(key):
            return True
        self.denied[domain] = self.denied.get(domain, 0) + 1
        text = key.decode("ascii", "replace")
        log_refusal(f"control peer refused ({domain}): CURVE key {text} is not authorized")
        return False


def serve_curve(sock: zmq.Socket[Any], auth: ControlAuth, domain: str) -> None:
    """``sock`` (not bound yet) accepts only CURVE clients whose key ZAP admits in ``domain``."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, auth.secret_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, auth.public_key)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler answering: refuse, never admit


def connect_curve(sock: zmq.Socket[Any], auth: ControlAuth) -> None:
    """``sock`` (not connected yet) talks CURVE to a server holding ``auth.server_key``."""
    assert auth.server_key is not None
    sock.setsockopt(zmq.CURVE_SERVERKEY, auth.server_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, auth.public_key)
    sock.setsockopt(zmq.CURVE_SECRETKEY, auth.secret_key)


_PROTOCOL_ERRORS = {
    getattr(zmq, name): name.removeprefix("PROTOCOL_ERROR_").lower()
    for name in dir(zmq)
    if name.startswith("PROTOCOL_ERROR_")
}


def refusal_text(event: int, value: int, endpoint: str, secure: bool) -> str:
    """Why a handshake on ``endpoint`` failed, from its monitor event."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        why = f"the peer's key was refused (ZAP status {value})"
    elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        name = _PROTOCOL_ERRORS.get(value, hex(value))
        why = f"ZMTP protocol error {name}"
        if secure and value == getattr(zmq, "PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH", -1):
            why += " (the peer does not speak CURVE: an unauthenticated peer, or one configured insecure)"
        elif secure and value == getattr(zmq, "PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC", -1):
            why += " (the peers hold different CURVE keys)"
    else:
        why = f"no detail (errno {value})"
    return f"control handshake on {endpoint} refused: {why}"


def report_refusal(event: Mapping[str, Any], endpoint: str, secure: bool, failures: list[str]) -> str | None:
    """Record and log the refusal a monitor ``event`` reports; None for a peer that hung up
    mid-handshake (a reset, a restart: logged at debug level only, it retries)."""
    text = refusal_text(event["event"], event["value"], endpoint, secure)
    if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        failure_log.debug("%s", text)
        return None
    failures.append(text)
    log_refusal(text)
    return text


LOG_BURST = 20  # refusals logged at once; past that, one line a second naming how many were not


class _Limiter:
    def __init__(self) -> None:
        self.tokens, self.at, self.suppressed = float(LOG_BURST), time.monotonic(), 0
        self.lock = threading.Lock()

    def take(self) -> int | None:
        """The count of lines suppressed before this one, or None to suppress this one."""
        with self.lock:
            now = time.monotonic()
            self.tokens = min(float(LOG_BURST), self.tokens + (now - self.at))
            self.at = now
            if self.tokens < 1.0:
                self.suppressed += 1
                return None
            self.tokens -= 1.0
            suppressed, self.suppressed = self.suppressed, 0
            return suppressed


_limiter = _Limiter()


def log_refusal(text: str) -> None:
    """Log a refusal on ``pdwire.auth``: a burst of :data:`LOG_BURST`, then a line a second, so a
    flood of hostile sockets cannot flood the log (the workers' stats count every one)."""
    suppressed = _limiter.take()
    if suppressed is not None:
        extra = f" ({suppressed} more refusals not logged before this one)" if suppressed else ""
        log.warning("%s%s", text, extra)
