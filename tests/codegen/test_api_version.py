"""Generated code checks the support library it runs on (Kaitai Struct's runtime-version check).

Every generated version module and codec, of either layout, calls ``pdwire.wirecore.require``
with the ``API_VERSION`` the generator read from the library when it wrote them, so a checkout
whose ``generated/`` is older or newer than ``pdwire/wirecore`` fails at import, saying to
regenerate, instead of misbehaving later.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from types import ModuleType

import pytest

from pdwire import wirecore
from tests.codegen.cases import render_case

# the generated modules that check (a package's __init__ imports its codec, which does)
CHECKING = [
    "pdwire.wire.codec",
    "pdwire.wire.v1",
    "pdwire.wire.backend_metadata.codec",
    "pdwire.wire.backend_metadata.v1",
    "pdwire.wire.sglang.codec",
    "pdwire.wire.sglang.v1_0",
    "pdwire.wire.sglang.v2_0",
    "tests.codegen.scalars.expected.codec",
    "tests.codegen.scalars.expected.v1",
    "tests.codegen.positional.expected.codec",
    "tests.codegen.positional.expected.v1_0",
    "tests.codegen.positional.expected.v2_0",
]


def _run_again(name: str) -> ModuleType:
    """Execute module ``name`` once more in a module object of its own, outside ``sys.modules``,
    so its import-time check meets the library as it is now (the imported module stays as is)."""
    importlib.import_module(name)  # its package and siblings, imported the ordinary way
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", CHECKING)
def test_a_generated_module_refuses_another_wirecore_api_version(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    generated_for = wirecore.API_VERSION
    assert _run_again(name).__name__ == name  # the library it was generated for: it imports
    for other in (generated_for + 1, generated_for - 1):
        monkeypatch.setattr(wirecore, "API_VERSION", other)
        message = (
            f"{name} was generated for pdwire.wirecore API {generated_for}, this library is API "
            f"{other}: regenerate it with `pdwire codegen`"
        )
        with pytest.raises(ImportError, match=re.escape(message)):
            _run_again(name)


@pytest.mark.parametrize(
    ("case", "modules"),
    [("scalars", {"codec.py", "v1.py"}), ("positional", {"codec.py", "v1_0.py", "v2_0.py"})],
)
def test_the_generator_writes_the_library_api_version(
    case: str, modules: set[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # one source of truth: the templates print wirecore.API_VERSION, never a number of their own
    monkeypatch.setattr(wirecore, "API_VERSION", 97)
    files = render_case(case)
    checks = {name: re.findall(r"_wc\.require\((\d+), __name__\)", text) for name, text in files.items()}
    assert {name for name, found in checks.items() if found} == modules
    assert all(found == ["97"] for name, found in checks.items() if name in modules)
