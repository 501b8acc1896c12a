"""pdwire inside vLLM: a KV connector, a proxy, and a harness that runs real engines.

vLLM loads the connector by module path::

    kv_transfer_config = {
        "kv_connector": "PdwireConnector",
        "kv_connector_module_path": "pdwire.integrations.vllm",
        "kv_role": "kv_producer",  # or "kv_consumer"
    }

The connector is imported on first use, so ``pdwire.integrations.vllm.harness`` and
``.tiny_models`` import without vLLM's engine code (they need vLLM only in the engine
processes they start).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PdwireConnector"]


def __getattr__(name: str) -> Any:
    if name == "PdwireConnector":
        from pdwire.integrations.vllm.connector import PdwireConnector

        return PdwireConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
