"""etcd discovery: each rank's entry under a leased key, a prefix watch for the others
(behaviour: docs/deployment.md, "etcd behaviour" and "Losing etcd is not fatal").

Uses etcd's v3 HTTP gateway through ``etcd3gw``; the watch stream is read here, line by line,
with read timeouts, because a watch that a dead server or a cut link leaves silent must be
noticed and resumed, not waited on forever. Two background threads, the lease **keeper** and
the **watcher**, only put :data:`~.membership.RegistryEvent` values into a queue that
:meth:`~.base.Discovery.poll` drains in the caller's thread; nothing of a failure ever raises
out of ``poll``.
"""

from __future__ import annotations

import base64
import json
import queue
import socket
import threading
from collections.abc import Sequence
from typing import Any

from pdwire import wire
from pdwire.discovery.base import Discovery, log
from pdwire.discovery.entry import DEFAULT_PREFIX, ROLES, RankEntry, encode_entry
from pdwire.discovery.membership import (
    Delete,
    Put,
    Reachable,
    RegistryEvent,
    Snapshot,
    Unreachable,
)
from pdwire.runtime.endpoints import HostPort, parse_host_port

DEFAULT_TTL_S = 10
DEFAULT_PORT = 2379


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def _unb64(text: object) -> bytes:
    if not isinstance(text, str):
        raise _BadAnswer(f"expected base64 text, got {type(text).__name__}")
    return base64.b64decode(text, validate=True)


def _range_end(prefix: str) -> str:
    """The first key after every key starting with ``prefix`` (etcd's prefix range)."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1  # prefixes end with '/', never 0xff
    return raw.decode()


class _BadAnswer(Exception):
    """The server answered something this client cannot read."""


class _Compacted(Exception):
    """The revision to resume from was compacted away: read the prefix again."""


class _Health:
    """Reachability of the registry over both threads: one report per transition."""

    def __init__(self, out: queue.Queue[RegistryEvent], where: str) -> None:
        self._out = out
        self._where = where
        self._down: dict[str, str] = {}
        self._reported = False
        self._lock = threading.Lock()

    def down(self, part: str, reason: str) -> None:
        with self._lock:
            self._down[part] = reason
            if self._reported:
                return
            self._reported = True
        log.warning(
            "etcd %s unreachable (%s: %s); keeping the last view and retrying", self._where, part, reason
        )
        self._out.put(Unreachable(f"etcd {self._where}: {part}: {reason}"))

    def up(self, part: str) -> None:
        with self._lock:
            self._down.pop(part, None)
            if not self._reported or self._down:
                return
            self._reported = False
        log.info("etcd %s reachable again", self._where)
        self._out.put(Reachable())


class _Backoff:
    def __init__(self, first: float = 0.1, cap: float = 1.0) -> None:
        self.first, self.cap, self.next_s = first, cap, first

    def step(self) -> float:
        s, self.next_s = self.next_s, min(self.cap, self.next_s * 2)
        return s

    def reset(self) -> None:
        self.next_s = self.first


def _reason(exc: BaseException) -> str:
    # etcd3gw's exceptions keep the text in detail_text and leave str(exc) empty
    text = str(exc).strip() or str(getattr(exc, "detail_text", "") or "").strip()
    return f"{type(exc).__name__}: {text}"[:300] if text else type(exc).__name__


class EtcdDiscovery(Discovery):
    kind = "etcd"

    def __init__(
        self,
        endpoints: Sequence[str] = (f"127.0.0.1:{DEFAULT_PORT}",),
        *,
        prefix: str = DEFAULT_PREFIX,
        roles: tuple[wire.Role, ...] = ROLES,
        ttl_s: int = DEFAULT_TTL_S,
        request_timeout_s: float = 2.0,
        watch_idle_s: float = 5.0,
    ) -> None:
        super().__init__(prefix, roles)
        import etcd3gw  # noqa: F401 - fail here, by name, when the client is not installed

        if not endpoints:
            raise ValueError("etcd discovery needs at least one endpoint")
        if ttl_s < 2:
            raise ValueError(f"lease TTL {ttl_s}s: etcd grants at least 2 s")
        self.endpoints: list[HostPort] = [parse_host_port(e, default_port=DEFAULT_PORT) for e in endpoints]
        self.ttl_s = int(ttl_s)
        self.request_timeout_s = request_timeout_s
        self.watch_idle_s = watch_idle_s
        where = ",".join(str(e) for e in self.endpoints)
        self._queue: queue.Queue[RegistryEvent] = queue.Queue()
        self._health = _Health(self._queue, where)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._registrations: dict[str, bytes] = {}
        self._withdrawn = threading.Event()
        self._withdrawn.set()
        self._stream: Any = None  # the open watch response, so close() can cut it
        self._keeper: threading.Thread | None = None
        self._watcher: threading.Thread | None = None
        self._closed = False
        if self.membership.roles:
            self._watcher = threading.Thread(target=self._watch_loop, name="pdwire-etcd-watch", daemon=True)
            self._watcher.start()

    # ---------------------------------------------------------------- clients

    def _client(self, attempt: int) -> Any:
        import etcd3gw

        ep = self.endpoints[attempt % len(self.endpoints)]
        return etcd3gw.Etcd3Client(host=ep.host, port=ep.port, timeout=self.request_timeout_s)

    # ---------------------------------------------------------------- registration

    def register(self, entry: RankEntry) -> None:
        """Announce ``entry``; every entry of this process shares one lease (they live and die
        together). Registering the same rank again replaces its entry."""
        key, value = encode_entry(entry, self.prefix)
        with self._lock:
            if self._closed:
                raise RuntimeError("register() on a closed EtcdDiscovery")
            self._registrations[key] = value
            self._withdrawn.clear()
            self.entries[key] = entry
            if self._keeper is None:
                self._keeper = threading.Thread(target=self._keep_loop, name="pdwire-etcd-lease", daemon=True)
                self._keeper.start()
        self._wake.set()

    def withdraw(self) -> None:
        with self._lock:
            self._registrations.clear()
            self.entries.clear()
            keeper = self._keeper
        if keeper is None:
            return
        self._wake.set()
        if not self._withdrawn.wait(self.request_timeout_s * 2 + 1):
            log.warning(
                "etcd: could not revoke this rank's lease in time; its entry expires within %ss", self.ttl_s
            )

    def _keep_loop(self) -> None:
        attempt = 0
        client = self._client(attempt)
        lease: Any = None
        written: dict[str, bytes] = {}
        backoff = _Backoff()
        while not self._stop.is_set():
            with self._lock:
                registrations = dict(self._registrations)
            try:
                if not registrations:
                    if lease is not None:
                        lease, old = None, lease
                        written = {}
                        old.revoke()
                        log.info("etcd: withdrew this rank (lease %x revoked)", old.id)
                    self._withdrawn.set()
                    self._wake.wait(1.0)
                    self._wake.clear()
                    continue
                if lease is None:
                    lease = client.lease(self.ttl_s)
                    written = {}
                    log.info("etcd: lease %x granted (ttl %ss)", lease.id, self.ttl_s)
                elif written and lease.refresh() <= 0:
                    log.warning(
                        "etcd: lease %x had expired (registry unreachable over %ss); registering again",
                        lease.id,
                        self.ttl_s,
                    )
                    lease, written = None, {}
                    continue
                for key, value in registrations.items():
                    if written.get(key) != value:
                        client.put(key, value, lease=lease)
                        written[key] = value
                        log.info("etcd: registered %s", key)
                self._health.up("lease")
                backoff.reset()
                self._wake.wait(self.ttl_s / 3)
                self._wake.clear()
            except Exception as exc:  # a registry problem must never end the rank: report, retry
                self._health.down("lease", _reason(exc))
                attempt += 1
                client = self._client(attempt)
                self._stop.wait(backoff.step())
        if lease is not None:
            try:
                lease.revoke()
            except Exception as exc:
                log.warning(
                    "etcd: lease %x not revoked at close (%s); it expires within %ss",
                    lease.id,
                    _reason(exc),
                    self.ttl_s,
                )
        self._withdrawn.set()

    # ---------------------------------------------------------------- watching

    def _watch_loop(self) -> None:
        scope = f"{self.prefix}/"
        attempt = 0
        revision: int | None = None
        backoff = _Backoff()
        while not self._stop.is_set():
            client = self._client(attempt)
            try:
                if revision is None:
                    items, revision = self._read_prefix(client, scope)
                    self._queue.put(Snapshot(items, revision))
                revision = self._follow(client, scope, revision, backoff)
            except _Compacted:
                revision = None
            except Exception as exc:  # report, move to the next endpoint, retry
                if self._stop.is_set():
                    break
                self._health.down("watch", _reason(exc))
                attempt += 1
                self._stop.wait(backoff.step())

    def _read_prefix(self, client: Any, scope: str) -> tuple[tuple[tuple[str, bytes], ...], int]:
        answer = client.post(
            client.get_url("/kv/range"), json={"key": _b64(scope), "range_end": _b64(_range_end(scope))}
        )
        try:
            revision = int(answer["header"]["revision"])
            items = tuple(
                (_unb64(kv["key"]).decode("utf-8", "replace"), _unb64(kv.get("value", "")))
                for kv in answer.get("kvs", [])
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise _BadAnswer(f"range answer unreadable: {exc!r}") from exc
        self._health.up("watch")
        return items, revision

    def _follow(self, client: Any, scope: str, revision: int, backoff: _Backoff) -> int:
        """Stream events after ``revision`` until the stream idles or ends; the last revision seen."""
        import requests

        body = {
            "create_request": {
                "key": _b64(scope),
                "range_end": _b64(_range_end(scope)),
                "start_revision": revision + 1,
            }
        }
        resp = client.session.post(
            client.get_url("/watch"),
            json=body,
            stream=True,
            timeout=(self.request_timeout_s, self.watch_idle_s),
        )
        self._stream = resp
        try:
            if resp.status_code != 200:
                raise _BadAnswer(f"watch answered HTTP {resp.status_code}: {resp.text[:200]}")
            for line in resp.iter_lines():
                if self._stop.is_set():
                    break
                if line.strip():
                    revision = self._handle(json.loads(line), revision)
                    backoff.reset()
        except requests.exceptions.ConnectionError as exc:
            # an idle stream times out on read: resume from the last revision (nothing is lost)
            import urllib3

            if not (exc.args and isinstance(exc.args[0], urllib3.exceptions.ReadTimeoutError)):
                raise
        finally:
            self._stream = None
            resp.close()
        return revision

    def _handle(self, message: Any, revision: int) -> int:
        try:
            if "error" in message:
                raise _BadAnswer(f"watch error: {message['error']}")
            result = message["result"]
            if int(result.get("compact_revision", 0)) > 0:
                log.info("etcd: revision %d was compacted; reading the prefix again", revision + 1)
                raise _Compacted
            if result.get("canceled"):
                raise _BadAnswer(f"watch cancelled by the server: {result.get('cancel_reason', '')}")
            if result.get("created"):
                self._health.up("watch")
            for ev in result.get("events", []):
                kv = ev["kv"]
                key = _unb64(kv["key"]).decode("utf-8", "replace")
                rev = int(kv["mod_revision"])
                if ev.get("type") == "DELETE":
                    self._queue.put(Delete(key, rev))
                else:
                    self._queue.put(Put(key, _unb64(kv.get("value", "")), rev))
                revision = max(revision, rev)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise _BadAnswer(f"watch message unreadable: {exc!r}") from exc
        return revision

    # ---------------------------------------------------------------- the interface

    def _events(self, timeout_s: float) -> list[RegistryEvent]:
        out: list[RegistryEvent] = []
        try:
            out.append(self._queue.get(timeout=timeout_s) if timeout_s > 0 else self._queue.get_nowait())
            while True:
                out.append(self._queue.get_nowait())
        except queue.Empty:
            return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.withdraw()
        self._stop.set()
        self._wake.set()
        self._cut_stream()
        for t in (self._keeper, self._watcher):
            if t is not None:
                t.join(self.watch_idle_s + self.request_timeout_s + 1)

    def _cut_stream(self) -> None:
        """Wake the watcher blocked on its stream now rather than at the next idle timeout."""
        resp = self._stream
        if resp is None:
            return
        try:
            fd = resp.raw._fp.fileno()
            s = socket.socket(fileno=socket.dup(fd))
            try:
                s.shutdown(socket.SHUT_RDWR)
            finally:
                s.close()
        except Exception:  # best effort: the idle timeout ends the stream anyway
            pass
