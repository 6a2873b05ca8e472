-- Views users query with `hsbuild sql`. Re-created on every open (they hold no data).

-- One row per source sample: the fold of its events.
--   state: the kind of its last started/written/failed event ('pending' if none), except that a `written`
--   followed by a `verified` is 'verified'. A `verified` that does not follow the current `written` is stale
--   and ignored. Location columns are those of the last `written`, and only while it is live.
--   Source changes (`hsbuild resume --accept-source-changes`, `hsbuild skip`): a `superseded` event (the row's
--   tokens changed, or the sample came back) starts the sample over (state pending, attempts counted from
--   there, its old data no longer live), a `retired` event (removed from the source, or skipped) makes it
--   'retired' (retired_reason says which, retired_note why). fingerprint, row_idx and source_tokens are the
--   current source's (the last `superseded`/`row_moved` event's, else the registration's).
CREATE OR REPLACE VIEW samples AS
WITH se AS (
    SELECT * FROM events
    WHERE sample_id IS NOT NULL AND kind IN ('started', 'written', 'verified', 'failed', 'superseded', 'retired')
),
last_main AS (
    SELECT * FROM se WHERE kind <> 'verified'
    QUALIFY row_number() OVER (PARTITION BY sample_id ORDER BY seq DESC) = 1
),
last_verified AS (
    SELECT sample_id, max(seq) AS vseq, arg_max(ts, seq) AS vts FROM se WHERE kind = 'verified' GROUP BY sample_id
),
resets AS (
    SELECT sample_id, max(seq) AS eseq FROM se WHERE kind = 'superseded' GROUP BY sample_id
),
current_src AS (
    SELECT sample_id, fingerprint, num_tokens, TRY_CAST(json_extract(detail, '$.row') AS BIGINT) AS row_idx
    FROM events WHERE sample_id IS NOT NULL AND kind IN ('superseded', 'row_moved')
    QUALIFY row_number() OVER (PARTITION BY sample_id ORDER BY seq DESC) = 1
),
agg AS (
    SELECT se.sample_id,
           count(*) FILTER (WHERE kind = 'started' AND seq > coalesce(e.eseq, 0)) AS attempts,
           count(*) FILTER (WHERE kind = 'started') AS starts,
           max(ts) AS updated_at
    FROM se LEFT JOIN resets e USING (sample_id) GROUP BY se.sample_id
)
SELECT
    s.sample_id,
    coalesce(c.row_idx, s.row_idx) AS row_idx,
    coalesce(c.fingerprint, s.fingerprint) AS fingerprint,
    CASE
        WHEN m.kind IS NULL OR m.kind = 'superseded' THEN 'pending'
        WHEN m.kind = 'written' AND v.vseq > m.seq THEN 'verified'
        ELSE m.kind
    END AS state,
    coalesce(a.attempts, 0) AS attempts,
    coalesce(c.num_tokens, s.num_tokens) AS source_tokens,
    CASE WHEN m.kind = 'written' THEN m.num_tokens END AS num_tokens,
    CASE WHEN m.kind = 'written' THEN m.nbytes END AS nbytes,
    -- what the sample takes on disk: its share of its group's allocated blocks (shard files and manifest)
    CASE WHEN m.kind = 'written' THEN TRY_CAST(json_extract(m.detail, '$.disk_bytes') AS BIGINT) END AS disk_bytes,
    CASE WHEN m.kind = 'written' THEN m.segment END AS segment,
    CASE WHEN m.kind = 'written' THEN m.token_start END AS token_start,
    CASE WHEN m.kind = 'written' THEN m.checksums END AS checksums,
    CASE WHEN m.kind = 'failed' THEN m.reason END AS error,
    CASE WHEN m.kind = 'failed' THEN m.detail END AS error_detail,
    CASE WHEN m.kind = 'written' AND v.vseq > m.seq THEN v.vts END AS verified_at,
    a.updated_at,
    CASE WHEN m.kind = 'retired' THEN m.reason END AS retired_reason,
    CASE WHEN m.kind = 'retired' THEN json_extract_string(m.detail, '$.note') END AS retired_note,
    coalesce(a.starts, 0) AS starts  -- every start ever (numbers the next attempt)
FROM source_samples s
LEFT JOIN last_main m USING (sample_id)
LEFT JOIN last_verified v USING (sample_id)
LEFT JOIN agg a USING (sample_id)
LEFT JOIN current_src c USING (sample_id);

-- One row: how far the build is. Retired samples (removed from the source, or skipped) are not counted in
-- total; `retired` counts them. The recent rates cover the last 60 s of writes, and only while the build is
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
counts AS (
    SELECT
        count(*) FILTER (WHERE state <> 'retired') AS total,
        count(*) FILTER (WHERE state = 'pending') AS pending,
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
        coalesce(sum(nbytes) FILTER (WHERE state IN ('written', 'verified')), 0) AS bytes_done
    FROM st
)
SELECT
    c.*,
    c.written + c.verified AS done,
    c.total - c.written - c.verified - c.failed AS remaining,
    CASE WHEN r.n > 1 AND r.span > 0 THEN (r.n - 1) / r.span END AS recent_samples_per_s,
    CASE WHEN r.n > 1 AND r.span > 0 THEN r.tokens / r.span END AS recent_tokens_per_s,
    CASE WHEN r.n > 1 AND r.span > 0
         THEN (c.total - c.written - c.verified - c.failed) / ((r.n - 1) / r.span) END AS eta_seconds,
    (SELECT max(ts) FROM events) AS last_event_at
FROM counts c, recent r;

-- One row per run (or verify sweep): when, with what, and how it ended.
CREATE OR REPLACE VIEW runs AS
WITH starts AS (
    SELECT run_id, ts AS started_at, kind AS start_kind, detail AS config FROM events
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
           count(*) FILTER (WHERE kind = 'failed') AS failed,
           count(*) FILTER (WHERE kind = 'paused') AS pauses,
           coalesce(sum(num_tokens) FILTER (WHERE kind = 'written'), 0) AS tokens,
           coalesce(sum(nbytes) FILTER (WHERE kind = 'written'), 0) AS nbytes
    FROM events GROUP BY run_id
)
SELECT
    s.run_id,
    CASE WHEN s.start_kind = 'verify_started' THEN 'verify' ELSE 'extract' END AS kind,
    s.started_at,
    e.finished_at,
    coalesce(e.outcome, 'unfinished') AS outcome,
    p.written, p.verified, p.failed, p.pauses, p.tokens, p.nbytes,
    s.config,
    e.summary
FROM starts s
LEFT JOIN ends e USING (run_id)
LEFT JOIN per_run p USING (run_id)
ORDER BY s.started_at;

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
