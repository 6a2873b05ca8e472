"""The event log's schema: schema/*.sql (tables, views) with the macros the views call (`is_transient`, made from
builder.log.kinds.TRANSIENT_REASONS; `checksums_text`, builder.log.checksums), its digest, and this version's
views over a log an older hsbuild wrote (TEMP views on a read-only connection), or the one-line refusal where
they cannot be made."""

from __future__ import annotations

import hashlib
import json
import re
from importlib import resources
from pathlib import Path

import duckdb

from builder.errors import LogDamagedError
from builder.log.checksums import checksums_macro
from builder.log.kinds import TRANSIENT_REASONS


def schema_dir() -> Path:
    """`schema/` beside the package in a checkout, or `builder/_schema` in an installed wheel."""
    pkg = Path(__file__).resolve().parent.parent
    for cand in (pkg.parent / "schema", pkg / "_schema"):
        if (cand / "events.sql").is_file():
            return cand
    return Path(str(resources.files("builder") / "_schema"))


def schema_digest() -> str:
    """The digest of the schema (schema/*.sql and the views' macro) an owner records in meta `schema_digest` once
    the log has that schema: a change to the transient reasons changes it too, so the views are made anew."""
    ddl = (schema_dir() / "events.sql").read_text() + views_sql()
    return hashlib.blake2b(ddl.encode(), digest_size=8).hexdigest()


def transient_macro(temp: bool = False) -> str:
    """The macro `is_transient(reason)` the views call: the reason is one of TRANSIENT_REASONS (NULL: false).
    `temp`: a TEMP macro (which shadows one of the same name in the file)."""
    reasons = ", ".join(f"'{r}'" for r in sorted(TRANSIENT_REASONS))
    return (f"CREATE OR REPLACE {'TEMP ' if temp else ''}MACRO is_transient(reason) AS "
            f"coalesce(reason IN ({reasons}), false);\n\n")


def views_sql(temp: bool = False) -> str:
    """What makes the views: the macros they call, then schema/views.sql. `temp`: every view and macro TEMP
    (which shadow those of the same names in the file)."""
    views = (schema_dir() / "views.sql").read_text()
    if temp:
        views = re.sub(r"CREATE\s+OR\s+REPLACE\s+VIEW", "CREATE OR REPLACE TEMP VIEW", views, flags=re.IGNORECASE)
    return transient_macro(temp) + checksums_macro(temp) + views


def temp_views_sql() -> str:
    """The macros and the views as TEMP objects, which shadow those of the same names in the file."""
    return views_sql(temp=True)


def read_with_current_views(con: duckdb.DuckDBPyConnection, path: Path | str) -> None:
    """On a read-only connection to the log `path` whose schema an older hsbuild wrote (no owner has opened it
    since): this version's views as TEMP views, which shadow the file's, over empty TEMP fold-checkpoint tables
    that shadow the file's (whose columns may be an older version's; an empty checkpoint changes no answer, the
    whole log is folded). All of them or none: a log they cannot be made over (no `meta`, a table missing, a
    column of another type) raises LogDamagedError naming the file and the error; its own views would answer
    with another version's rules, or fail later in words that name none of this."""
    try:
        rows = con.execute("SELECT value FROM meta WHERE key = 'schema_digest'").fetchall()  # (all: no result left
        row = rows[0] if rows else None  # open on the connection, which its next `sql()` would refuse)
        if row and json.loads(row[0]) == schema_digest():
            return
    except (duckdb.Error, ValueError) as e:
        raise views_failed(path, e) from e
    ddl = (schema_dir() / "events.sql").read_text()
    try:
        con.execute("BEGIN TRANSACTION")  # all of them or none
        for table in ("fold_checkpoint", "fold_checkpoint_mark"):  # (an older checkpoint's columns may differ)
            m = re.search(rf"CREATE TABLE IF NOT EXISTS {table} \((.*?)\n\);", ddl, re.S)
            if m:
                con.execute(f"CREATE TEMP TABLE {table} ({m.group(1)}\n)")
        con.execute(temp_views_sql())
        con.execute("COMMIT")
    except duckdb.Error as e:
        try:
            con.execute("ROLLBACK")
        except duckdb.Error:
            pass
        raise views_failed(path, e) from e


def views_failed(path: Path | str, e: BaseException) -> LogDamagedError:
    """This version's tables or views cannot be made over the log at `path`: one line, with the way out."""
    path = Path(path)
    return LogDamagedError(
        f"{path}: this version's views cannot be made over the event log ({str(e).splitlines()[0][:160]}): it is "
        f"damaged, or an hsbuild this one cannot read wrote it; rebuild it from the data with `hsbuild rebuild-log "
        f"{path.parent}` (the damaged file is kept, renamed)")
