"""The report's SQL: each figure's series from the event log alone (events, meta, source_samples and the views of
schema/views.sql). Each is one read-only SELECT, asked through `builder.log.query.run_query` (the live owner's
snapshot during a run, else the file opened read-only). `{t0}` and `{w}` are the time axis: the first event's epoch
seconds and the bucket width, numbers the report computes (never user input)."""

from __future__ import annotations

# the time axis: the log's first and last event, and how many
SPAN = "SELECT epoch(min(ts)) AS t0, epoch(max(ts)) AS t1, count(*) AS n FROM events"

BUCKET = "floor((epoch(ts) - {t0}) / {w})::BIGINT"

# 1, 5: what each bucket wrote (a sample's disk bytes are its share of its group's blocks, `disk_bytes`; older
# events without it: its encoded bytes). The `written` events `hsbuild rebuild-log` replayed (run id `rebuild`,
# builder/run/history_replay.py's RUN_ID) and those a run adopted (detail `adopted`: groups a killed run made
# durable, their events lost) carry the time they were recorded, not when they were extracted: counted apart
# (`restored`, `adopted`), not as throughput; their bytes are on disk all the same.
WRITTEN = """
WITH w AS (
    SELECT ts, num_tokens, nbytes, coalesce(run_id = 'rebuild', false) AS restored,
           coalesce(TRY_CAST(json_extract(detail, '$.adopted') AS BOOLEAN), false) AS adopted,
           coalesce(TRY_CAST(json_extract(detail, '$.disk_bytes') AS BIGINT), nbytes) AS disk
    FROM events WHERE kind = 'written'
)
SELECT """ + BUCKET + """ AS b, count(*) FILTER (WHERE NOT restored AND NOT adopted) AS samples,
       coalesce(sum(num_tokens) FILTER (WHERE NOT restored AND NOT adopted), 0) AS tokens,
       coalesce(sum(nbytes) FILTER (WHERE NOT restored AND NOT adopted), 0) AS nbytes,
       coalesce(sum(disk), 0) AS disk_bytes, count(*) FILTER (WHERE restored) AS restored,
       count(*) FILTER (WHERE adopted AND NOT restored) AS adopted
FROM w GROUP BY b ORDER BY b
"""

# 1: where things happened: runs and sweeps, pauses, stalls, the engine, lost workers, the log's own history
MARKS = ("SELECT seq, epoch(ts) AS t, kind, run_id, reason, "
         "CASE WHEN kind IN ('paused', 'resumed', 'unstalled', 'stalled', 'worker_lost', 'engine_refused', 'gc', "
         "'log_rebuilt') THEN detail END AS detail "
         "FROM events WHERE kind IN ('run_started', 'run_finished', 'verify_started', 'verify_finished', 'paused', "
         "'resumed', 'stalled', 'unstalled', 'engine_probe', 'engine_refused', 'worker_lost', 'gc', 'log_rebuilt', "
         "'source_changed', 'adopted', 'init') ORDER BY seq")

# the runs (and sweeps), as the `runs` view has them, with each one's last event (a run with no end record and no
# live owner was killed there)
RUNS = ("SELECT r.run_id, r.kind, r.started_seq, epoch(r.started_at) AS started_at, epoch(r.finished_at) AS finished_at, "
        "r.outcome, r.written, r.verified, r.failed, r.pauses, r.tokens, r.nbytes, r.duration_s, r.active_s, "
        "r.samples_per_s, r.tokens_per_s, r.mb_per_s, epoch(l.last_at) AS last_at, "
        "TRY_CAST(json_extract(r.config, '$.workers') AS INTEGER) AS workers "
        "FROM runs r LEFT JOIN (SELECT run_id, max(ts) AS last_at FROM events GROUP BY run_id) l USING (run_id) "
        "ORDER BY r.started_seq")

# 2: each sample's state after each of its events, by the fold's rule (the `samples` view's): the last
# started/written/failed/superseded/retired event decides, a `verified` counts only after the current `written`,
# a transient failure and a `superseded` leave it pending. Counted per bucket as moves from one state to another.
# One window pass (one sort of the sample events): `sk`, the state a non-`verified` event sets; before each event,
# `pk` the last such state and `pkind` the kind of the event just before. The state before an event is `verified`
# where a `verified` came right after a `written` state (later ones change nothing), else `pk` (none: pending); a
# `verified` event makes it `verified` only where `pk` is `written` (else it is stale: no move).
MOVES = """
WITH e AS (
    SELECT seq, ts, sample_id, kind,
           CASE WHEN kind = 'verified' THEN NULL
                WHEN kind = 'superseded' OR (kind = 'failed' AND is_transient(reason)) THEN 'pending'
                ELSE kind END AS sk
    FROM events
    WHERE sample_id IS NOT NULL AND kind IN ('started', 'written', 'verified', 'failed', 'superseded', 'retired')
),
w AS (
    SELECT ts, kind, sk,
           last_value(sk IGNORE NULLS) OVER (PARTITION BY sample_id ORDER BY seq
                                             ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS pk,
           lag(kind) OVER (PARTITION BY sample_id ORDER BY seq) AS pkind
    FROM e
),
t AS (
    SELECT ts, CASE WHEN kind = 'verified' THEN CASE WHEN pk = 'written' THEN 'verified' END ELSE sk END AS st,
           CASE WHEN pkind = 'verified' AND pk = 'written' THEN 'verified' ELSE coalesce(pk, 'pending') END AS prev
    FROM w
)
SELECT """ + BUCKET + """ AS b, prev, st, count(*) AS n FROM t WHERE st <> prev GROUP BY ALL ORDER BY b, prev, st
"""

# 2, 3, 4, 6: now, from one pass over the fold (the `samples` view, materialized once): the samples registered
# (every one starts pending), the counts as the `progress` view makes them, tokens per stored sample, how long ago
# the stored samples were verified (before the log's last event; never), the samples that failed most, and for a
# regenerating build the generated tokens of each stored response and why it ended, and the responses dropped at
# the token limit (--drop-truncated)
NOW = """
WITH s AS MATERIALIZED (
    SELECT sample_id, state, attempts, num_tokens, nbytes, disk_bytes, source_tokens, verified_at, generated,
           finish_reason, retired_reason FROM samples
),
mt AS (SELECT max(TRY_CAST(json_extract(value, '$.max_tokens') AS BIGINT)) AS m FROM meta WHERE key = 'format'),
last AS (SELECT max(ts) AS ts FROM events),
fm AS (SELECT sample_id, count(*) AS failures, count(DISTINCT reason) AS reasons, arg_max(reason, seq) AS last_reason
       FROM events WHERE kind = 'failed' GROUP BY sample_id ORDER BY failures DESC, sample_id LIMIT 10)
SELECT
    (SELECT count(*) FROM s) AS registered,
    (SELECT {'total': count(*) FILTER (WHERE state <> 'retired'),
             'pending': count(*) FILTER (WHERE state = 'pending'),
             'started': count(*) FILTER (WHERE state = 'started'),
             'written': count(*) FILTER (WHERE state = 'written'),
             'verified': count(*) FILTER (WHERE state = 'verified'),
             'failed': count(*) FILTER (WHERE state = 'failed'),
             'retired': count(*) FILTER (WHERE state = 'retired'),
             'tokens_done': coalesce(sum(num_tokens) FILTER (WHERE state IN ('written', 'verified')), 0),
             'tokens_total': coalesce(sum(least(source_tokens, coalesce((SELECT m FROM mt), source_tokens)))
                                      FILTER (WHERE state <> 'retired'), 0),
             'bytes_done': coalesce(sum(nbytes) FILTER (WHERE state IN ('written', 'verified')), 0),
             'disk_bytes_done': coalesce(sum(coalesce(disk_bytes, nbytes))
                                         FILTER (WHERE state IN ('written', 'verified')), 0)} FROM s) AS counts,
    (SELECT list({'num_tokens': num_tokens, 'n': n} ORDER BY num_tokens)
     FROM (SELECT num_tokens, count(*) AS n FROM s WHERE state IN ('written', 'verified') GROUP BY num_tokens))
        AS lengths,
    (SELECT list({'bin': bin, 'n': n})
     FROM (SELECT CASE WHEN age IS NULL THEN 'never' WHEN age < 3600 THEN 'within 1 h'
                       WHEN age < 86400 THEN 'within 1 day' WHEN age < 7 * 86400 THEN 'within 7 days'
                       ELSE 'older' END AS bin, count(*) AS n
           FROM (SELECT epoch((SELECT ts FROM last)) - epoch(verified_at) AS age FROM s
                 WHERE state IN ('written', 'verified'))
           GROUP BY bin)) AS ages,
    (SELECT list({'sample_id': fm.sample_id, 'failures': failures, 'reasons': reasons, 'last_reason': last_reason,
                  'state': s.state, 'attempts': s.attempts} ORDER BY failures DESC, fm.sample_id)
     FROM fm LEFT JOIN s USING (sample_id)) AS failed_most,
    (SELECT list({'generated': generated, 'finish_reason': finish_reason, 'n': n} ORDER BY generated, finish_reason)
     FROM (SELECT generated, finish_reason, count(*) AS n FROM s WHERE state IN ('written', 'verified')
           AND (generated IS NOT NULL OR finish_reason IS NOT NULL) GROUP BY ALL)) AS generated,
    (SELECT count(*) FROM s WHERE state = 'retired' AND retired_reason = 'at_token_limit') AS dropped_at_limit
"""
AGE_BINS = ("within 1 h", "within 1 day", "within 7 days", "older", "never")

# while a run extracts: its recent rate, as the `progress` view has it (the last minute of writes)
RECENT = """
WITH last_write AS (SELECT max(ts) AS wts, max(seq) AS wseq FROM events WHERE kind = 'written'),
recent AS (
    SELECT count(*) AS n, epoch(max(ts)) - epoch(min(ts)) AS span FROM events
    WHERE kind = 'written' AND ts >= (SELECT wts FROM last_write) - INTERVAL 60 SECOND
      AND NOT EXISTS (SELECT 1 FROM events WHERE kind = 'run_finished' AND seq > (SELECT wseq FROM last_write))
      AND epoch(now()) - epoch((SELECT wts FROM last_write)) < 600
)
SELECT CASE WHEN n > 1 AND span > 0 THEN (n - 1) / span END AS recent_samples_per_s FROM recent
"""

# 4: failed events per bucket and reason (transient ones too: marked)
FAILED = ("SELECT " + BUCKET + " AS b, reason, is_transient(reason) AS transient, count(*) AS n "
          "FROM events WHERE kind = 'failed' GROUP BY ALL ORDER BY b, reason")
# 7: per worker of each run, and per Ray node (the `nodes` view)
WORKERS = ("SELECT run_id, worker, count(*) AS written, coalesce(sum(num_tokens), 0) AS tokens, "
           "coalesce(sum(nbytes), 0) AS nbytes, epoch(min(ts)) AS first_at, epoch(max(ts)) AS last_at "
           "FROM events WHERE kind = 'written' AND worker IS NOT NULL GROUP BY ALL ORDER BY min(seq), worker")
NODES = ("SELECT run_id, node, host, workers, workers_lost, written, tokens, nbytes, samples_per_s, tokens_per_s, "
         "state FROM nodes")

META = "SELECT key, value FROM meta"
# the configuration the last run started with (hsbuild.toml's text, as the run read it)
LAST_CONFIG = ("SELECT json_extract_string(detail, '$.config') FROM events WHERE kind = 'run_started' "
               "ORDER BY seq DESC LIMIT 1")

# a regenerating build's expected tokens, as `status` gives them (the `progress` view's allowance for the
# responses not yet generated)
PROGRESS_TOKENS = "SELECT tokens_total, response_allowance, allowance_basis FROM progress"
