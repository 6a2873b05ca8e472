"""`hsbuild init --regenerate` refuses bad input in one line, exit 2, before anything is written: a source
without conversations (or a row that is none), a model whose tokenizer has no chat template, prompts that leave
no room to generate in the model's context (naming the rows), bad sampling flags, generation flags without
--regenerate, a backend that cannot generate."""

from __future__ import annotations

import pytest
from conftest import write_jsonl
from test_chat_source import CONV, hf, make_model

from builder.errors import UsageError
from builder.extract.backends import registry
from builder.run.create import init_build

CHAT = [{"messages": CONV}, {"conversations": [{"from": "human", "value": "Hi?"}]}]


def _refused(cli, tmp_path, *args: object, says: str | list[str]) -> str:
    build = tmp_path / "b"
    cp = cli("init", build, *args, "--allow-overcommit")
    err = cp.stderr.strip()
    assert cp.returncode == 2, (cp.stdout, err)
    assert "\n" not in err, err
    for s in [says] if isinstance(says, str) else says:
        assert s in err, err
    assert not build.exists()  # nothing written
    return err


def test_a_source_without_conversations(tmp_path, cli):
    tokens = write_jsonl(tmp_path / "tokens.jsonl", [{"input_ids": [1, 5, 6]}, {"input_ids": [1, 7]}])
    _refused(cli, tmp_path, "--source", tokens, "--regenerate",
             says=[str(tokens), "has no conversations", "--regenerate"])
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [*CHAT, {"text": "no roles"}])
    _refused(cli, tmp_path, "--source", mixed, "--regenerate",
             says=[f"{mixed}:3: field 'messages'", "conversation rows only"])
    given = write_jsonl(tmp_path / "given.jsonl", [*CHAT, {"input_ids": [1, 2, 3]}])
    _refused(cli, tmp_path, "--source", given, "--regenerate", says=[f"{given}:3: field 'input_ids'"])


def test_prompts_longer_than_the_context_are_named(tmp_path, cli):
    rows = [*CHAT, {"id": "long", "messages": [{"role": "user", "content": "x" * 80}]},
            {"id": "longer", "messages": [{"role": "user", "content": "y" * 90}]}]
    src = write_jsonl(tmp_path / "long.jsonl", rows)
    err = _refused(cli, tmp_path, "--source", src, "--model", "builtin:max_positions=100,layers=4", "--regenerate",
                   says=["2 prompt(s) leave no room to generate within 100 positions", "row 2 (id long",
                         "row 3 (id longer"])
    assert "row 0" not in err
    # --max-tokens bounds prompt and response too: below the first conversation's prompt, it is named
    _refused(cli, tmp_path, "--source", write_jsonl(tmp_path / "c.jsonl", CHAT), "--regenerate", "--max-tokens", "20",
             says=["within 20 positions", "row 0 (id 0"])


@pytest.mark.parametrize(("flags", "says"), [
    (["--temperature", "-0.5"], "--temperature -0.5: must be a number >= 0"),
    (["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p 1.5: must be in (0, 1]"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: must be an integer >= 1"),
    (["--seed", "-1"], "--seed -1: must be an integer >= 0"),
    (["--turns", "first"], "--turns 'first': use one of all, last"),
])
def test_bad_sampling_flags(tmp_path, cli, flags, says):
    _refused(cli, tmp_path, "--source", write_jsonl(tmp_path / "c.jsonl", CHAT), "--regenerate", *flags, says=says)


def test_generation_flags_without_regenerate(tmp_path, cli):
    src = write_jsonl(tmp_path / "c.jsonl", CHAT)
    for flag, value in (("--temperature", "0.7"), ("--max-new-tokens", "5"), ("--turns", "last")):
        _refused(cli, tmp_path, "--source", src, flag, value, says=[flag, "only for a regenerating build (--regenerate)"])
    _refused(cli, tmp_path, "--source", src, "--drop-truncated", says="--drop-truncated: only for a regenerating build")


def test_a_backend_that_cannot_generate(tmp_path):
    """(Registered in this process only, and removed after: a backend whose spec says it does not generate.)"""
    src = write_jsonl(tmp_path / "c.jsonl", CHAT)
    spec = registry.register(registry.BackendSpec(name="nogen-test", summary="a test's", open=lambda s, r: None))
    try:
        with pytest.raises(UsageError) as e:
            init_build(tmp_path / "b", src, backend="nogen-test", regenerate=True)
        assert str(e.value).startswith("--regenerate: backend nogen-test cannot generate; use --backend ")
        assert "inprocess" in str(e.value)
        assert not (tmp_path / "b").exists()
    finally:
        registry._SPECS.pop(spec.name, None)


@hf
def test_a_model_without_a_chat_template(tmp_path, cli):
    model = make_model(tmp_path / "none", None)
    _refused(cli, tmp_path, "--source", write_jsonl(tmp_path / "c.jsonl", CHAT), "--model", model, "--regenerate",
             says=["--regenerate: the tokenizer of --model", "has no chat template"])


def test_no_import_into_a_regenerating_build(tmp_path, cli):
    """A regenerating build's responses are generated: a dump's states cannot be imported into it."""
    cp = cli("init", tmp_path / "b", "--source", write_jsonl(tmp_path / "c.jsonl", CHAT), "--regenerate",
             "--allow-overcommit")
    assert cp.returncode == 0, cp.stderr
    (tmp_path / "dump").mkdir()
    cp = cli("import", tmp_path / "b", tmp_path / "dump", "--format", "pt")
    assert cp.returncode == 2 and "is a regenerating build" in cp.stderr and "\n" not in cp.stderr.strip()
