"""Moved to :mod:`pdwire.protocols.sglang.convert`; the old name stays importable for existing code.

Nothing generated imports it (see :mod:`pdwire.wirecore`): new code imports the new path.
"""

from __future__ import annotations

from typing import Any

import pdwire.protocols.sglang.convert as _moved


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
