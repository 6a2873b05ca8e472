-- Views users query with `hsbuild sql`. Re-created on every open (they hold no data).
-- They call `is_transient(reason)`: true for a failure reason that is the environment's fault, not the sample's
-- (a full volume, the server down, a lost Ray node). builder/log/schema.py makes that macro, before these views,
-- from the one list of those reasons, builder.log.kinds.TRANSIENT_REASONS (tests/log/test_transient_reasons.py).
-- and `checksums_text(c)`: the JSON text of a `written` event's checksums from what the log stores of them (hsbuild's
-- own text as its 32 hex digits, any other as it is: builder/log/checksums.py, which makes that macro).

-- Per sample with events: the fold's state (what `samples` reads), from the checkpoint (fold_checkpoint, the
-- events up to fold_checkpoint_mark.upto, schema/events.sql) combined with the events after it. Every part of
-- the state combines exactly: the last event of a kind is the tail's if the tail has one, counts add up, and
-- attempts restart at a `superseded` in the tail. Without a checkpoint the tail is the whole log.
--   attempts: the `started` events since the last `superseded`, less each extraction start (not an import's)
--   that a transient failure ended: a `failed` whose reason is the environment's fault, not the sample's, as
--   the sample's next started/written/failed/superseded/retired event (such a start never counts against
--   --max-attempts). A start left in flight counts. Only the samples with a transient failure in the tail are
--   paired up (one window over their events); a transient failure that is a sample's first such event in the
--   tail ends the checkpoint's last start when that one is `mkind`. imports: the starts of imports among them.
CREATE OR REPLACE VIEW sample_fold AS
WITH tail AS (
    SELECT seq, ts, kind, sample_id, fingerprint, num_tokens, nbytes, detail, segment, token_start, checksums, reason,
           CASE WHEN kind = 'started' AND detail IS NOT NULL
                THEN coalesce(json_extract_string(detail, '$.origin') = 'import', false) ELSE false END AS imported,
           kind = 'failed' AND is_transient(reason) AS transient
    FROM events
    WHERE seq > (SELECT coalesce(max(upto), 0) FROM fold_checkpoint_mark) AND sample_id IS NOT NULL
      AND kind IN ('started', 'written', 'verified', 'failed', 'superseded', 'retired', 'row_moved')
),
t AS (
    SELECT sample_id,
           max(seq) FILTER (WHERE kind NOT IN ('verified', 'row_moved')) AS mseq,
           max(seq) FILTER (WHERE kind = 'verified') AS vseq,
           arg_max(ts, seq) FILTER (WHERE kind = 'verified') AS vts,
           count(*) FILTER (WHERE kind = 'started') AS starts,
           count(*) FILTER (WHERE imported) AS imports,
           max(seq) FILTER (WHERE kind = 'superseded') AS eseq,
           max(ts) FILTER (WHERE kind <> 'row_moved') AS updated_at,
           max(seq) FILTER (WHERE kind IN ('superseded', 'row_moved')) AS cseq
    FROM tail GROUP BY sample_id
),
tm AS (SELECT e.* FROM tail e JOIN t ON e.seq = t.mseq),
tc AS (SELECT e.sample_id, e.fingerprint, e.num_tokens, TRY_CAST(json_extract(e.detail, '$.row') AS BIGINT) AS row_idx
       FROM tail e JOIN t ON e.seq = t.cseq),
tr AS (SELECT e.sample_id, count(*) AS n, count(*) FILTER (WHERE e.imported) AS ni
       FROM tail e JOIN t ON e.sample_id = t.sample_id AND e.seq > t.eseq
       WHERE e.kind = 'started' GROUP BY e.sample_id),
-- the tail's transient failures, each with whether the sample's event before it (in the tail) was an extraction
-- start (NULL: none before it in the tail)
tf AS (SELECT sample_id, seq, after_start FROM (
           SELECT sample_id, seq, transient,
                  lag(kind = 'started' AND NOT imported) OVER (PARTITION BY sample_id ORDER BY seq) AS after_start
           FROM tail
           WHERE kind NOT IN ('verified', 'row_moved') AND sample_id IN (SELECT sample_id FROM tail WHERE transient))
       WHERE transient),
-- per sample: the starts they ended in the tail, those after its last `superseded`, and whether its first event
-- in the tail is one
tx AS (SELECT x.sample_id, count(*) FILTER (WHERE x.after_start) AS n,
              count(*) FILTER (WHERE x.after_start AND x.seq > t.eseq) AS ne,
              bool_or(x.after_start IS NULL) AS first
       FROM tf x JOIN t ON x.sample_id = t.sample_id GROUP BY x.sample_id)
SELECT
    coalesce(t.sample_id, f.sample_id) AS sample_id,
    CASE WHEN t.mseq IS NULL THEN f.mseq ELSE t.mseq END AS mseq,
    CASE WHEN t.mseq IS NULL THEN f.mkind ELSE tm.kind END AS mkind,
    CASE WHEN t.mseq IS NULL THEN f.m_num_tokens ELSE tm.num_tokens END AS m_num_tokens,
    CASE WHEN t.mseq IS NULL THEN f.m_nbytes ELSE tm.nbytes END AS m_nbytes,
    -- a `written` event's detail carries only what the views read of it (a regenerated sample's finish_reason
    -- and generated; its disk_bytes is m_disk_bytes): the rest (timings, truncated) stays in the event alone
    CASE WHEN t.mseq IS NULL THEN f.m_detail WHEN tm.kind <> 'written' THEN tm.detail
         WHEN json_extract(tm.detail, '$.finish_reason') IS NOT NULL
              THEN json_object('finish_reason', json_extract_string(tm.detail, '$.finish_reason'),
                               'generated', json_extract(tm.detail, '$.generated'))::VARCHAR END AS m_detail,
    CASE WHEN t.mseq IS NULL THEN f.m_segment ELSE tm.segment END AS m_segment,
    CASE WHEN t.mseq IS NULL THEN f.m_token_start ELSE tm.token_start END AS m_token_start,
    CASE WHEN t.mseq IS NULL THEN f.m_checksums ELSE tm.checksums END AS m_checksums,
    CASE WHEN t.mseq IS NULL THEN f.m_reason ELSE tm.reason END AS m_reason,
    CASE WHEN t.mseq IS NULL THEN f.m_disk_bytes
         WHEN tm.kind = 'written' THEN TRY_CAST(json_extract(tm.detail, '$.disk_bytes') AS BIGINT) END AS m_disk_bytes,
    CASE WHEN t.vseq IS NULL THEN f.vseq ELSE t.vseq END AS vseq,
    CASE WHEN t.vseq IS NULL THEN f.vts ELSE t.vts END AS vts,
    coalesce(f.starts, 0) + coalesce(t.starts, 0) AS starts,
    CASE WHEN t.eseq IS NOT NULL THEN coalesce(tr.n, 0) - coalesce(tx.ne, 0)
         ELSE coalesce(f.attempts, 0) + coalesce(t.starts, 0) - coalesce(tx.n, 0)
              - CASE WHEN tx.first AND f.mkind = 'started'
                          AND NOT coalesce(json_extract_string(f.m_detail, '$.origin') = 'import', false)
                     THEN 1 ELSE 0 END END
        AS attempts,
    CASE WHEN t.eseq IS NOT NULL THEN coalesce(tr.ni, 0) ELSE coalesce(f.imports, 0) + coalesce(t.imports, 0) END
        AS imports,
    greatest(f.updated_at, t.updated_at) AS updated_at,
    CASE WHEN t.cseq IS NULL THEN f.cseq ELSE t.cseq END AS cseq,
    CASE WHEN t.cseq IS NULL THEN f.c_fingerprint ELSE tc.fingerprint END AS c_fingerprint,
    CASE WHEN t.cseq IS NULL THEN f.c_num_tokens ELSE tc.num_tokens END AS c_num_tokens,
    CASE WHEN t.cseq IS NULL THEN f.c_row_idx ELSE tc.row_idx END AS c_row_idx
FROM fold_checkpoint f
FULL OUTER JOIN t ON f.sample_id = t.sample_id
LEFT JOIN tm ON tm.sample_id = t.sample_id
LEFT JOIN tc ON tc.sample_id = t.sample_id
LEFT JOIN tr ON tr.sample_id = t.sample_id
LEFT JOIN tx ON tx.sample_id = t.sample_id;

-- One row per source sample: the fold of its events.
--   state: the kind of its last started/written/failed event ('pending' if none), except that a `written`
--   followed by a `verified` is 'verified', and a `failed` for a transient reason (the environment's fault: the
--   server down, a full volume, a lost node) is 'pending': the sample went back to be retried, uncounted
--   (`error` and `error_detail` say why its last try ended). A `verified` that does not follow the current
--   `written` is stale and ignored. Location columns are those of the last `written`, and only while it is live.
--   Source changes (`hsbuild resume --accept-source-changes`, `hsbuild skip`): a `superseded` event (the row's
--   tokens changed, or the sample came back) starts the sample over (state pending, attempts counted from
--   there, its old data no longer live), a `retired` event (removed from the source, or skipped) makes it
--   'retired' (retired_reason says which, retired_note why). fingerprint, row_idx and source_tokens are the
--   current source's (the last `superseded`/`row_moved` event's, else the registration's).
--   Written for speed (a log of millions of events): `sample_fold` folds only the events after the last
--   checkpoint of the fold, and each sample's state is read from it in one join.
CREATE OR REPLACE VIEW samples AS
SELECT
    s.sample_id,
    coalesce(f.c_row_idx, s.row_idx) AS row_idx,
    coalesce(f.c_fingerprint, s.fingerprint) AS fingerprint,
    CASE
        WHEN f.mkind IS NULL OR f.mkind = 'superseded' THEN 'pending'
        WHEN f.mkind = 'written' AND f.vseq > f.mseq THEN 'verified'
        WHEN f.mkind = 'failed' AND is_transient(f.m_reason) THEN 'pending'
        ELSE f.mkind
    END AS state,
    coalesce(f.attempts, 0) AS attempts,  -- starts since the restart, less those a transient failure ended
    coalesce(f.c_num_tokens, s.num_tokens) AS source_tokens,
    CASE WHEN f.mkind = 'written' THEN f.m_num_tokens END AS num_tokens,
    CASE WHEN f.mkind = 'written' THEN f.m_nbytes END AS nbytes,
    -- what the sample takes on disk: its share of its group's allocated blocks (shard files and manifest)
    CASE WHEN f.mkind = 'written' THEN f.m_disk_bytes END AS disk_bytes,
    CASE WHEN f.mkind = 'written' THEN f.m_segment END AS segment,
    CASE WHEN f.mkind = 'written' THEN f.m_token_start END AS token_start,
    -- the `written` event's JSON text ({field: "crc32c:xxxxxxxx"}), byte for byte (stored compact: checksums_text)
    CASE WHEN f.mkind = 'written' THEN checksums_text(f.m_checksums) END AS checksums,
    CASE WHEN f.mkind = 'failed' THEN f.m_reason END AS error,
    CASE WHEN f.mkind = 'failed' THEN f.m_detail END AS error_detail,
    CASE WHEN f.mkind = 'written' AND f.vseq > f.mseq THEN f.vts END AS verified_at,
    f.updated_at,
    CASE WHEN f.mkind = 'retired' THEN f.m_reason END AS retired_reason,
    CASE WHEN f.mkind = 'retired' THEN json_extract_string(f.m_detail, '$.note') END AS retired_note,
    coalesce(f.starts, 0) AS starts,  -- every start ever (numbers the next attempt)
    -- a regenerated sample (docs/regenerate.md): why its response ended ('stop': a stop token; 'length': the token
    -- limit) and how many tokens its final turn generated, from its `written` event (or the `retired` event that
    -- dropped it, --drop-truncated); NULL otherwise
    CASE WHEN f.mkind IN ('written', 'retired') THEN json_extract_string(f.m_detail, '$.finish_reason') END
        AS finish_reason,
    CASE WHEN f.mkind IN ('written', 'retired') THEN TRY_CAST(json_extract(f.m_detail, '$.generated') AS BIGINT) END
        AS generated
FROM source_samples s
LEFT JOIN sample_fold f ON f.sample_id = s.sample_id;

-- One row: how far the build is, from one pass over the fold (what `status` shows, all of it). Retired samples
-- (removed from the source, or skipped) are not counted in total; `retired` counts them. The recent rates cover the last 60 s of writes, and only while the build is
-- being extracted: NULL once a run finished after the last write, or no write came for 10 minutes.
CREATE OR REPLACE VIEW progress AS
WITH st AS (SELECT * FROM samples),
last_write AS (
    SELECT max(ts) AS wts, max(seq) AS wseq FROM events WHERE kind = 'written'
),
recent AS (
    SELECT count(*) AS n, epoch(max(ts)) - epoch(min(ts)) AS span,
           coalesce(sum(num_tokens) - arg_min(num_tokens, ts), 0) AS tokens
    FROM events
    WHERE kind = 'written'
      AND ts >= (SELECT wts FROM last_write) - INTERVAL 60 SECOND
      AND NOT EXISTS (SELECT 1 FROM events WHERE kind = 'run_finished' AND seq > (SELECT wseq FROM last_write))
      AND epoch(now()) - epoch((SELECT wts FROM last_write)) < 600
),
-- requeued: pending again after a transient failure (the environment's fault: the server down, a full volume, a
-- lost node; the `samples` view's state rule): retried without counting
st_r AS (SELECT *, state = 'pending' AND error IS NOT NULL AS requeued FROM st),
counts AS (
    SELECT
        count(*) FILTER (WHERE state <> 'retired') AS total,
        count(*) FILTER (WHERE state = 'pending') AS pending,
        count(*) FILTER (WHERE requeued) AS requeued,
        count(*) FILTER (WHERE state = 'started') AS started,
        count(*) FILTER (WHERE state = 'written') AS written,
        count(*) FILTER (WHERE state = 'verified') AS verified,
        count(*) FILTER (WHERE state = 'failed') AS failed,
        count(*) FILTER (WHERE state = 'retired') AS retired,
        coalesce(sum(num_tokens) FILTER (WHERE state IN ('written', 'verified')), 0) AS tokens_done,
        -- what will be stored: each sample cut to the build's --max-tokens (meta `format`)
        coalesce(sum(least(source_tokens, coalesce((SELECT TRY_CAST(json_extract(value, '$.max_tokens') AS BIGINT)
                                                    FROM meta WHERE key = 'format'), source_tokens)))
                 FILTER (WHERE state <> 'retired'), 0) AS tokens_total,
        coalesce(sum(nbytes) FILTER (WHERE state IN ('written', 'verified')), 0) AS bytes_done,
        -- what the capacity projection needs (space/capacity.py), from this same pass over the fold: the bytes
        -- the done samples take on disk, and the samples still to extract (failed ones included: a resume
        -- retries them) with their tokens as they will be stored
        coalesce(sum(coalesce(disk_bytes, nbytes)) FILTER (WHERE state IN ('written', 'verified')), 0)
            AS disk_bytes_done,
        count(*) FILTER (WHERE state NOT IN ('written', 'verified', 'retired')) AS todo_samples,
        coalesce(sum(least(source_tokens, coalesce((SELECT TRY_CAST(json_extract(value, '$.max_tokens') AS BIGINT)
                                                    FROM meta WHERE key = 'format'), source_tokens)))
                 FILTER (WHERE state NOT IN ('written', 'verified', 'retired')), 0) AS todo_tokens,
        -- a regenerating build (docs/regenerate.md): the tokens its written samples hold beyond their first
        -- prompt (the responses, and with --turns all the later turns), for the allowance below
        coalesce(sum(num_tokens - source_tokens) FILTER (WHERE state IN ('written', 'verified')
                                                          AND finish_reason IS NOT NULL), 0) AS grown_tokens,
        count(*) FILTER (WHERE state IN ('written', 'verified') AND finish_reason IS NOT NULL) AS grown_samples,
        -- regenerated responses that stopped at the token limit (finish_reason 'length'): kept in the build, and
        -- retired for it (--drop-truncated)
        count(*) FILTER (WHERE state IN ('written', 'verified') AND finish_reason = 'length') AS at_token_limit,
        count(*) FILTER (WHERE state = 'retired' AND retired_reason = 'at_token_limit') AS dropped_at_token_limit,
        -- failed samples per reason (a map; NULL when none failed)
        histogram(coalesce(error, 'unknown')) FILTER (WHERE state = 'failed') AS failed_by_reason
    FROM st_r
),
-- A regenerating build stores each sample's (final) prompt and the generated tokens, but registers its first
-- prompt only (`source_tokens`): each sample not yet generated counts its first prompt plus an allowance,
-- max_new_tokens, or the mean its written samples grew beyond their first prompts where that is larger (with
-- --turns all, a conversation's later turns); --max-tokens bounds prompt and response, so no sample counts more.
-- The expected tokens: those written, and the allowance for the others (the capacity projection's todo_tokens).
regen AS (
    SELECT CASE WHEN coalesce(TRY_CAST(json_extract(value, '$.regenerate') AS BOOLEAN), false)
                THEN TRY_CAST(json_extract(value, '$.max_new_tokens') AS BIGINT) END AS max_new,
           TRY_CAST(json_extract(value, '$.max_tokens') AS BIGINT) AS max_tokens
    FROM meta WHERE key = 'format'
),
allowance AS (
    SELECT CAST(ceil(greatest(g.max_new, coalesce(c.grown_tokens / nullif(c.grown_samples, 0), 0))) AS BIGINT)
               AS response_allowance,
           CASE WHEN c.grown_tokens > g.max_new * c.grown_samples THEN 'measured' ELSE 'max_new_tokens' END
               AS allowance_basis
    FROM counts c, regen g WHERE g.max_new IS NOT NULL
),
expected AS (
    SELECT a.response_allowance, a.allowance_basis,
           least(c.todo_tokens + c.todo_samples * a.response_allowance,
                 coalesce(c.todo_samples * g.max_tokens, c.todo_tokens + c.todo_samples * a.response_allowance))
               AS todo_tokens
    FROM counts c, regen g, allowance a
)
SELECT
    c.* REPLACE (
        coalesce(x.todo_tokens, c.todo_tokens) AS todo_tokens,
        CASE WHEN x.todo_tokens IS NULL THEN c.tokens_total ELSE c.tokens_done + x.todo_tokens END AS tokens_total),
    x.response_allowance,
    x.allowance_basis,
    c.written + c.verified AS done,
    c.total - c.written - c.verified - c.failed AS remaining,
    CASE WHEN r.n > 1 AND r.span > 0 THEN (r.n - 1) / r.span END AS recent_samples_per_s,
    CASE WHEN r.n > 1 AND r.span > 0 THEN r.tokens / r.span END AS recent_tokens_per_s,
    CASE WHEN r.n > 1 AND r.span > 0
         THEN (c.total - c.written - c.verified - c.failed) / ((r.n - 1) / r.span) END AS eta_seconds,
    (SELECT max(ts) FROM events) AS last_event_at
FROM counts c CROSS JOIN recent r LEFT JOIN expected x ON true;

-- One row per run (or verify sweep): when, with what, and how it ended. Runs are ordered by the log (the seq of
-- their start event, `started_seq`), never by wall time: a clock set back makes a later run's `started_at` older.
--   duration_s: wall time, from its start to its end (unfinished: killed, or still going: to its last event).
--   active_s: the time it spent extracting: from its first `started` sample to its last `written` one, less its
--   pauses (`paused` -> the next `resumed` of that reason) and storage stalls (an `unstalled` event's `since` and
--   `duration_s`), where they overlap that span. Start-up, the final flush and, for a run that died, the time
--   between its last write and its death (nothing it extracted then was kept) are not in it. NULL without a
--   write; 0 when its first start and last write came in one commit (event times are their commits', every
--   0.5 s or so), and then no rate. The rates are over active_s.
CREATE OR REPLACE VIEW runs AS
WITH starts AS (
    SELECT run_id, seq AS started_seq, ts AS started_at, kind AS start_kind, detail AS config FROM events
    WHERE kind IN ('run_started', 'verify_started')
),
ends AS (
    SELECT run_id, ts AS finished_at, reason AS outcome, detail AS summary FROM events
    WHERE kind IN ('run_finished', 'verify_finished')
),
per_run AS (
    SELECT run_id,
           count(*) FILTER (WHERE kind = 'written') AS written,
           count(*) FILTER (WHERE kind = 'verified') AS verified,
           -- (a transient failure sent its sample back to pending: not a failure of the run's, as it says)
           count(*) FILTER (WHERE kind = 'failed' AND NOT is_transient(reason)) AS failed,
           count(*) FILTER (WHERE kind = 'paused') AS pauses,
           coalesce(sum(num_tokens) FILTER (WHERE kind = 'written'), 0) AS tokens,
           coalesce(sum(nbytes) FILTER (WHERE kind = 'written'), 0) AS nbytes,
           arg_max(ts, seq) AS last_at,
           epoch(arg_min(ts, seq) FILTER (WHERE kind = 'started')) AS w0,
           epoch(arg_max(ts, seq) FILTER (WHERE kind = 'written')) AS w1
    FROM events GROUP BY run_id
),
-- the spans in which a run extracted nothing on purpose, in epoch seconds (b NULL: not ended)
pause_ev AS (
    SELECT run_id, kind, epoch(ts) AS t, lead(epoch(ts)) OVER w AS next_t
    FROM events WHERE kind IN ('paused', 'resumed')
    WINDOW w AS (PARTITION BY run_id, reason ORDER BY seq)
),
stall_ev AS (
    SELECT run_id, kind, TRY_CAST(json_extract(detail, '$.since') AS DOUBLE) AS since,
           TRY_CAST(json_extract(detail, '$.duration_s') AS DOUBLE) AS took
    FROM events WHERE kind IN ('stalled', 'unstalled')
),
spans AS (
    SELECT run_id, t AS a, next_t AS b FROM pause_ev WHERE kind = 'paused'  -- (a second `paused` of that reason: merged)
    UNION ALL
    SELECT run_id, since, since + took FROM stall_ev WHERE kind = 'unstalled' AND since IS NOT NULL
    UNION ALL
    SELECT s.run_id, s.since, NULL FROM stall_ev s WHERE s.kind = 'stalled' AND s.since IS NOT NULL
      AND NOT EXISTS (SELECT 1 FROM stall_ev u WHERE u.kind = 'unstalled' AND u.run_id IS NOT DISTINCT FROM s.run_id
                      AND u.since = s.since)
),
-- clipped to the run's extracting span, then merged where they overlap (a pause during a stall counts once)
clipped AS (
    SELECT x.run_id, greatest(x.a, p.w0) AS a, least(coalesce(x.b, p.w1), p.w1) AS b
    FROM spans x JOIN per_run p USING (run_id)
    WHERE p.w1 IS NOT NULL AND least(coalesce(x.b, p.w1), p.w1) > greatest(x.a, p.w0)
),
marked AS (
    SELECT run_id, a, b,
           CASE WHEN a > max(b) OVER (PARTITION BY run_id ORDER BY a, b ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
                THEN 1 ELSE 0 END AS starts_group
    FROM clipped
),
grouped AS (
    SELECT run_id, a, b, sum(starts_group) OVER (PARTITION BY run_id ORDER BY a, b ROWS UNBOUNDED PRECEDING) AS g
    FROM marked
),
idle AS (
    SELECT run_id, sum(e - s) AS idle_s
    FROM (SELECT run_id, g, min(a) AS s, max(b) AS e FROM grouped GROUP BY run_id, g) GROUP BY run_id
),
timed AS (
    SELECT s.run_id, epoch(coalesce(e.finished_at, p.last_at)) - epoch(s.started_at) AS duration_s,
           CASE WHEN p.w1 IS NOT NULL THEN greatest(p.w1 - p.w0 - coalesce(i.idle_s, 0), 0) END AS active_s
    FROM starts s LEFT JOIN ends e USING (run_id) LEFT JOIN per_run p USING (run_id) LEFT JOIN idle i USING (run_id)
)
SELECT
    s.run_id,
    CASE WHEN s.start_kind = 'verify_started' THEN 'verify' ELSE 'extract' END AS kind,
    s.started_seq,
    s.started_at,
    e.finished_at,
    coalesce(e.outcome, 'unfinished') AS outcome,
    p.written, p.verified, p.failed, p.pauses, p.tokens, p.nbytes,
    round(t.duration_s, 3) AS duration_s,
    round(t.active_s, 3) AS active_s,
    -- throughput over the time spent extracting (active_s): how fast it extracts, whatever it waited for
    CASE WHEN t.active_s > 0 THEN round(p.written / t.active_s, 3) END AS samples_per_s,
    CASE WHEN t.active_s > 0 THEN round(p.tokens / t.active_s, 1) END AS tokens_per_s,
    CASE WHEN t.active_s > 0 THEN round(p.nbytes / 1e6 / t.active_s, 3) END AS mb_per_s,
    s.config,
    e.summary
FROM starts s
LEFT JOIN ends e USING (run_id)
LEFT JOIN per_run p USING (run_id)
LEFT JOIN timed t USING (run_id)
ORDER BY s.started_seq;

-- GPU utilisation and memory per device, sampled every few seconds during GPU runs (NVML).
CREATE OR REPLACE VIEW gpu_stats AS
SELECT ts, run_id, d.index AS gpu, d.name, d.util_percent, d.mem_used, d.mem_total
FROM (SELECT ts, run_id, unnest(from_json(detail->'devices',
        '[{"index":"INTEGER","name":"VARCHAR","util_percent":"INTEGER","mem_used":"BIGINT","mem_total":"BIGINT"}]')) AS d
      FROM events WHERE kind = 'gpu_stats');

-- The checks of every recorded `hsbuild doctor` / run preflight.
CREATE OR REPLACE VIEW doctor_checks AS
SELECT seq, ts, run_id, detail->>'$.context' AS context, c.name, c.status, c.summary, c.fix
FROM (SELECT seq, ts, run_id, detail, unnest(from_json(detail->'checks',
        '[{"name":"VARCHAR","status":"VARCHAR","summary":"VARCHAR","fix":"VARCHAR"}]')) AS c
      FROM events WHERE kind = 'doctor');

-- One row per Ray node of each run with `--ray` (a node that held a worker): its workers, what they wrote, its
-- throughput (samples written / time since its first worker was placed, to its last write), and whether it is
-- gone (every worker it held was lost: the node or its actors died; their samples went back to pending).
CREATE OR REPLACE VIEW nodes AS
WITH placed AS (
    SELECT run_id, worker, detail->>'$.node' AS node, detail->>'$.host' AS host, ts AS placed_at
    FROM events WHERE kind = 'worker_placed'
),
lost AS (
    SELECT run_id, worker, max(ts) AS lost_at FROM events WHERE kind = 'worker_lost' GROUP BY run_id, worker
),
wrote AS (
    SELECT run_id, worker, count(*) AS written, sum(num_tokens) AS tokens, sum(nbytes) AS nbytes,
           max(ts) AS last_written_at
    FROM events WHERE kind = 'written' AND worker IS NOT NULL
      AND run_id IN (SELECT run_id FROM placed) GROUP BY run_id, worker
),
per_node AS (
    SELECT p.run_id, p.node, any_value(p.host) AS host, count(*) AS workers, count(l.lost_at) AS workers_lost,
           coalesce(sum(w.written), 0) AS written, coalesce(sum(w.tokens), 0) AS tokens,
           coalesce(sum(w.nbytes), 0) AS nbytes, min(p.placed_at) AS since, max(w.last_written_at) AS last_written_at,
           max(l.lost_at) AS lost_at
    FROM placed p LEFT JOIN lost l USING (run_id, worker) LEFT JOIN wrote w USING (run_id, worker)
    GROUP BY p.run_id, p.node
)
SELECT run_id, node, host, workers, workers_lost, written, tokens, nbytes, since, last_written_at,
       CASE WHEN written > 0 AND epoch(last_written_at - since) > 0
            THEN written / epoch(last_written_at - since) END AS samples_per_s,
       CASE WHEN written > 0 AND epoch(last_written_at - since) > 0
            THEN tokens / epoch(last_written_at - since) END AS tokens_per_s,
       CASE WHEN workers_lost = workers THEN 'gone' ELSE 'up' END AS state,
       lost_at
FROM per_node
ORDER BY since, node;
