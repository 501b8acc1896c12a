"""The engine-facing API: everything an inference engine needs to embed pdwire, in one import.

::

    from pdwire.runtime import engine as pd

    # 1. the rank's place in the parallel grid, and the memory it transfers with the planner's
    #    model (pointers, lengths, shapes; engines with torch: pdwire.runtime.torch_memory)
    rank = pd.ParallelRank(tp_size=2, tp_rank=0)
    memory = pd.RankMemory(rank, kv=pd.KvPool(...), state=(...), aux=(...))

    # 2. one worker per rank; the control plane is authenticated with the deployment's CURVE
    #    keys (`pdwire keys generate DIR`; or PDWIRE_CONTROL_KEYS=DIR and leave control_auth out)
    auth = pd.ControlAuth.from_directory("/etc/pdwire/keys")
    pre = pd.PrefillWorker(pd.PrefillConfig(engine_id="p0", rank=rank, model=model, control_auth=auth),
                           memory)
    dec = pd.DecodeWorker(pd.DecodeConfig(engine_id="d0", rank=rank, model=model, control_auth=auth),
                          memory)
    group = dec.connect(prefill_endpoints)           # returns at once; step() runs the handshake
    # (group.state: CONNECTING -> READY/FAILED, on_connected(group); dec.wait_ready(group) blocks)

    # 3. per request
    room = pd.room_for_request("req-42")
    dec.start_room(room, pd.RequestIndices(kv_pages, state=[mamba_slot, swa_pages], aux_index=3), group)
    pre.send_chunk(room, src_pages, last=True, state=[src_slot, src_swa], aux_index=7)

    # 4. drive both from the inference engine's loop (worker.step(timeout_ms)) or a thread
    #    (WorkerThread)

"Engine" here is the inference engine; the transfer engine (NIXL, Mooncake, MoRI, ``local``)
is a :class:`Backend` (``create_backend(name)``, or the config's ``backend`` name).

Callbacks: prefill ``on_released(room, status, failure)`` (source memory free again);
decode ``on_finished(room, status, failure)`` (the request's outcome) and
``on_slots_released(room)`` (destination memory free again). ``status(room)`` answers a
poll. Errors: :class:`ConfigError` (a configuration or memory that cannot work),
:class:`IndicesError` (bad request indices), :class:`DuplicateRoomError`,
:class:`HandshakeError` (a peer refused, by name: ``wait_ready``; ``group.error`` otherwise), all
raised before anything is sent; a
request that fails later is reported through the callbacks with a typed :class:`Failure`.

Nothing here imports torch, the demo or a transfer engine until a backend is created.
"""

from pdwire.runtime.backends import Backend, available_backends, create_backend, default_backend
from pdwire.runtime.backends.registry import register_backend
from pdwire.runtime.config import (
    ConfigError,
    DecodeConfig,
    ModelFingerprint,
    ParallelRank,
    PrefillConfig,
    WorkerConfig,
)
from pdwire.runtime.control_auth import ControlAuth
from pdwire.runtime.descriptors import MemoryKind
from pdwire.runtime.indices import RESERVED_ROOM, IndicesError, RequestIndices, room_for_request
from pdwire.runtime.planner import (
    AuxBuffer,
    HeadGeometry,
    Indexing,
    KvPool,
    Layout,
    PlanError,
    RankMemory,
    StateKind,
    StatePool,
    StateTensor,
    regions,
)
from pdwire.runtime.session.failures import (
    DuplicateRoomError,
    Failure,
    FailureKind,
    HandshakeError,
    RegistrationMismatch,
    SessionError,
)
from pdwire.runtime.session.states import GroupState
from pdwire.runtime.session.status import Status, is_terminal
from pdwire.runtime.workers.decode import DecodeStats, DecodeWorker, PrefillGroup
from pdwire.runtime.workers.prefill import PrefillStats, PrefillWorker
from pdwire.runtime.workers.thread import WorkerStopped, WorkerThread

__all__ = [
    "RESERVED_ROOM",
    "AuxBuffer",
    "Backend",
    "ConfigError",
    "ControlAuth",
    "DecodeConfig",
    "DecodeStats",
    "DecodeWorker",
    "DuplicateRoomError",
    "Failure",
    "FailureKind",
    "GroupState",
    "HandshakeError",
    "HeadGeometry",
    "Indexing",
    "IndicesError",
    "KvPool",
    "Layout",
    "MemoryKind",
    "ModelFingerprint",
    "ParallelRank",
    "PlanError",
    "PrefillConfig",
    "PrefillGroup",
    "PrefillStats",
    "PrefillWorker",
    "RankMemory",
    "RegistrationMismatch",
    "RequestIndices",
    "SessionError",
    "StateKind",
    "StatePool",
    "StateTensor",
    "Status",
    "WorkerConfig",
    "WorkerStopped",
    "WorkerThread",
    "available_backends",
    "create_backend",
    "default_backend",
    "is_terminal",
    "regions",
    "register_backend",
    "room_for_request",
]
