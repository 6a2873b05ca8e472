"""The module path vLLM is told to load hsbuild's connector from (`kv_connector_module_path` in the
`--kv-transfer-config` that `serve-command` prints) loads it through vLLM's own loader, and so does the path older
lines named (builder.extract.backends.vllm_connector, a deprecated alias): a server started from either gets the
same connector class. No server is started: vLLM's KVConnectorFactory resolves the class as the server does."""

from __future__ import annotations

import json
import shlex

from conftest import random_rows, write_jsonl
from vllm_fixture import needs_vllm

from builder.run.create import init_build


@needs_vllm
def test_the_printed_connector_path_and_the_old_one_load_the_same_connector(tmp_path, tiny_llama, cli):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    src = write_jsonl(tmp_path / "src.jsonl", random_rows(2, vocab=512))
    build = init_build(tmp_path / "b", src, model=str(tiny_llama), backend="vllm", server="http://127.0.0.1:8000",
                       staging=str(tmp_path)).root
    argv = shlex.split(cli("serve-command", build, check=True).stdout)
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_module_path"] == "builder.extract.backends.vllm.connector", kv
    printed = KVConnectorFactory.get_connector_class(KVTransferConfig(**kv))
    old = KVConnectorFactory.get_connector_class(
        KVTransferConfig(**{**kv, "kv_connector_module_path": "builder.extract.backends.vllm_connector"}))
    assert printed is old and printed.__name__ == kv["kv_connector"] == "CpuHiddenStatesConnector"
