"""A stand-in for torchvision, for the SGLang tests only (never installed).

PyPI's torchvision is built against a CUDA torch and fails to load beside the CPU build
``torch==2.13.0`` ("operator torchvision::nms does not exist"). SGLang and transformers import
it at module level for image processing, which the transfer backend never touches. Every name
resolves; calling anything raises NotImplementedError naming it, so a test that reached image
code would fail loudly instead of passing on a fake.
"""

import importlib
from types import ModuleType
from typing import Any

__version__ = "0.28.0+stub"  # transformers parses it (torch 2.13 pairs with torchvision 0.28)

_SUBMODULES = {"io", "ops", "models", "transforms", "utils"}


def unavailable(qualname: str) -> Any:
    def fn(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{qualname} is not available: torchvision is a test stub here")

    fn.__name__ = qualname.rsplit(".", 1)[-1]
    fn.__qualname__ = qualname
    return fn


def stub_getattr(module: str, submodules: set[str] = frozenset()) -> Any:  # type: ignore[assignment]
    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in submodules:
            return importlib.import_module(f"{module}.{name}")
        return unavailable(f"{module}.{name}")

    return __getattr__


__getattr__ = stub_getattr("torchvision", _SUBMODULES)


def _leaf(name: str) -> ModuleType:
    mod = ModuleType(f"torchvision.{name}")
    mod.__getattr__ = stub_getattr(f"torchvision.{name}")  # type: ignore[method-assign]
    return mod


for _name in ("io", "ops", "models", "utils"):
    import sys

    sys.modules.setdefault(f"torchvision.{_name}", _leaf(_name))
