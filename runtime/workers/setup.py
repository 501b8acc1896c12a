"""What both workers do before their first message: get a backend and register the rank's memory."""

from __future__ import annotations

import os

from pdwire.runtime.backends import Backend, create_backend
from pdwire.runtime.config import ConfigError, ParallelRank, WorkerConfig
from pdwire.runtime.planner import PlanError, RankMemory, regions


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


def own_buffer(backend: Backend, name: str, nbytes: int) -> tuple[int, int]:
    """(region index, address) of a worker buffer ``name`` of ``nbytes``: the one an earlier
    worker on this backend registered (a backend outlives the workers an engine builds on it),
    else a new one, allocated and registered after every other region. Raises BackendError."""
    for i, r in enumerate(backend.regions):
        if r.name == name and r.length == nbytes:
            return i, r.base
    buf = backend.allocate(name, nbytes)
    (region,) = backend.register([buf.region()])
    return region, buf.address


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
