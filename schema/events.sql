-- hsbuild event log (DuckDB). Append-only: rows are inserted, never updated or deleted.
-- A sample's state is the fold of its events (see docs/design.md, "Event model").
-- Timestamps are UTC.

CREATE TABLE IF NOT EXISTS meta (
    key   VARCHAR PRIMARY KEY,   -- written once by `init` (layout, model metadata, fingerprints)
    value VARCHAR NOT NULL       -- JSON
);

-- The samples of the source, registered by `init` (and appended when the source grows). Rows are never
-- changed: a later source change is an event (superseded, row_moved, retired), and the `samples` view gives
-- each sample's current row, fingerprint and tokens.
CREATE TABLE IF NOT EXISTS source_samples (
    sample_id   VARCHAR PRIMARY KEY,  -- the row's `id`, or its row number
    row_idx     BIGINT  NOT NULL,     -- 0-based row in the source file
    fingerprint VARCHAR NOT NULL,     -- blake2b-64 of input_ids (int32) and loss_mask (uint8)
    num_tokens  BIGINT  NOT NULL      -- tokens in the source (before any --max-tokens truncation)
);

CREATE TABLE IF NOT EXISTS events (
    seq         BIGINT    NOT NULL,   -- strictly increasing, unique (index below); the order of the log
    ts          TIMESTAMP NOT NULL,   -- UTC
    kind        VARCHAR   NOT NULL,   -- exactly builder.log.kinds.EventKind (tests/log/test_event_kinds.py):
                                      -- sample: started, written, verified, failed, check_error (its bytes'
                                      --   check could not run: its state unchanged);
                                      -- source changes: superseded (the row changed or came back: the sample
                                      --   starts over), retired (removed from the source, or skipped),
                                      --   row_moved (same tokens, another row);
                                      -- build: init, log_rebuilt, doctor, gc, export, verify_started,
                                      --   verify_finished;
                                      -- run: run_started, run_finished, segment_sealed, paused, resumed,
                                      --   stalled, unstalled (a commit the volume held), adopted (samples a
                                      --   previous run left durable), engine_probe, engine_refused, gpu_stats,
                                      --   import, source_changed, source_moved;
                                      -- --ray runs: nodes_probed, worker_placed ({node, host, pid}),
                                      --   worker_lost (a node or actor gone: {message, requeued})
    run_id      VARCHAR,              -- the run (or verify sweep) that wrote the event
    sample_id   VARCHAR,              -- NULL for run events
    fingerprint VARCHAR,              -- the sample's token fingerprint at the time of the event
                                      --   (superseded, row_moved: of its new source row)
    attempt     INTEGER,              -- 1, 2, ... for started/written/failed
    worker      INTEGER,
    segment     VARCHAR,              -- written: the segment holding the sample
    token_start BIGINT,               -- written: first token of the sample in its segment
    num_tokens  BIGINT,               -- written: tokens stored; superseded, row_moved: tokens in the source
    nbytes      BIGINT,               -- written: compressed bytes of its chunk files; verified: bytes read
    checksums   VARCHAR,              -- written: the CRC-32C of each field's uncompressed bytes, as stored:
                                      --   hsbuild's JSON text {field: "crc32c:xxxxxxxx"} as its 32 hex digits
                                      --   (input_ids, loss_mask, hidden_state, aux_hidden_state), any other
                                      --   text (a log an older hsbuild wrote) as it is; checksums_text(checksums)
                                      --   gives the JSON text (what samples.checksums is: builder/log/checksums.py)
    reason      VARCHAR,              -- failed: nonfinite, token_out_of_range, empty_sample, too_long,
                                      --   token_mismatch, bad_states, too_big_for_volume, interrupted_too_often,
                                      --   worker_died, error, import_* (a dump file refused);
                                      --   the environment's (builder.log.kinds.TRANSIENT_REASONS: the sample
                                      --   goes back to pending): no_space, server_unavailable, worker_lost;
                                      --   verify's: checksum_mismatch, missing_data, unreadable
                                      --   (segment/token_start locate the damaged bytes);
                                      -- check_error: check_error;
                                      -- paused: high_watermark, flood, disk_full, min_free, server_unavailable,
                                      --   staging_full;
                                      -- run_finished: completed, interrupted, error;
                                      -- verify_finished: completed, damage_found, check_errors, continued;
                                      -- doctor: ok, warn, fail;
                                      -- superseded: source_changed, returned, unskipped;
                                      -- retired: removed_from_source, skipped, at_token_limit (a regenerated
                                      --   response that stopped at the token limit, --drop-truncated)
    detail      VARCHAR               -- JSON: free text, figures, configs (superseded/row_moved: {row};
                                      --   retired: {note}; written, and retired at_token_limit, of a
                                      --   regenerated sample: {generated, finish_reason, seed, turns})
);

-- One writer at a time: a second writer re-using a seq number fails loudly instead of interleaving. An index
-- rather than a PRIMARY KEY in the table so that the same statement upgrades logs created without it.
CREATE UNIQUE INDEX IF NOT EXISTS events_seq ON events (seq);

-- Derived, not truth: a checkpoint of the fold (schema/views.sql, `sample_fold`) over the events up to seq
-- `upto`, so that reading a sample's state folds only the events after it (a log of millions of events answers
-- in a fraction of a second). Written by the log's owner in one transaction (table and mark together), replaced
-- whole, never edited; valid forever because events are append-only. Emptying both tables changes no answer of
-- any view, only its speed (tests/log/test_scale_view.py checks the views at every checkpoint).
CREATE TABLE IF NOT EXISTS fold_checkpoint (
    sample_id     VARCHAR,
    mseq          BIGINT,     -- its last started/written/failed/superseded/retired event, and that event's:
    mkind         VARCHAR,
    m_num_tokens  BIGINT,
    m_nbytes      BIGINT,
    m_detail      VARCHAR,    -- (a written event's: only {finish_reason, generated}, when it has them; else NULL)
    m_segment     VARCHAR,
    m_token_start BIGINT,
    m_checksums   VARCHAR,    -- (as the event stores them: checksums_text gives the JSON text)
    m_reason      VARCHAR,
    m_disk_bytes  BIGINT,     -- written: its detail's disk_bytes (read once here, not from JSON at every query)
    vseq          BIGINT,     -- its last verified event, and when
    vts           TIMESTAMP,
    starts        BIGINT,     -- started events, all of them
    attempts      BIGINT,     -- started events since its last superseded (all of them if none)
    imports       BIGINT,     -- of those, the starts of imports (detail origin 'import': no extraction attempt)
    updated_at    TIMESTAMP,  -- its last started/written/verified/failed/superseded/retired event's ts
    cseq          BIGINT,     -- its last superseded/row_moved event, and that event's source row:
    c_fingerprint VARCHAR,
    c_num_tokens  BIGINT,
    c_row_idx     BIGINT
);
CREATE TABLE IF NOT EXISTS fold_checkpoint_mark (
    upto BIGINT NOT NULL      -- fold_checkpoint folds the events with seq <= upto (no row: none)
);
