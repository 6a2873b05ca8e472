"""`hsbuild export BUILD OUT --format chat`: the build's conversations as JSONL, one line a sample, OpenAI style:
`{"id": ..., "messages": [{"role": ..., "content": ...}, ...]}`, plus, for a regenerated build (`init
--regenerate`), `finish_reason` and `generated` from the sample's `written` event (absent otherwise).

Where the text comes from: the assistant turns are decoded from the stored sample (its tokens and loss mask: each
run of mask-1 tokens is one assistant turn, decoded with the build's tokenizer, special tokens skipped), so they
are what the draft trains on: the source's own turns in an ordinary build, the target model's in a regenerated
one. The other messages (system, user, tool) are the source row's, read from the build's source, which must
still hold the row the build stored: the fingerprint of its tokens (tokenized as `init` does) is the log's.

The turns are put in place of the source's assistant turns, in order (`turn_slots`): an ordinary build's runs
are its assistant turns (or those with text, where the template masks no token of an empty one); a regenerated
build's are the turns the regeneration generated: every assistant turn, and one appended when the conversation
ends on another role (`--turns last`: the final of these only). Where the runs and the turns cannot be matched so, or the source row is
gone, changed, or not a conversation, or the stored tokens were cut short by `--max-tokens`, the sample is not
exported: it is named in the report with its reason (exit 1), as a damaged sample is, and never guessed. A
build whose source holds no conversation at all is refused whole (exit 2, nothing written).

Files: `chat.jsonl` (every exported row, in export order: row i is line i) and, what a re-run keeps and joins
it from, one file a row `rows/{i // 1000:05d}/{i:08d}.json` holding that row's line.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

from builder.errors import FormatError
from builder.formats.base import BuildView, DocRow, Exported, Rejected, Sample, SourceRow, TrainerFormat

JSONL = "chat.jsonl"
ROWS = "rows"
ROW_FILE = re.compile(r"\d{8}\.json")
GROUP = 1000
ANSWERED = ("assistant",)


def spans(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The runs of loss-mask-1 tokens, in order: one assistant turn each."""
    runs: list[list[int]] = []
    cur: list[int] = []
    for t, m in zip(ids, mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def regeneration(meta: dict) -> tuple[bool, str | None]:
    """(whether the build was made with `init --regenerate`, its `--turns`: "all" | "last"), from its metadata
    (the contract of issue 43: meta `regenerate` true and the settings beside it)."""
    if meta.get("regenerate") is not True:
        return False, None
    turns = meta.get("turns")
    return True, (str(turns) if turns is not None else None)


def turn_slots(messages: list[dict], regenerated: bool, turns: str | None, runs: int) -> list[int] | None:
    """Where the `runs` decoded turns go, in order: positions in `messages` (len(messages): appended), or None
    where they cannot be matched. A regenerated build's turns are its assistant messages and, when the
    conversation ends on another role, one appended (`--turns last`: the final of these only), as the
    regeneration chose them (builder/extract/prompts.py `targets`). An ordinary build's are its assistant
    messages, or those with text where the template masks no token of an empty one."""
    asst = [i for i, m in enumerate(messages) if m["role"] in ANSWERED]
    if regenerated:
        slots = asst + ([] if messages and messages[-1]["role"] in ANSWERED else [len(messages)])
        slots = slots[-1:] if turns == "last" else slots
        return slots if runs == len(slots) else None
    if runs == len(asst):
        return asst
    with_text = [i for i in asst if messages[i].get("content")]
    return with_text if runs == len(with_text) else None


def place(messages: list[dict], texts: list[str], regenerated: bool, turns: str | None) -> list[dict]:
    """The conversation with its assistant turns' text replaced by `texts` (see `turn_slots`); a regenerated
    turn is the model's text alone (the source's tool calls are not its), an ordinary build's keeps its other
    keys. Raises Rejected where they cannot be matched."""
    slots = turn_slots(messages, regenerated, turns, len(texts))
    if slots is None:
        asst = sum(m["role"] in ANSWERED for m in messages)
        what = f"a build regenerated with --turns {turns}" if regenerated else "an ordinary build"
        raise Rejected("turns_mismatch", f"its stored loss mask holds {len(texts)} assistant run(s) but its "
                                         f"source conversation has {asst} assistant turn(s) ({what}); they "
                                         "cannot be matched")
    out = [dict(m) for m in messages]
    for i, text in sorted(zip(slots, texts, strict=True), reverse=True):
        turn = {"role": "assistant", "content": text} if regenerated else {**out[i], "content": text}
        if i == len(out):
            out.append(turn)
        else:
            out[i] = turn
    return out


class Chat(TrainerFormat):
    name = "chat"
    summary = "chat.jsonl: the conversations, assistant turns decoded from the stored tokens"
    exports = True
    imports = False
    states = False
    final_state = "post_norm"  # (asked of no build: it holds no states)
    layer_convention = "hf_hidden_states"
    doc = DocRow(trainer="none: the build's conversations as text, for reading, filtering or a generation "
                         "step (text only: `init` lists no trainer for it)",
                 files="`chat.jsonl` (line i = row i), joined from `rows/{i//1000:05d}/{i:08d}.json` (one line "
                       "each, what a re-run keeps)",
                 tensors="none: a line is `id`, `messages` (OpenAI roles; the assistant turns decoded from the "
                         "stored tokens' loss-mask runs, the others the source row's) and, for a regenerated "
                         "build, `finish_reason` and `generated`",
                 numbering="none", final_state="none (no states)", yields="none (no `HiddenStateDataset(format=)`)",
                 vocab="none")

    def __init__(self, **options: object):
        super().__init__(**options)
        self._build: BuildView | None = None
        self._messages: dict[str, str] = {}  # sample id -> its source messages (JSON): what the row holds
        self._written: dict[str, dict] = {}
        self._regen: tuple[bool, str | None] = (False, None)

    def prepare(self, build: BuildView, samples: list[dict]) -> dict[str, Rejected]:
        self._build = build
        self._regen = regeneration(build.meta())
        if self._regen[0] and self._regen[1] not in ("all", "last"):
            raise FormatError(f"--format chat: the build is regenerated but its metadata records --turns "
                              f"{self._regen[1]!r}, not all or last, so its generated turns cannot be placed")
        has_conversations, rows = build.source_rows(e["sample_id"] for e in samples)
        if not has_conversations:
            raise FormatError("--format chat: the build's source holds no conversations ('messages' or "
                              "'conversations' rows), only tokens or text; there is no chat to export")
        refused: dict[str, Rejected] = {}
        for e in samples:
            sid = e["sample_id"]
            why = self._refusal(e, rows.get(sid))
            if why is not None:
                refused[sid] = why
            else:
                self._messages[sid] = json.dumps(rows[sid].messages)
        if self._regen[0]:
            self._written = build.written(self._messages)
        return refused

    def _refusal(self, e: dict, row: SourceRow | None) -> Rejected | None:
        fix = "restore the source row the build stored, or accept the change: hsbuild resume BUILD " \
              "--accept-source-changes (the sample is extracted again)"
        if row is None:
            return Rejected("source_gone", f"its row is no longer in the build's source; {fix}")
        if row.kind != "conversation":
            return Rejected("not_a_conversation", f"its source row (row {row.row}) holds {row.kind}, not a "
                                                  "conversation")
        if row.fingerprint is None:
            return Rejected("source_unreadable", f"its source row (row {row.row}) cannot be read as the build "
                                                 f"read it: {row.problem}")
        if row.fingerprint != e["fingerprint"]:
            return Rejected("source_changed", f"its source row (row {row.row}) changed since the build stored it "
                                              f"(fingerprint {row.fingerprint}, the log's {e['fingerprint']}); {fix}")
        stored, source = e.get("num_tokens"), e.get("source_tokens")
        if not self._regen[0] and stored is not None and source is not None and int(stored) < int(source):
            return Rejected("truncated", f"stored {stored} of its {source} tokens (--max-tokens): its last "
                                         "assistant turn may be cut short")
        return None

    def sample_path(self, index: int, sample_id: str) -> str:  # noqa: ARG002
        return f"{ROWS}/{index // GROUP:05d}/{index:08d}.json"

    def sample_bytes(self, s: Sample) -> bytes:
        if self._build is None or s.sample_id not in self._messages:
            raise Rejected("not_prepared", "the chat format was not prepared for this sample")
        texts = [self._build.decode(run) for run in spans(s.input_ids.tolist(), s.loss_mask.tolist())]
        regenerated, turns = self._regen
        line: dict[str, object] = {"id": s.sample_id,
                                   "messages": place(json.loads(self._messages[s.sample_id]), texts, regenerated,
                                                     turns)}
        if regenerated:
            w = self._written.get(s.sample_id, {})
            line.update({k: w[k] for k in ("finish_reason", "generated") if w.get(k) is not None})
        return (json.dumps(line, ensure_ascii=False) + "\n").encode()

    def finish_files(self, out: Path, rows: Iterable[Exported], freq: Counter[int], vocab_size: int,  # noqa: ARG002
                     draft_vocab_size: int | None) -> dict[str, bytes | Callable[[Path], None]]:
        paths = [self.sample_path(r.index, r.sample_id) for r in rows]

        def join(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                for rel in paths:
                    f.write((out / rel).read_bytes())

        return {JSONL: join}

    def scan(self, root: Path) -> list[Path]:
        base = root / ROWS
        if not base.is_dir():
            return []
        return sorted(p for d in base.iterdir() if d.is_dir() for p in d.iterdir() if ROW_FILE.fullmatch(p.name))
