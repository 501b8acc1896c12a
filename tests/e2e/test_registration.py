"""Registration over real sockets: a 1.2-or-newer peer whose self-described components disagree with the
prefill side's model is refused at registration (RegisterAck) naming component, tensor and field."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from pdwire.demo.model import RankCaches
from pdwire.runtime.engine import HandshakeError
from tests.e2e.conftest import serving, worker_pair


def rename_swa_tensors(dc: RankCaches) -> None:
    """A decode build that names its SWA tensors differently (same fingerprint: the skew the
    Hello cannot see)."""
    swa = dc.memory.state[1]
    skewed = replace(swa, tensors=tuple(replace(t, name=f"swa_{t.name}") for t in swa.tensors))
    dc.memory = replace(dc.memory, state=(dc.memory.state[0], skewed))


@pytest.mark.parametrize("versions", [(), ((1, 1),)], ids=["newest", "1.1"])
def test_a_registration_that_disagrees_in_component_structure_is_refused(versions: tuple[Any, ...]) -> None:
    with (
        worker_pair(adjust_decode_caches=rename_swa_tensors, decode_versions=versions, connect=False) as p,
        serving(p.pre),  # the test connects: the newest decode build expects a refusal
    ):
        if versions:  # a 1.1 peer cannot describe its components: borrowed, accepted (documented)
            assert p.dec.wait_ready(p.dec.connect([p.pre.endpoint], timeout_s=10)).engine_id == "pre"
            assert p.dec.stats.versions == ["pre/0=1.1"]
            return
        with pytest.raises(HandshakeError) as e:
            p.dec.wait_ready(p.dec.connect([p.pre.endpoint], timeout_s=10))
        msg = str(e.value)
        assert "refused the registration: handshake: RegistrationMismatch" in msg, msg
        assert "state_components[1] (swa), field tensor_names" in msg and "swa_k" in msg, msg
        assert p.pre.registered_peers == ()  # nothing was prepared for the refused peer
