"""Freeze golden vectors for every released version: ``python -m tests.golden.freeze``.

Writes ``tests/golden/<protocol>/<version>/<Message>.bin`` (the frames, concatenated) and a
readable ``.json`` twin (frame lengths and the decoded value). Existing files are never
overwritten: a released version's bytes are frozen forever.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

import pdwire.wire as w
from pdwire.codegen.loader import load_file
from pdwire.codegen.model import Message, Protocol, TypeRef, Version, format_version

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def example(p: Protocol, t: TypeRef, module: Any, v: Version, seed: int, top: bool, index: int = 0) -> Any:
    """A deterministic, readable value of type ``t`` at version ``v``."""
    if t.kind == "scalar":
        return True if t.name == "bool" else (-seed if t.name.startswith("i") else seed * 3 + 1)
    if t.kind == "str":
        return f"s{seed}"
    if t.kind in ("bytes", "blob"):
        return f"blob{seed}".encode()
    if t.kind == "array":
        n = 300 if top and t.name == "i32" else 4  # 300 x i32 travels as a side frame
        return np.arange(seed, seed + n, dtype={"i32": np.int32, "u32": np.uint32, "u64": np.uint64}[t.name])
    if t.kind == "enum":
        return getattr(module, t.name)(p.enums[t.name].values_at(v)[-1].number)
    if t.kind == "optional":
        assert t.elem is not None
        return None if index % 2 else example(p, t.elem, module, v, seed, top)
    if t.kind == "list":
        assert t.elem is not None
        return [example(p, t.elem, module, v, seed + i, top, i) for i in range(2)]
    return build(p, p.messages[t.name], module, v, seed, top=False)


def build(p: Protocol, m: Message, module: Any, v: Version, seed: int = 1, top: bool = True) -> Any:
    """A message of version ``v`` in the model of its major (``module``)."""
    cls = getattr(module, m.name)
    fields = m.fields_at(v)
    legacy = [f.name for f in fields if f.name not in cls.__struct_fields__]
    if legacy:  # a minor whose fields the model no longer has was frozen when it was the newest
        raise SystemExit(
            f"{m.name} {format_version(v)}: {legacy} are not in the model any more; keep its goldens"
        )
    return cls(**{f.name: example(p, f.type, module, v, seed + f.id, top) for f in fields})


def to_json(msg: Any) -> Any:
    return msgspec.to_builtins(msg, enc_hook=lambda x: x.tolist() if isinstance(x, np.ndarray) else x)


def _compact(text: str) -> str:
    """Keep number lists on one line so the twin stays readable."""
    return re.sub(r"\[\s*([-\d,\s]+?)\s*\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)


def freeze(force: bool = False) -> list[Path]:
    p = load_file(REPO / "schema" / "pdwire.yaml")
    written = []
    for v in p.version_list:
        module = getattr(w, f"v{v[0]}")
        folder = HERE / p.name / format_version(v)
        folder.mkdir(parents=True, exist_ok=True)
        for m in p.messages_at(v):
            if m.type_id is None:
                continue
            bin_path, json_path = folder / f"{m.name}.bin", folder / f"{m.name}.json"
            if bin_path.exists() and not force:
                continue
            msg = build(p, m, module, v)
            frames = [bytes(f) for f in w.encode(msg, v)]
            bin_path.write_bytes(b"".join(frames))
            twin = {
                "protocol": p.name,
                "version": format_version(v),
                "message": m.name,
                "type_id": m.type_id,
                "frames": [len(f) for f in frames],
                "value": to_json(msg),
            }
            json_path.write_text(_compact(json.dumps(twin, indent=1)) + "\n")
            written += [bin_path, json_path]
    return written


if __name__ == "__main__":
    for path in freeze(force="--force" in sys.argv):
        print(f"wrote {path.relative_to(REPO)}")
