"""The vLLM server command `serve-command` prints and `run --launch` starts (no server needed): on a CPU build of
vLLM it starts without the torch.compile warm-up (-O0) unless the build's engine_args choose a level or a
compilation config themselves; a GPU server keeps vLLM's default level. (A CPU server started from the printed
line: tests/engines/test_vllm_identity.py.)"""

from __future__ import annotations

import pytest

from builder.extract.backends.vllm.command import EngineSpec, serve_command


def _cmd(cpu: bool, *engine_args: str) -> list[str]:
    return serve_command(EngineSpec(model="/m", server="http://127.0.0.1:8000", staging="/s", layer_ids=[1, 2, 4],
                                    dtype="bfloat16", engine_args=engine_args, cpu=cpu))


def test_a_cpu_server_starts_without_the_compile_warm_up():
    cmd = _cmd(True, "--max-model-len", "2048")
    assert cmd.count("-O0") == 1 and cmd[-2:] == ["--max-model-len", "2048"], cmd
    assert "-O0" not in _cmd(False, "--max-model-len", "2048")  # a GPU server: vLLM's own default


@pytest.mark.parametrize("own", [["-O3"], ["-O", "2"], ["-O=1"], ["--optimization-level", "2"],
                                 ["--optimization-level=2"], ["-cc", '{"mode": 3}'],
                                 ["--compilation-config", '{"mode": 3}']])
def test_engine_args_that_choose_a_level_or_a_compilation_config_keep_it(own):
    cmd = _cmd(True, *own)
    assert "-O0" not in cmd and cmd[-len(own):] == own, cmd


def test_a_server_started_with_the_old_connector_path_passes_the_identity_check():
    """Servers started from an older `serve-command` line name the connector's old module path
    (builder.extract.backends.vllm_connector, kept as an alias): their command line is the build's all the same."""
    from builder.extract.backends.vllm.command import CONNECTOR_MODULE, OLD_CONNECTOR_MODULE
    from builder.extract.backends.vllm.identity import Expected, config_problems, parse_cmdline

    argv = _cmd(True)
    i = argv.index("--kv-transfer-config") + 1
    assert f'"kv_connector_module_path":"{CONNECTOR_MODULE}"' in argv[i]
    want = Expected(model="/m", layer_ids=[1, 2, 4], staging="/s", dtype="bfloat16")
    for module in (CONNECTOR_MODULE, OLD_CONNECTOR_MODULE):
        old = [*argv[:i], argv[i].replace(CONNECTOR_MODULE, module), *argv[i + 1:]]
        conf = parse_cmdline(1, old)
        assert conf is not None and conf.connector_module == module and config_problems(conf, want) == []
