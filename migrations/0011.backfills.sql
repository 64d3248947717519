-- depends: 0010.routing-and-consent
-- The experience builder's rules are versioned by its records' `filter_version`, not by its
-- name: new traffic is derived under MACARON_EXPERIENCE_FILTER, past traffic by a backfill.
UPDATE processor_positions SET processor = 'experience' WHERE processor = 'experience-1';
-- A backfill: the experience of past events [start, end) derived under one filter version and
-- appended to the experience stream (`macaron replay experience --filter-version N`). Its join
-- state lives in a schema of its own (`schema_name`) until it is done; its read position is
-- the processor position `backfill:<backfill_id>`. Its records carry its id as correlation id.
CREATE TABLE experience_backfills (
    backfill_id     UUID        PRIMARY KEY,
    filter_version  TEXT        NOT NULL,
    start_positions JSONB       NOT NULL,
    end_positions   JSONB       NOT NULL,
    schema_name     TEXT        NOT NULL,
    status          TEXT        NOT NULL CHECK (status IN ('running', 'done')),
    records         INTEGER,
    started_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    finished_at     TIMESTAMPTZ
);
-- The trigger counts each filter version's records apart, so a snapshot holds one version's,
-- and remembers where its range's last record is (a snapshot asked for by hand ends there) and
-- which backfills appended records to it (lineage names them).
ALTER TABLE trigger_state ADD COLUMN filter_version TEXT NOT NULL DEFAULT 'experience-1';
ALTER TABLE trigger_state ALTER COLUMN filter_version DROP DEFAULT;
ALTER TABLE trigger_state ADD COLUMN end_offset BIGINT;
-- Pending ranges begun before: they end after the specialist's last record (on the PostgreSQL
-- log; a Kafka log's pending range gets its end with its next record).
UPDATE trigger_state t SET end_offset = (
    SELECT max(e.position) + 1 FROM events e WHERE e.key = 'experience.' || t.specialist
) WHERE t.pending > 0;
ALTER TABLE trigger_state ADD COLUMN backfills UUID[] NOT NULL DEFAULT '{}';
ALTER TABLE trigger_state DROP CONSTRAINT trigger_state_pkey;
ALTER TABLE trigger_state ADD PRIMARY KEY (specialist, filter_version);
ALTER TABLE dataset_snapshots ADD COLUMN backfills UUID[] NOT NULL DEFAULT '{}';
