"""Deprecated: the old path of hsbuild's KV connectors for vLLM, now builder/extract/backends/vllm/connector.py.

Servers started with a command line that `hsbuild serve-command` printed before (`"kv_connector_module_path":
"builder.extract.backends.vllm_connector"` in --kv-transfer-config) still load the same connectors from here.
Loaded by the server, never by hsbuild; it imports vLLM.
"""

from builder.extract.backends.vllm.connector import (  # noqa: F401 - re-exported for vLLM's loader
    CpuHiddenStatesConnector,
    HsbuildHiddenStatesConnector,
)
