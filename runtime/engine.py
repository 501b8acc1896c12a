"""The engine-facing API: everything an inference engine needs to embed pdwire, in one import.

::

    from pdwire.runtime import engine as pd

    rank = pd.ParallelRank(tp_size=2, tp_rank=0)
    memory = pd.RankMemory(rank, kv=pd.KvPool(...), state=(...), aux=(...))
    pre = pd.PrefillWorker(pd.PrefillConfig(engine_id="p0", rank=rank, model=model), memory)
    dec = pd.DecodeWorker(pd.DecodeConfig(engine_id="d0", rank=rank, model=model), memory)
    group = dec.connect(prefill_endpoints)           # returns at once; step() runs the handshake
    room = pd.room_for_request("req-42")
    dec.start_room(room, pd.RequestIndices(kv_pages, state=[mamba_slot], aux_index=3), group)
    pre.send_chunk(room, src_pages, last=True, state=[src_slot], aux_index=7)
    # drive both from the engine's loop (worker.step(timeout_ms)) or a WorkerThread

"Engine" here is the inference engine; the transfer engine (NIXL, Mooncake, MoRI, ``local``)
is a :class:`Backend`. docs/engine-api.md tells the callbacks, the errors (all raised before
anything is sent; a request that fails later is reported with a typed :class:`Failure`) and
the control plane's keys. Nothing here imports torch, the demo or a transfer engine until a
backend is created.
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
from pdwire.runtime.staging import Copier, CopyError
from pdwire.runtime.staging.torch_copy import TorchCopier
from pdwire.runtime.workers.decode import DecodeStats, DecodeWorker, PrefillGroup
from pdwire.runtime.workers.prefill import PrefillStats, PrefillWorker
from pdwire.runtime.workers.thread import WorkerStopped, WorkerThread

__all__ = [
    "RESERVED_ROOM",
    "AuxBuffer",
    "Backend",
    "ConfigError",
    "ControlAuth",
    "Copier",
    "CopyError",
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
    "TorchCopier",
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
