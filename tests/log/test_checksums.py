"""A `written` event's checksums are stored compact (hsbuild's own JSON text as its 32 hex digits, any other text
as it is) and every reader still gets the JSON text byte for byte: from the views (`samples.checksums`), over a
log the previous version wrote (its text stored as it is), over one whose events are of both versions; verify
and the reader compare them, so a wrong one is still damage."""

from __future__ import annotations

import json
import random

import duckdb
import pytest

import builder.reader.index as reader_index
import builder.store.segment as segment
from builder.errors import DamagedSampleError
from builder.layout import layout
from builder.log import checksums
from builder.log.checksums import checksums_macro, compact, expand
from builder.log.events import Event, EventLog
from builder.log.schema import schema_dir, transient_macro
from builder.store.reader import SegmentReader


def own_text(values: list[int]) -> str:
    """A `written` event's checksums as hsbuild writes them (builder/run/handling.py)."""
    return json.dumps({f: f"crc32c:{v:08x}" for f, v in zip(segment.FIELDS, values, strict=True)}, sort_keys=True)


OTHER_TEXTS = [
    own_text([0xA, 1, 2, 3]).replace("0000000a", "0000000A"),  # an upper-case digit
    json.dumps({f: "crc32c:00000001" for f in segment.FIELDS}),  # not sorted
    json.dumps({f: "crc32c:00000001" for f in segment.FIELDS[:3]}, sort_keys=True),  # a field short
    json.dumps({**{f: "crc32c:00000001" for f in segment.FIELDS}, "extra": "crc32c:00000002"}, sort_keys=True),
    own_text([1, 2, 3, 4]).replace("crc32c:00000004", "crc32c:0000004"),  # a digit short
    json.dumps({f: "sha256:00000001" for f in segment.FIELDS}, sort_keys=True),
    "{}", "", "{" + "0" * 31,
]


def test_the_logs_fields_are_the_stores_and_its_text_the_readers():
    """The log's copy of the fields (builder.log may not import builder.store) and the text it stands for are those
    the store writes and the reader's index parses."""
    assert checksums.FIELDS == segment.FIELDS
    assert checksums.TEXT_TEMPLATE.encode() == reader_index.TEMPLATE


def test_what_is_stored_reads_back_as_the_text_byte_for_byte_in_python_and_in_sql():
    rnd = random.Random(7)
    own = [own_text([rnd.getrandbits(32) for _ in range(4)]) for _ in range(200)]
    own += [own_text([0, 0, 0, 0]), own_text([2**32 - 1] * 4), own_text([1, 2, 3, 4])]
    texts = [*own, *OTHER_TEXTS, None]
    stored = [compact(t) for t in texts]
    assert all(len(s) == 32 for s in stored[:len(own)])  # hsbuild's own text: its digits alone
    assert stored[len(own):] == [*OTHER_TEXTS, None]  # any other: as it is
    v = json.loads(own[-1])
    assert stored[len(own) - 1] == "".join(v[f][len("crc32c:"):] for f in segment.FIELDS)  # in FIELDS order
    assert [expand(s) for s in stored] == texts
    con = duckdb.connect()
    con.execute(checksums_macro())
    got = con.execute("SELECT checksums_text(c) FROM (SELECT unnest(?) AS c, generate_subscripts(?, 1) AS i) "
                      "ORDER BY i", [stored, stored]).fetchall()
    assert [g[0] for g in got] == texts


def test_a_stored_value_given_again_is_kept_and_a_text_that_would_read_back_as_another_is_refused():
    digits = compact(own_text([1, 2, 3, 4]))
    assert compact(digits) == digits  # an event's stored checksums in a new event: the same text
    for text in ("0" * 31 + "A", "\u00e9" * 16, "x" * 32):  # 32 bytes not beginning with `{`: read as digits
        with pytest.raises(ValueError, match="not a JSON object"):
            compact(text)
        with pytest.raises(ValueError, match="not a JSON object"):  # where the event is made, before any batch
            Event("written", sample_id="s", checksums=text)


def stored(path) -> dict[str, str]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return dict(con.execute("SELECT sample_id, checksums FROM events WHERE kind = 'written'").fetchall())
    finally:
        con.close()


def view_checksums(path) -> dict[str, str]:
    with EventLog(path, read_only=True) as log:
        return dict(log.query("SELECT sample_id, checksums FROM samples WHERE checksums IS NOT NULL")[1])


def as_the_previous_version_left_it(path) -> None:
    """Make the log at `path` one the previous hsbuild wrote: the checksums of its events and its fold's checkpoint
    as the JSON text, its views reading them as they are (no `checksums_text`), an older schema digest."""
    views = (schema_dir() / "views.sql").read_text()
    assert views.count("checksums_text(f.m_checksums)") == 1
    con = duckdb.connect(str(path))
    try:
        con.execute("UPDATE events SET checksums = checksums_text(checksums)")
        con.execute("UPDATE fold_checkpoint SET m_checksums = checksums_text(m_checksums)")
        con.execute(transient_macro() + views.replace("checksums_text(f.m_checksums)", "f.m_checksums"))
        con.execute("DROP MACRO checksums_text")
        con.execute("UPDATE meta SET value = ? WHERE key = 'schema_digest'", [json.dumps("older")])
        con.execute("CHECKPOINT")
    finally:
        con.close()


def test_a_log_the_previous_version_wrote_reads_resumes_and_verifies_the_same(make_build, cli):
    """Read-only (`sql`, the reader) and as its owner (a resume, a verify), a log whose events hold the JSON text
    gives the same checksums; the new events are stored compact, the old ones are left as they are; a fold
    checkpoint over both gives them too."""
    build = make_build(6)
    cli("run", build, "--no-progress", "--limit", "3", check=True)
    lay = layout(build)
    with EventLog(lay.events) as log:
        log.checkpoint_fold()
    want = view_checksums(lay.events)
    assert len(want) == 3 and all(len(s) == 32 for s in stored(lay.events).values())
    as_the_previous_version_left_it(lay.events)
    old = stored(lay.events)
    assert {sid: json.loads(t) for sid, t in old.items()} == {sid: json.loads(t) for sid, t in want.items()}
    before = lay.events.read_bytes()
    assert view_checksums(lay.events) == want  # read-only: this version's views as TEMP views
    out = cli("sql", build, "SELECT sample_id, checksums FROM samples WHERE checksums IS NOT NULL", "--json",
              check=True).stdout
    assert {r["sample_id"]: r["checksums"] for r in json.loads(out)} == want
    assert lay.events.read_bytes() == before  # nothing upgraded by a reader

    cli("run", build, "--no-progress", check=True)  # an owner: the schema upgraded, 3 more samples written
    now = stored(lay.events)
    assert {sid: now[sid] for sid in old} == old  # the old events as they were
    new = {sid: t for sid, t in now.items() if sid not in old}
    assert len(new) == 3 and all(len(t) == 32 for t in new.values())
    with EventLog(lay.events) as log:
        log.checkpoint_fold()  # a checkpoint holding both forms
        assert log.query("SELECT count(*) FROM fold_checkpoint WHERE starts_with(m_checksums, '{')")[1] == [(3,)]
    got = view_checksums(lay.events)
    assert {sid: got[sid] for sid in want} == want
    out = cli("sql", build, "SELECT sample_id, checksums_text(checksums) AS c FROM events WHERE kind = 'written'",
              "--json", check=True).stdout  # a user's SQL over `events` gets the text through the macro
    assert {r["sample_id"]: r["c"] for r in json.loads(out)} == got
    assert {sid: got[sid] for sid in new} == {sid: expand(t) for sid, t in new.items()}
    out = json.loads(cli("verify", build, "--json", "--no-progress", check=True).stdout)
    assert (out["checked"], out["damaged"]) == (6, [])


def test_a_wrong_checksum_is_damage_in_either_form(make_build, cli):
    """One sample's checksum recorded compact, one as the previous version's text, each with a wrong hidden_state
    digit: verify reports exactly those two checksum_mismatch, and the reader refuses them."""
    build = make_build(4)
    cli("run", build, "--no-progress", check=True)
    lay = layout(build)
    ids = sorted(stored(lay.events))
    con = duckdb.connect(str(lay.events))
    try:
        con.execute("UPDATE events SET checksums = checksums_text(checksums) WHERE sample_id = ?", [ids[1]])
        at = 8 * segment.FIELDS.index("hidden_state")
        con.execute(f"UPDATE events SET checksums = checksums[:{at}] || CASE WHEN checksums[{at + 1}] = '0' THEN '1' "
                    f"ELSE '0' END || checksums[{at + 2}:] WHERE sample_id = ?", [ids[0]])
        con.execute("UPDATE events SET checksums = regexp_replace(checksums, '(\"hidden_state\": \"crc32c:)(.)', "
                    "'\\1' || CASE WHEN regexp_extract(checksums, '\"hidden_state\": \"crc32c:(.)', 1) = '0' "
                    "THEN '1' ELSE '0' END) WHERE sample_id = ?", [ids[1]])
    finally:
        con.close()
    assert len(stored(lay.events)[ids[0]]) == 32 and stored(lay.events)[ids[1]].startswith("{")
    with EventLog(lay.events, read_only=True) as log:
        rows = log.query_dicts("SELECT sample_id, segment, token_start, num_tokens, checksums FROM samples")
    reader = SegmentReader(lay.data)
    for r in rows:
        if r["sample_id"] in ids[:2]:
            with pytest.raises(DamagedSampleError) as e:
                reader.read_raw(r["segment"], r["token_start"], r["num_tokens"], r["checksums"])
            assert (e.value.reason, e.value.field) == ("checksum_mismatch", "hidden_state")
        else:
            reader.read_raw(r["segment"], r["token_start"], r["num_tokens"], r["checksums"])
    cp = cli("verify", build, "--json", "--no-progress")
    assert cp.returncode == 1, cp.stderr
    out = json.loads(cp.stdout)
    assert {d["sample_id"]: d["reason"] for d in out["damaged"]} == {ids[0]: "checksum_mismatch",
                                                                     ids[1]: "checksum_mismatch"}
