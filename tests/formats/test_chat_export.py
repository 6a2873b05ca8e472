"""`hsbuild export BUILD OUT --format chat` (issue 43, point 6): the build's conversations as JSONL, the assistant
turns decoded from the stored tokens and loss mask, the other messages the source row's; resumable as every export
(a kill -9, then the same command: a fresh export's files); a sample whose source row is gone or changed is named
and left out (exit 1), never guessed; a build whose source holds no conversation is refused whole (exit 2).

Real parts: a tiny Hugging Face Llama with a chat template (tests/extract/test_chat_source.py makes it), a real
build and run, the real CLI (in a subprocess where it is killed)."""

from __future__ import annotations

import json
import shutil
import signal
import sys
from pathlib import Path

import forked
import pytest
from conftest import ROOMY, hsbuild, random_rows, write_jsonl
from test_export_reconcile import KILL_AT_RENAME, assert_same_tree, journal

from builder.config import BuildConfig
from builder.errors import FormatError
from builder.extract.chat import normalize
from builder.formats.base import Rejected
from builder.formats.build_info import BuildInfo
from builder.formats.chat import place, spans
from builder.layout import layout
from builder.log.events import EventLog
from builder.reader import HiddenStateDataset
from builder.run.coordinator import RunOptions, run_build
from builder.run.create import init_build

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "extract"))
from test_chat_source import CONV, SHAREGPT, TEMPLATE_GEN, hf, make_model  # noqa: E402

WORDS = "hello there how are you today fine thank asking answer six times seven tokens joke bar splits".split()


def conversations(n: int) -> list[dict]:
    """`n` conversation rows: OpenAI and ShareGPT, one to three assistant turns, one ending on a user turn, one
    with text beyond ASCII."""
    rows = [{"id": "c00", "messages": CONV}, {"id": "c01", "conversations": SHAREGPT[1:3]},
            {"id": "c02", "messages": CONV[:4]},  # ends on the user's turn
            {"id": "c03", "messages": [CONV[1], {"role": "assistant", "content": "Café ✓ naïve — 42!"}]}]
    for i in range(len(rows), n):
        turns = [{"role": "system", "content": "You are a helpful assistant."}] if i % 2 else []
        for t in range(1 + i % 3):
            say = " ".join(WORDS[(i * 7 + t * 3 + k) % len(WORDS)] for k in range(3 + (i + t) % 5))
            turns += [{"role": "user", "content": say.capitalize() + "?"},
                      {"role": "assistant", "content": f"Reply {i}.{t}: {say}."}]
        rows.append({"id": f"c{i:02d}", "messages": turns})
    return rows


def expected_lines(rows: list[dict]) -> list[dict]:
    """What chat.jsonl must hold for an ordinary build of these rows: each row's id and its conversation (OpenAI
    form), exactly: the assistant turns decoded from the stored tokens equal the source's text."""
    out = []
    for r in rows:
        column = "messages" if "messages" in r else "conversations"
        out.append({"id": r["id"], "messages": normalize(column, r[column])})
    return out


def read_lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "chat.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny HF Llama whose template marks the assistant's text ({% generation %})."""
    return make_model(tmp_path_factory.mktemp("chat-model") / "model", TEMPLATE_GEN, weights=True)


@pytest.fixture(scope="module")
def chat_build(tmp_path_factory, tiny_model) -> tuple[Path, list[dict]]:
    """An ordinary build of 12 conversations with the tiny HF Llama, run to the end."""
    root = tmp_path_factory.mktemp("chat-build")
    model = tiny_model
    rows = conversations(12)
    src = write_jsonl(root / "chats.jsonl", rows)
    build = init_build(root / "b", src, model=str(model), watermarks=ROOMY).root
    assert run_build(build, RunOptions(device="cpu", workers=1, allow_overcommit=True),
                     echo=lambda *a, **k: None).exit_code == 0
    return build, rows


def export(build: Path, out: Path, *flags: str) -> tuple[int, dict | None, str, str]:
    cp = hsbuild("export", build, out, "--format", "chat", "--no-progress", *flags)
    assert "Traceback" not in cp.stderr, cp.stderr
    rep = json.loads(cp.stdout) if "--json" in flags and cp.stdout.strip() else None
    return cp.returncode, rep, cp.stdout, cp.stderr


@hf
def test_a_conversation_build_exports_its_conversations_exactly(chat_build, tmp_path):
    build, rows = chat_build
    out = tmp_path / "out"
    rc, _, stdout, stderr = export(build, out)
    assert rc == 0, stderr
    assert f"(chat) into {out}: 12 sample(s) in it; 12 added" in stdout, stdout
    assert "aux layers" not in stdout and "files: chat.jsonl" in stdout, stdout
    got = read_lines(out)
    assert got == expected_lines(rows)  # ids, every message, in the build's order; no field invented
    assert got[3]["messages"][1]["content"] == "Café ✓ naïve — 42!"
    assert "\\u" not in (out / "chat.jsonl").read_text()  # UTF-8 as written, not escaped
    # line i is row i, whose own file holds it
    assert [journal(out)["files"][r["id"]][0] for r in rows] == [f"rows/00000/{i:08d}.json" for i in range(12)]
    assert [json.loads((out / f"rows/00000/{i:08d}.json").read_text()) for i in range(12)] == got

    # run again: everything kept, nothing rewritten, the same bytes
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "hsbuild-export.json"}
    rc, rep, _, stderr = export(build, out, "--json")
    assert rc == 0, stderr
    assert rep["already"] == 12 and rep["exported"] == 0 and rep["complete"], rep
    assert rep["final_state"] == "" and rep["layer_ids"] == [] and rep["files"] == ["chat.jsonl"]
    assert {p: p.read_bytes() for p in before} == before

    # not a trainer's format: no dataset of it, not among the trainers a build feeds
    with pytest.raises(FormatError, match=r"^format chat: use one of specforge, speculators, modelopt$"):
        HiddenStateDataset(build, format="chat")
    assert "chat" not in BuildInfo.load(layout(build)).feeds()[1]


@hf
@pytest.mark.claim("crash")
def test_kill_9_mid_export_then_rerun_gives_a_fresh_exports_files(chat_build, tmp_path):
    build, _ = chat_build
    fresh = tmp_path / "fresh"
    assert export(build, fresh)[0] == 0

    def kill_at(k: int, out: Path):
        return forked.run([sys.executable, "-c", KILL_AT_RENAME, str(k), "export", str(build), str(out),
                           "--format", "chat", "--no-progress"], capture_output=True, text=True, timeout=300)

    cp = kill_at(0, tmp_path / "probe")  # counts the renames of an uninterrupted export
    assert cp.returncode == 0, cp.stderr
    renames = int(cp.stdout.split()[-1])
    assert renames >= 12 + 2, renames  # a file a row, chat.jsonl, the journal's saves
    for k in sorted({2, renames // 2, renames - 1}):
        work = tmp_path / f"at{k}"
        cp = kill_at(k, work)
        assert cp.returncode == -signal.SIGKILL, f"rename {k}: exit {cp.returncode}\n{cp.stderr}"
        assert journal(work)["finished"] is False
        rc, rep, _, stderr = export(build, work, "--json")
        assert rc == 0 and rep["complete"], stderr
        assert rep["already"] + rep["exported"] == 12, rep
        assert_same_tree(work, fresh, f"killed after rename {k} of {renames}")
        shutil.rmtree(work)


@hf
def test_a_changed_or_removed_source_row_is_named_and_left_out(chat_build, tmp_path):
    build, rows = chat_build
    src = Path(BuildConfig.from_toml(layout(build).config).source)
    original = src.read_bytes()
    out = tmp_path / "out"
    assert export(build, out)[0] == 0
    try:
        edited = [dict(r) for r in rows]
        edited[5] = {**rows[5], "messages": [dict(m) for m in rows[5]["messages"]]}
        edited[5]["messages"][-2]["content"] += " Edited."  # a user's words changed: not the conversation stored
        edited[7] = {"id": rows[7]["id"], "text": "now a text row"}  # no longer a conversation
        del edited[9]  # gone
        write_jsonl(src, edited)
        rc, rep, _, stderr = export(build, out, "--json")
        assert rc == 1, stderr
        left = {d["sample_id"]: d for d in rep["not_exported"]}
        assert {s: d["reason"] for s, d in left.items()} == {"c05": "source_changed", "c07": "not_a_conversation",
                                                             "c09": "source_gone"}, left
        assert all(d["state"] == "refused" for d in left.values())
        assert "changed since the build stored it" in left["c05"]["message"]
        assert "--accept-source-changes" in left["c09"]["message"]
        want = [line for line in expected_lines(rows) if line["id"] not in left]
        assert read_lines(out) == want and rep["removed"] == sorted(left)  # their lines and files left
        fresh = tmp_path / "fresh"
        assert export(build, fresh)[0] == 1
        assert_same_tree(out, fresh, "after the source changed")  # what a fresh export of this state holds

        cp = hsbuild("export", build, tmp_path / "text-out", "--format", "chat", "--no-progress")
        assert cp.returncode == 1
        assert "3 selected sample(s) NOT in the export" in cp.stderr and "c05" in cp.stderr, cp.stderr
        assert "extract them:" not in cp.stderr  # each message says what to do: nothing is left to extract

        edited[7] = {"id": rows[7]["id"], "messages": [{"role": "user", "content": "Other?"},
                                                       {"role": "assistant", "content": "Other."}]}
        write_jsonl(src, edited)  # a conversation again, but not the one stored
        rc, rep, _, _ = export(build, out, "--json")
        assert rc == 1 and {d["sample_id"]: d["reason"] for d in rep["not_exported"]}["c07"] == "source_changed"
    finally:
        src.write_bytes(original)
    rc, rep, _, stderr = export(build, out, "--json")  # the source restored: all of it again
    assert rc == 0 and rep["complete"] and sorted(rep["added"]) == ["c05", "c07", "c09"], stderr
    assert read_lines(out) == expected_lines(rows)


@hf
def test_a_sample_cut_by_max_tokens_is_named_and_left_out(tmp_path, tiny_model):
    rows = conversations(6)
    src = write_jsonl(tmp_path / "chats.jsonl", rows)
    build = init_build(tmp_path / "b", src, model=str(tiny_model), watermarks=ROOMY, max_tokens=40).root
    assert run_build(build, RunOptions(device="cpu", workers=1, allow_overcommit=True),
                     echo=lambda *a, **k: None).exit_code == 0
    with EventLog(layout(build).events, read_only=True) as log:
        cut = sorted(r["sample_id"] for r in log.query_dicts("SELECT sample_id FROM samples WHERE num_tokens < "
                                                              "source_tokens"))
    assert 0 < len(cut) < len(rows), cut
    rc, rep, _, stderr = export(build, tmp_path / "out", "--json")
    assert rc == 1, stderr
    assert {d["sample_id"]: d["reason"] for d in rep["not_exported"]} == dict.fromkeys(cut, "truncated")
    assert "--max-tokens" in rep["not_exported"][0]["message"]
    assert read_lines(tmp_path / "out") == [line for line in expected_lines(rows) if line["id"] not in cut]


def test_a_build_without_conversations_is_refused_in_one_line(tmp_path):
    rows = random_rows(3, seed=2, hi=20) + [{"id": "t0", "text": "plain text, no conversation"}]
    src = write_jsonl(tmp_path / "src.jsonl", rows)
    build = init_build(tmp_path / "b", src, model="builtin:hidden=64,layers=4,vocab=1024,heads=2,kv_heads=1,"
                       "intermediate=128", watermarks=ROOMY).root
    assert run_build(build, RunOptions(workers=1), echo=lambda m: None).written == 4
    out = tmp_path / "out"
    cp = hsbuild("export", build, out, "--format", "chat", "--no-progress")
    assert cp.returncode == 2, cp.stdout + cp.stderr
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1 and "holds no conversations" in lines[0] and "--format chat" in lines[0], cp.stderr
    assert not out.exists()  # nothing written


# -- where the runs of the stored mask go (a regenerated build's --turns, the build's metadata) ----------------

MSGS = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1", "tool_calls": [{"id": "x"}]}, {"role": "user", "content": "U2"},
        {"role": "assistant", "content": "A2"}]


def test_runs_of_the_loss_mask_are_the_assistant_turns():
    assert spans([5, 6, 7, 8, 9, 10, 11], [0, 1, 1, 0, 1, 0, 1]) == [[6, 7], [9], [11]]
    assert spans([5, 6], [0, 0]) == []


def test_turns_are_put_in_place_or_refused():
    # an ordinary build: the decoded text in each assistant turn, its other keys kept
    got = place(MSGS, ["a1", "a2"], regenerated=False, turns=None)
    assert got[2] == {"role": "assistant", "content": "a1", "tool_calls": [{"id": "x"}]} and got[4]["content"] == "a2"
    assert MSGS[2]["content"] == "A1"  # (the source's messages are not changed)
    with pytest.raises(Rejected, match="holds 1 assistant run.* 2 assistant turn"):
        place(MSGS, ["a"], regenerated=False, turns=None)
    # regenerated, --turns all: each turn the model's alone (the source's tool_calls are not its)
    got = place(MSGS, ["g1", "g2"], regenerated=True, turns="all")
    assert got[2] == {"role": "assistant", "content": "g1"} and got[4] == {"role": "assistant", "content": "g2"}
    got = place(MSGS[:4], ["g1", "g2"], regenerated=True, turns="all")  # ended on the user: the reply appended
    assert [m["role"] for m in got] == ["system", "user", "assistant", "user", "assistant"]
    assert got[-1]["content"] == "g2"
    for msgs, texts in ((MSGS, ["g1", "g2", "g3"]), (MSGS, ["g1"]), (MSGS[:4], ["g1"])):
        with pytest.raises(Rejected, match="--turns all"):  # (ended on the user: its reply is one of the runs)
            place(msgs, texts, regenerated=True, turns="all")
    # regenerated, --turns last: only the final turn, replaced, or appended after a final user turn
    got = place(MSGS, ["g"], regenerated=True, turns="last")
    assert got[:4] == MSGS[:4] and got[4] == {"role": "assistant", "content": "g"}
    got = place(MSGS[:4], ["g"], regenerated=True, turns="last")
    assert got[:4] == MSGS[:4] and got[4] == {"role": "assistant", "content": "g"}
    with pytest.raises(Rejected, match="2 assistant run.*--turns last"):
        place(MSGS, ["g1", "g2"], regenerated=True, turns="last")


# -- a regenerated build (i43-regen's `init --regenerate`) ----------------------------------------------------

def _regenerates() -> bool:
    import inspect  # noqa: PLC0415

    return "regenerate" in inspect.signature(init_build).parameters


@hf
@pytest.mark.skipif(not _regenerates(), reason="waits for the merge of i43-regen (`init --regenerate`: "
                                               "init_build's regenerate=, turns=, max_new_tokens=)")
@pytest.mark.parametrize("turns", ["all", "last"])
def test_a_regenerated_build_exports_the_models_turns(tmp_path, turns):
    import transformers  # noqa: PLC0415

    model = make_model(tmp_path / "model", TEMPLATE_GEN, weights=True)
    rows = [{"id": "r0", "messages": CONV}, {"id": "r1", "messages": CONV[:4]},  # the second ends on the user
            {"id": "r2", "conversations": SHAREGPT[1:3]}]
    src = write_jsonl(tmp_path / "chats.jsonl", rows)
    build = init_build(tmp_path / "b", src, model=str(model), watermarks=ROOMY, regenerate=True, max_new_tokens=6,
                       turns=turns).root
    assert run_build(build, RunOptions(device="cpu", workers=1, allow_overcommit=True),
                     echo=lambda *a, **k: None).exit_code == 0
    out = tmp_path / "out"
    rc, rep, _, stderr = export(build, out, "--json")
    assert rc == 0 and rep["complete"], stderr
    tok = transformers.AutoTokenizer.from_pretrained(str(model))
    stored = {it["sample_id"]: it for it in HiddenStateDataset(build)}
    with EventLog(layout(build).events, read_only=True) as log:
        detail = {r["sample_id"]: json.loads(r["detail"]) for r in log.query_dicts(
            "SELECT sample_id, detail FROM events WHERE kind = 'written'")}
    for line, row in zip(read_lines(out), rows, strict=True):
        sid = row["id"]
        source = expected_lines([row])[0]["messages"]
        ids, mask = stored[sid]["input_ids"].tolist(), stored[sid]["loss_mask"].tolist()
        runs = [tok.decode(r, skip_special_tokens=True, clean_up_tokenization_spaces=False) for r in spans(ids, mask)]
        asst = [i for i, m in enumerate(source) if m["role"] == "assistant"]
        slots = asst + ([] if source[-1]["role"] == "assistant" else [len(source)])
        slots = slots[-1:] if turns == "last" else slots
        assert len(runs) == len(slots), (sid, runs)
        want = [dict(m) for m in source]
        for i, text in sorted(zip(slots, runs, strict=True), reverse=True):
            if i == len(want):
                want.append({"role": "assistant", "content": text})
            else:
                want[i] = {"role": "assistant", "content": text}
        assert line == {"id": sid, "messages": want, "finish_reason": detail[sid]["finish_reason"],
                        "generated": detail[sid]["generated"]}, sid
        assert line["finish_reason"] in ("stop", "length")
        # the other messages are the source's, untouched
        assert [m for i, m in enumerate(line["messages"]) if i not in slots] == \
            [m for i, m in enumerate(source) if i not in slots]
