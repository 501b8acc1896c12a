"""pdwire inside vLLM: a KV connector and a proxy (the harness that runs real engines is test
tooling: ``tests/vllm/harness.py``).

vLLM loads the connector by module path::

    kv_transfer_config = {
        "kv_connector": "PdwireConnector",
        "kv_connector_module_path": "pdwire.integrations.vllm",
        "kv_role": "kv_producer",  # or "kv_consumer"
    }

The connector is imported on first use, so importing this package needs no vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PdwireConnector"]


def __getattr__(name: str) -> Any:
    if name == "PdwireConnector":
        from pdwire.integrations.vllm.connector import PdwireConnector

        return PdwireConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
