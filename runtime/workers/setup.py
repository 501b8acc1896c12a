"""What both workers share: the edge around their pure core (:class:`RankEdge`), and what they
do before their first message: get a backend and register the rank's memory."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Self

import zmq

from pdwire import wire
from pdwire.runtime.backends import Backend, create_backend
from pdwire.runtime.config import ConfigError, ParallelRank, WorkerConfig
from pdwire.runtime.planner import PlanError, RankMemory, regions
from pdwire.runtime.session.hello import Identity
from pdwire.runtime.staging import Copier
from pdwire.runtime.workers.backoff import PollBackoff
from pdwire.runtime.workers.curve import resolve


class RankEdge:
    """One rank's config, memory and Hello, its backend and ZMQ context (closed with the worker
    when it made them), the poller (with the engine's wake-up fds) and the poll loop's back-off."""

    def __init__(
        self,
        config: WorkerConfig,
        memory: RankMemory,
        role: wire.Role,
        backend: Backend | None,
        context: zmq.Context[Any] | None,
    ) -> None:
        self.config = config
        self.memory = memory
        self.auth = resolve(config)  # None: an unauthenticated control plane, as explicitly asked
        self.hello = Identity(role, config.engine_id, config.rank, config.model, config.versions).hello()
        self.backend, self._owns_backend = owned_backend(config, role.name.lower(), backend)
        self._ctx: zmq.Context[Any] = context if context is not None else zmq.Context()
        self._owns_ctx = context is None
        self.poller = zmq.Poller()  # the driver may register its own sockets or fds here too
        self._wake_fds: tuple[int, ...] = ()
        self._backoff = PollBackoff()
        self._closed = False

    def _wake_on(self, wakes: bool) -> None:
        """Wait in the poller on the engine's wake-up fds, if it ``wakes`` for this rank's news."""
        self._wake_fds = self.backend.wakeup_fds() if wakes else ()
        for fd in self._wake_fds:
            self.poller.register(fd, zmq.POLLIN)

    def _wait(self, timeout_ms: int, busy: bool, at_once: bool = False) -> dict[Any, int]:
        """One poll of the loop (see :meth:`.PollBackoff.wait`; ``at_once``: without waiting);
        the engine's wake-ups drained."""
        if at_once:
            events = dict(self.poller.poll(0))
        else:
            events = self._backoff.wait(self.poller, timeout_ms, busy, bool(self._wake_fds))
        if self._wake_fds and any(events.get(fd) for fd in self._wake_fds):
            self.backend.clear_wakeups()  # before looking at the engine: later news wakes again
        return events

    def _close_edge(self) -> None:
        for fd in self._wake_fds:
            with contextlib.suppress(KeyError):
                self.poller.unregister(fd)
        if self._owns_backend:
            self.backend.close()
        if self._owns_ctx:
            self._ctx.term()

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def owned_backend(config: WorkerConfig, role: str, backend: Backend | None) -> tuple[Backend, bool]:
    """The engine's backend (not owned), or one created from the config (owned: the worker closes it)."""
    if backend is not None:
        return backend, False
    options = dict(config.backend_options)
    options["agent_name"] = config.agent_name(role, os.getpid())
    options.setdefault("transfer_timeout_s", config.transfer_timeout_s)
    return create_backend(config.backend, **options), True


SCATTER_BUFFER = "pdwire-scatter"  # a decode rank's receive staging buffer
STAGING_BUFFER = "pdwire-staging"  # a prefill rank's staging buffer
BUFFER_NAMES = (SCATTER_BUFFER, STAGING_BUFFER)


def own_buffer(backend: Backend, name: str, nbytes: int, copier: Copier | None = None) -> tuple[int, int]:
    """(region index, address) of a worker buffer ``name`` of ``nbytes``: the one an earlier
    worker on this backend registered (a backend outlives the workers an engine builds on it),
    else a new one, allocated by ``copier`` where it copies (device memory) or by the backend,
    and registered after every other region. Raises BackendError."""
    given = copier.buffer(name, nbytes) if copier is not None else None
    for i, r in enumerate(backend.regions):
        if r.name == name and r.length == nbytes and (given is None or r.base == given.base):
            return i, r.base
    if given is None:
        buf = backend.allocate(name, nbytes)
        given = buf.region()
    (region,) = backend.register([given])
    return region, given.base


def register_memory(backend: Backend, memory: RankMemory, rank: ParallelRank) -> None:
    """Check ``memory`` against the configured rank and register its regions, in the planner's
    region order (descriptors index the backend's regions by that order).

    A backend that already holds exactly these regions (the engine registered them) is left
    alone, with any staging buffers an earlier worker added after them; any other registration
    would shift every region index, and is refused.
    """
    if memory.position != rank:
        raise ConfigError(f"memory.position is {memory.position}, the worker's rank is {rank}")
    try:
        wanted = regions(memory)
    except PlanError as exc:
        raise ConfigError(f"the rank's memory does not describe itself consistently: {exc}") from exc
    held = [(r.base, r.length) for r in backend.regions if r.name not in BUFFER_NAMES]
    if not held:
        backend.register(wanted)
        return
    if held != [(r.base, r.length) for r in wanted] or any(
        r.name in BUFFER_NAMES for r in backend.regions[: len(wanted)]
    ):
        raise ConfigError(
            f"backend {backend.agent_name!r} already holds {len(held)} regions that are not this memory's "
            f"{len(wanted)} regions in planner order; give the worker a backend with nothing registered"
        )
