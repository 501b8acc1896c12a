"""The compiled encoder of flat messages (pdwire.wirecore.flat) against the generated Python
encoder it stands in for: the same body and side frames for every message the strategies draw,
and for every odd value either the same result or FlatBail (the registry then runs the Python
encoder, which converts or names what is wrong). Never a different body, never a value the
Python encoder would refuse."""

from __future__ import annotations

import importlib
import subprocess
import sys
from typing import Any

import msgspec
import numpy as np
import pdwire.wire as w
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pdwire.wire import strategies as S

from pdwire.wirecore import envelope, flat
from pdwire.wirecore.arrays import SIDE_FRAME_MIN_BYTES

NEWEST = w.REGISTRY.newest
FLAT = {name: mc for name, mc in ((mc.name, mc) for mc in w.REGISTRY.by_class.values()) if mc.flat}
# the generator's fixture packages: every table kind the product schema does not use (u64 arrays,
# lists of arrays without None, the `any` kind, optional enums, other placeholders)
FIXTURES = ("scalars", "arrays", "enums", "minors", "majors")


def test_this_install_built_the_compiled_encoder() -> None:
    # setup.py builds it as optional (an install without a C compiler still works, slower):
    # on the machines CI and the README's set-up run on, a missing build is a failure
    assert flat.AVAILABLE, "pdwire.wirecore._flatenc was not built: install gcc, then reinstall pdwire"
    assert {"TransferRequest", "TransferStatus", "Notification", "Abort", "AbortAck"} <= set(FLAT)


def _compiled(mc: envelope.MessageCodec) -> Any:
    enc = flat.encoder(mc.cls, mc.flat)
    assert enc is not None
    return enc


def _both(mc: envelope.MessageCodec, msg: Any, side: list[Any] | None) -> tuple[Any, Any]:
    """(compiled, python) results: the body and side frames, or the exception's type."""
    out = []
    for enc in (_compiled(mc), mc.to_wire):
        frames: list[Any] | None = None if side is None else []
        try:
            out.append((enc(msg, frames), frames))
        except Exception as exc:
            out.append(type(exc))
    return out[0], out[1]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return a is b  # a side frame is the caller's array itself, on both paths
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("name", sorted(FLAT))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_compiled_encoder_writes_what_the_python_encoder_writes(name: str, data: st.DataObject) -> None:
    mc = FLAT[name]
    msg = data.draw(S.STRATEGIES[NEWEST][name]())
    _assert_same_on_both_paths(mc, msg)
    assert [bytes(f) for f in w.encode(msg)] == [bytes(f) for f in envelope.encode_with(mc, msg)]


def _assert_same_on_both_paths(mc: envelope.MessageCodec, msg: Any) -> None:
    for side in ([], None):
        compiled, python = _both(mc, msg, side)
        if compiled is flat._flatenc.FlatBail:
            # only where the Python encoder takes a path the compiled one leaves to it: a large
            # array with no side list (the single-buffer form)
            assert side is None, python
            continue
        assert _same(compiled, python), (compiled, python)


def _fixture_codecs() -> list[tuple[str, Any, envelope.MessageCodec]]:
    out = []
    for case in FIXTURES:
        pkg = importlib.import_module(f"tests.codegen.{case}.expected")
        strategies = importlib.import_module(f"tests.codegen.{case}.expected.strategies").STRATEGIES
        for cls, mc in pkg.REGISTRY.by_class.items():
            if mc.flat:
                out.append((f"{case}.{cls.__name__}", strategies[mc.version][mc.name], mc))
    return out


FIXTURE_CODECS = _fixture_codecs()


def test_the_fixtures_cover_every_table_kind() -> None:
    kinds = {(e[0], e[2]) for _, _, mc in FIXTURE_CODECS for e in mc.flat or ()}
    kinds |= {(e[0], e[2]) for mc in FLAT.values() for e in mc.flat or ()}
    for kind in ("const", "int", "bool", "str", "type", "array", "array_list", "any"):
        assert (kind, False) in kinds, kind
    assert {("type", True), ("array_list", True)} <= kinds


@pytest.mark.parametrize("case", [name for name, _, _ in FIXTURE_CODECS])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_fixture_messages_encode_the_same_on_both_paths(case: str, data: st.DataObject) -> None:
    _, strategy, mc = next(x for x in FIXTURE_CODECS if x[0] == case)
    _assert_same_on_both_paths(mc, data.draw(strategy()))


def _odd_values(kind: str) -> list[Any]:
    large = np.arange(SIDE_FRAME_MIN_BYTES, dtype=np.int32)
    arrays = [
        [1, 2, 3],  # a list: the Python encoder converts it
        np.arange(6, dtype=np.int32).reshape(2, 3),  # 2-D
        np.arange(8, dtype=np.int32)[::2],  # strided, small
        np.arange(2 * SIDE_FRAME_MIN_BYTES, dtype=np.int32)[::2],  # strided, large
        large.astype(np.int64),
        large.astype(np.uint32),
        large.astype(">i4"),  # another byte order
        np.ma.masked_array(large),  # a subclass
        large,
        np.arange(3, dtype=np.int32),
        np.arange(3, dtype=np.uint64),
        np.arange(3, dtype=np.uint32),
        None,
    ]
    ints = [2**64, 2**64 - 1, 2**63, -(2**63) - 1, -1, 0, 7]
    scalars = [True, False, 1.0, np.int64(3), *ints, None, "x", b"x"]
    if kind in ("array", "array_list"):
        return [*arrays, (large,), [large, None, [1]], [None], []] if kind == "array_list" else arrays
    return [*scalars, w.Status.SUCCESS, 4, w.NotificationKind.KV, type("S", (str,), {})("s")]


@pytest.mark.parametrize("name", sorted(FLAT))
def test_an_odd_value_is_written_the_same_way_or_left_to_the_python_encoder(name: str) -> None:
    mc = FLAT[name]
    base = _minimal(name)
    checked = 0
    for kind, field, *_ in mc.flat or ():
        if field is None:
            continue
        for value in _odd_values(kind):
            msg = msgspec.structs.replace(base, **{field: value})
            for side in ([], None):
                compiled, python = _both(mc, msg, side)
                if compiled is flat._flatenc.FlatBail:
                    continue  # the registry runs the Python encoder: whatever it does is the answer
                checked += 1
                assert _same(compiled, python), (field, value, compiled, python)
    assert checked  # the common values went through the compiled encoder


def _minimal(name: str) -> Any:
    kv = np.arange(4, dtype=np.int32)
    return {
        "TransferRequest": w.TransferRequest(room=1, sender="d", dst_kv_indices=kv),
        "TransferStatus": w.TransferStatus(room=1, status=w.Status.SUCCESS, sender_rank=0),
        "Notification": w.Notification(room=1, kind=w.NotificationKind.KV),
        "Abort": w.Abort(room=1, sender="d"),
        "AbortAck": w.AbortAck(room=1),
    }[name]


def test_an_odd_value_still_gets_the_python_encoders_answer_through_the_registry() -> None:
    # an int naming an enum value: the compiled encoder leaves it, the Python one accepts it
    msg = w.TransferStatus(room=1, status=4, sender_rank=0)  # type: ignore[arg-type]
    assert w.decode(w.encode(msg)).status is w.Status.SUCCESS
    # a list for an array: converted by the Python encoder
    req = w.TransferRequest(room=1, sender="d", dst_kv_indices=[1, 2, 3])  # type: ignore[arg-type]
    assert w.decode(w.encode(req)).dst_kv_indices.tolist() == [1, 2, 3]
    # a value outside its type: named by the Python encoder
    with pytest.raises(w.EncodeError, match=r"^TransferRequest\.room: "):
        w.encode(w.TransferRequest(room=2**64, sender="d", dst_kv_indices=np.int32([1])))


def test_encoding_takes_and_gives_back_every_reference() -> None:
    mc = FLAT["TransferRequest"]
    enc = _compiled(mc)
    large = np.arange(SIDE_FRAME_MIN_BYTES, dtype=np.int32)
    small = np.arange(3, dtype=np.int32)
    ok = w.TransferRequest(room=2**63, sender="d", dst_kv_indices=large, state_indices=[small, None, large])
    # a tuple where a list goes: the compiled encoder bails after pushing dst_kv_indices, the
    # Python one iterates it
    bails = msgspec.structs.replace(ok, state_indices=(small, None, large))
    watched = (large, small, ok.sender, ok.state_indices, ok.room)
    before = [sys.getrefcount(x) for x in watched]
    for _ in range(2000):
        enc(ok, [])
        with pytest.raises(flat._flatenc.FlatBail):
            enc(ok, None)  # a large array and no side frames
        with pytest.raises(flat._flatenc.FlatBail):
            enc(bails, [])
        assert len(w.encode(bails)) == 4  # the registry: the compiled encoder bails, Python runs
    assert [sys.getrefcount(x) for x in watched] == before


_REPLACED_MID_ENCODING = """
import gc
import numpy as np
import pdwire.wire as w
from pdwire.wirecore import flat

mc = w.REGISTRY.by_class[w.TransferRequest]
enc = flat.encoder(mc.cls, mc.flat)
m = w.TransferRequest(room=1, sender="d", dst_kv_indices=np.arange(3, dtype=np.int32),
                      state_indices=[np.arange(5, dtype=np.int32) + 1 for _ in range(4)])

class Replaces:
    def __del__(self):
        m.state_indices = []  # frees the list being encoded, and its arrays, unless held

def cyclic_garbage():
    x = Replaces()
    x.self = x

side = []
keep = [[] for _ in range(200)]  # empty the list free list ...
gc.disable()
cyclic_garbage()
one = keep.pop()
del one  # ... but for one list, which the body takes: the inner PyList_New must allocate
gc.set_threshold(1)
gc.enable()
body = enc(m, side)  # the collector runs inside the encoder and the finalizer replaces the list
gc.set_threshold(700)
# read before the finalizer ran, or after it (the list then already replaced): never in between
assert m.state_indices == [] and (len(body[8]) == 4 or body[8] == []), body
print("ok")
"""


def test_a_finalizer_that_changes_the_message_mid_encoding_cannot_free_what_is_read() -> None:
    # The collector may run inside the compiled encoder's allocations, and a finalizer may
    # replace the list being encoded: the encoder holds it (an earlier build read freed memory
    # here and crashed). A fresh interpreter, so that the free lists are as the script sets them.
    run = subprocess.run(
        [sys.executable, "-c", _REPLACED_MID_ENCODING], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.returncode, run.stderr[-2000:])


def test_a_list_placeholder_is_a_fresh_list_each_time() -> None:
    enc = flat.encoder(w.Abort, [("const", None, False, [], 0, 0), ("int", "room", False, None, 0, 9)])
    assert enc is not None
    a, b = enc(w.Abort(room=1, sender="d"), []), enc(w.Abort(room=1, sender="d"), [])
    assert a == b == [[], 1] and a[0] is not b[0]


def test_the_compiled_encoder_refuses_a_table_that_does_not_fit_its_class() -> None:
    with pytest.raises(TypeError, match="nosuch"):
        flat.encoder(w.Abort, [("int", "nosuch", False, None, 0, 1)])
    with pytest.raises(TypeError, match="numpy dtype"):
        flat.encoder(w.Abort, [("array", "sender", False, None, 0, 0)])
    with pytest.raises(ValueError, match="unknown slot kind"):
        flat.encoder(w.Abort, [("float", "room", False, None, 0, 0)])
    enc = flat.encoder(w.Abort, [("int", "room", False, None, 0, 9)])
    with pytest.raises(flat._flatenc.FlatBail):
        enc(w.AbortAck(room=1), [])  # another class: its slots are elsewhere


def test_pure_python_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDWIRE_PURE_PYTHON", "1")
    assert flat.encoder(w.Abort, FLAT["Abort"].flat) is None
    monkeypatch.setenv("PDWIRE_PURE_PYTHON", "0")
    assert flat.encoder(w.Abort, FLAT["Abort"].flat) is not None
