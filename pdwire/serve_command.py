"""``pdwire serve`` as the console runs it: the runtime's serve command
(:mod:`pdwire.runtime.serve.cli`) with the memory models this distribution ships registered.

The runtime knows no model; the demo's hybrid model is registered here, at the command layer,
as ``demo`` (imported only when a serve process opens it, so ``pdwire serve --help`` stays
free of torch).
"""

from __future__ import annotations

from typing import Any

from pdwire.runtime.serve.cli import register as _register_serve
from pdwire.runtime.serve.config import MemorySettings
from pdwire.runtime.serve.memory import ServeMemory, register_memory_model


def _demo_model(settings: MemorySettings) -> ServeMemory:
    from pdwire.runtime.demo.serve_model import DemoServeMemory

    return DemoServeMemory(settings)


def register(subparsers: Any) -> None:
    register_memory_model("demo", _demo_model)
    _register_serve(subparsers)
