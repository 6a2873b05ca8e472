-- Views users query with `hsbuild sql`. Re-created on every open (they hold no data).

-- One row per source sample: the fold of its events.
--   state: the kind of its last started/written/failed event ('pending' if none), except that a `written`
--   followed by a `verified` is 'verified'. A `verified` that does not follow the current `written` is stale
--   and ignored. Location columns are those of the last `written`, and only while it is live.
CREATE OR REPLACE VIEW samples AS
WITH se AS (
    SELECT * FROM events
    WHERE sample_id IS NOT NULL AND kind IN ('started', 'written', 'verified', 'failed')
),
last_main AS (
    SELECT * FROM se WHERE kind <> 'verified'
    QUALIFY row_number() OVER (PARTITION BY sample_id ORDER BY seq DESC) = 1
),
last_verified AS (
    SELECT sample_id, max(seq) AS vseq, arg_max(ts, seq) AS vts FROM se WHERE kind = 'verified' GROUP BY sample_id
),
agg AS (
    SELECT sample_id,
           count(*) FILTER (WHERE kind = 'started') AS attempts,
           max(ts) AS updated_at
    FROM se GROUP BY sample_id
)
SELECT
    s.sample_id,
    s.row_idx,
    s.fingerprint,
    CASE
        WHEN m.kind IS NULL THEN 'pending'
        WHEN m.kind = 'written' AND v.vseq > m.seq THEN 'verified'
        ELSE m.kind
    END AS state,
    coalesce(a.attempts, 0) AS attempts,
    s.num_tokens AS source_tokens,
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
    a.updated_at
FROM source_samples s
LEFT JOIN last_main m USING (sample_id)
LEFT JOIN last_verified v USING (sample_id)
LEFT JOIN agg a USING (sample_id);

-- One row: how far the build is.
CREATE OR REPLACE VIEW progress AS
WITH st AS (SELECT * FROM samples),
recent AS (
    SELECT count(*) AS n, epoch(max(ts)) - epoch(min(ts)) AS span,
           coalesce(sum(num_tokens) - arg_min(num_tokens, ts), 0) AS tokens
    FROM events
    WHERE kind = 'written'
      AND ts >= (SELECT max(ts) FROM events WHERE kind = 'written') - INTERVAL 60 SECOND
),
counts AS (
    SELECT
        count(*) AS total,
        count(*) FILTER (WHERE state = 'pending') AS pending,
        count(*) FILTER (WHERE state = 'started') AS started,
        count(*) FILTER (WHERE state = 'written') AS written,
        count(*) FILTER (WHERE state = 'verified') AS verified,
        count(*) FILTER (WHERE state = 'failed') AS failed,
        coalesce(sum(num_tokens) FILTER (WHERE state IN ('written', 'verified')), 0) AS tokens_done,
        coalesce(sum(source_tokens), 0) AS tokens_total,
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
