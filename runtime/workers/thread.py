"""A worker on its own thread: the way engine schedulers (SGLang's, vLLM's connector) call a
transfer layer, never blocking on a transfer (usage: docs/engine-api.md).

:meth:`WorkerThread.submit` queues a call, wakes the loop at once (a pipe the worker's poller
watches) and returns a Future. The worker's callbacks run on the worker's thread: keep them
short. The worker itself is not thread-safe: once the thread runs, call it only through
:meth:`submit`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, Protocol, TypeVar

import zmq

log = logging.getLogger("pdwire.worker")


class Steppable(Protocol):
    @property
    def poller(self) -> zmq.Poller: ...

    def step(self, timeout_ms: int) -> dict[Any, int]: ...

    def close(self) -> None: ...


W = TypeVar("W", bound=Steppable)
T = TypeVar("T")


class WorkerStopped(RuntimeError):
    """A call submitted to a :class:`WorkerThread` that stopped (or failed) before running it."""


class WorkerThread(Generic[W]):
    """Steps ``worker`` on a thread of its own; see the module notes. ``idle_ms`` bounds each
    wait when nothing happens (a submitted call or a message wakes the loop sooner)."""

    def __init__(self, worker: W, *, idle_ms: int = 50, name: str = "pdwire-worker") -> None:
        self.worker = worker
        self.idle_ms = idle_ms
        self._calls: deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = deque()
        self._lock = threading.Lock()
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.error: BaseException | None = None  # what stopped the loop, if it did not stop on request

    # ------------------------------------------------------------------ any thread

    def start(self) -> WorkerThread[W]:
        self.worker.poller.register(self._wake_r, zmq.POLLIN)
        self._thread.start()
        return self

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` on the worker's thread, between two steps; thread-safe."""
        future: Future[T] = Future()
        with self._lock:
            if self._stopping or self.error is not None:
                future.set_exception(WorkerStopped("the worker thread is stopped"))
                return future
            self._calls.append((future, fn, args, kwargs))
        self._wake()
        return future

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the loop after the calls already submitted ran, and join the thread. The worker
        stays open (close it, or leave the ``with`` block, which does both). Idempotent."""
        with self._lock:
            self._stopping = True
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"worker thread {self._thread.name} did not stop within {timeout_s}s")

    def close(self) -> None:
        """Stop the loop and close the worker."""
        self.stop()
        self.worker.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def __enter__(self) -> WorkerThread[W]:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def ident(self) -> int | None:
        """The worker thread's id (``threading.get_ident()`` inside the callbacks)."""
        return self._thread.ident

    def _wake(self) -> None:
        # a full pipe means a wake-up is pending anyway; a closed one, that the thread is gone
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    # ------------------------------------------------------------------ the worker's thread

    def _loop(self) -> None:
        try:
            while True:
                self._run_calls()
                with self._lock:
                    if self._stopping:
                        break
                events = self.worker.step(self.idle_ms)
                if events.get(self._wake_r):
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
            self._run_calls()
        except BaseException as exc:  # a bug in the worker: every caller must hear of it
            self.error = exc
            # and the operator: a rank whose loop stopped answers no peer from now on
            log.critical("worker thread %s stopped: %r", self._thread.name, exc, exc_info=exc)
        finally:
            self.worker.poller.unregister(self._wake_r)
            with self._lock:
                self._stopping = True
                pending = list(self._calls)
                self._calls.clear()
            for future, *_ in pending:
                future.set_exception(WorkerStopped(f"the worker thread stopped: {self.error!r}"))

    def _run_calls(self) -> None:
        while True:
            with self._lock:
                if not self._calls:
                    return
                future, fn, args, kwargs = self._calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # the caller gets it through the future
                future.set_exception(exc)
