"""Registration over real sockets: a 1.2-or-newer peer whose self-described components disagree with the
prefill side's model is refused at registration (RegisterAck) naming component, tensor and field."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import zmq
from pdwire.runtime.backends.local import LocalBackend
from pdwire.runtime.demo_rank import model_fingerprint
from pdwire.runtime.session.decode_worker import DecodeWorker
from pdwire.runtime.session.failures import HandshakeError
from pdwire.runtime.session.handshake import Identity
from pdwire.runtime.session.prefill_worker import PrefillWorker

from pdwire import wire
from tests.e2e.conftest import SPEC, serving, worker_caches


@pytest.mark.parametrize("versions", [(), ((1, 1),)], ids=["newest", "1.1"])
def test_a_registration_that_disagrees_in_component_structure_is_refused(versions: tuple[Any, ...]) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    pb, db = LocalBackend(agent_name="pre"), LocalBackend(agent_name="dec")
    model = model_fingerprint(SPEC)
    pc, dc = worker_caches(pb), worker_caches(db)
    # a decode build that names its SWA tensors differently (same fingerprint: the skew the
    # Hello cannot see)
    swa = dc.memory.state[1]
    skewed = replace(swa, tensors=tuple(replace(t, name=f"swa_{t.name}") for t in swa.tensors))
    dc.memory = replace(dc.memory, state=(dc.memory.state[0], skewed))
    pre = PrefillWorker(Identity(wire.Role.PREFILL, "pre", 1, 0, model), pc, pb, ctx, room_timeout_s=10)
    dec = DecodeWorker(
        Identity(wire.Role.DECODE, "dec", 1, 0, model, versions), dc, db, ctx, room_timeout_s=10
    )
    try:
        with serving(pre):
            if versions:  # a 1.1 peer cannot describe its components: borrowed, accepted (documented)
                assert dec.connect([pre.endpoint], timeout_s=10) == "pre"
                assert dec.stats.versions == ["pre/0=1.1"]
                return
            with pytest.raises(HandshakeError) as e:
                dec.connect([pre.endpoint], timeout_s=10)
            msg = str(e.value)
            assert "refused the registration: handshake: RegistrationMismatch" in msg, msg
            assert "state_components[1] (swa), field tensor_names" in msg and "swa_k" in msg, msg
            assert pre._by_peer == {}  # nothing was prepared for the refused peer
    finally:
        pre.close()
        dec.close()
        pb.close()
        db.close()
        ctx.term()
