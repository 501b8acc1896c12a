"""Golden frames assembled the way SGLang 0.5.23's builders do (tests/golden/sglang/build_golden.py).

Every case must decode to exactly the listed fields and re-encode byte for byte; the
recogniser must find the message from the frames alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdwire.wire import sglang

GOLDEN = json.loads((Path(__file__).parents[1] / "golden" / "sglang" / "frames.json").read_text("utf-8"))


def _version(case: dict[str, Any]) -> tuple[int, int]:
    major, minor = case["version"].split(".")
    return int(major), int(minor)


def _id(case: dict[str, Any]) -> str:
    return f"{case['backend']}-{case['message']}-{case['version']}-{case['name']}"


@pytest.mark.parametrize("case", GOLDEN, ids=_id)
def test_golden_decodes_to_fields_and_reencodes_byte_for_byte(case: dict[str, Any]) -> None:
    frames = [bytes.fromhex(h) for h in case["frames"]]
    msg = sglang.decode(frames, case["backend"], version=_version(case))
    assert type(msg).__name__ == case["message"]
    assert case["backend"] == msg.BACKEND
    assert sglang.to_dict(msg) == case["fields"]
    assert sglang.encode(msg) == frames


@pytest.mark.parametrize("case", GOLDEN, ids=_id)
def test_golden_recognised_without_naming_the_backend(case: dict[str, Any]) -> None:
    frames = [bytes.fromhex(h) for h in case["frames"]]
    spec = sglang.recognise(frames, version=_version(case))
    assert (spec.backend, spec.name) == (case["backend"], case["message"])


def test_every_message_of_every_version_has_a_golden_case() -> None:
    covered = {(c["message"], c["version"]) for c in GOLDEN}
    for version in sglang.VERSIONS:
        for spec in sglang.CODEC.specs(version):
            text = f"{version[0]}.{version[1]}"
            # status messages did not change in 2.0, so their 1.0 model is covered by 2.0's bytes
            if spec.name.endswith("Status") and text == "1.0":
                continue
            assert (spec.name, text) in covered, (spec.name, text)


def test_reference_byte_examples() -> None:
    """The literal examples of the reference: [[5], [], [10, 11]] is 28 bytes; [[]] is 8; [] is empty."""
    base = dict(
        room=1,
        local_ip="h",
        rank_port=1,
        session_id="s",
        kv_indices=[1],
        aux_index=0,
        required_dst_info_num=1,
    )
    frames = sglang.encode(sglang.MooncakeTransferInfo(**base, state_indices=[[5], [], [10, 11]]))
    assert frames[6] == bytes.fromhex("03000000 04000000 00000000 08000000 05000000 0a000000 0b000000")
    assert sglang.encode(sglang.MooncakeTransferInfo(**base, state_indices=[[]]))[6] == bytes.fromhex(
        "0100000000000000"
    )
    assert sglang.encode(sglang.MooncakeTransferInfo(**base, state_indices=[]))[6] == b""


def test_status_older_minor_models_read_the_same_bytes() -> None:
    frames = [b"MoriMsgGuard", b"5", b"4", b"1", b""]
    old = sglang.decode(frames, "mori", version=(1, 0))
    new = sglang.decode(frames, "mori")
    assert sglang.to_dict(old) == sglang.to_dict(new)
    assert sglang.encode(old) == frames
