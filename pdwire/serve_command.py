"""``pdwire serve`` as the console runs it: :mod:`pdwire.serve.cli` with what the demo brings
registered, its hybrid model as memory model ``demo`` and its backend ``mori-fake``.

Serve knows no model, and the demo depends on serve (``pdwire demo --serve`` drives serve
processes); the command layer, above both, joins them. The model is imported only when a serve
process opens it, so ``pdwire serve --help`` stays free of torch.
"""

from __future__ import annotations

from typing import Any

from pdwire.demo import register_mori_fake
from pdwire.serve.cli import register as _register_serve
from pdwire.serve.config import MemorySettings
from pdwire.serve.memory import ServeMemory, register_memory_model


def _demo_model(settings: MemorySettings) -> ServeMemory:
    from pdwire.demo.serve_model import DemoServeMemory

    return DemoServeMemory.of(settings)


def register(subparsers: Any) -> None:
    register_memory_model("demo", _demo_model)
    register_mori_fake()
    _register_serve(subparsers)
