-- The PostgreSQL event log: append-only, global position, per-key sequence, hash chain.
CREATE TABLE events (
    position        BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id        UUID        NOT NULL,
    type            TEXT        NOT NULL CHECK (length(type) BETWEEN 1 AND 100),
    schema_version  INTEGER     NOT NULL CHECK (schema_version >= 1),
    occurred_at     TIMESTAMPTZ NOT NULL,
    tenant_id       TEXT        NOT NULL CHECK (tenant_id ~ '^[A-Za-z0-9][A-Za-z0-9_.:@/-]{0,199}$'),
    key             TEXT        NOT NULL CHECK (key ~ '^[A-Za-z0-9][A-Za-z0-9_.:@/-]{0,199}$'),
    sequence        BIGINT      NOT NULL CHECK (sequence >= 1),
    causation_id    UUID,
    correlation_id  UUID,
    trace           JSON        NOT NULL DEFAULT '{}'::json CHECK (json_typeof(trace) = 'object'),
    prev_hash       TEXT        CHECK (prev_hash ~ '^[0-9a-f]{64}$'),
    hash            TEXT        NOT NULL CHECK (hash ~ '^[0-9a-f]{64}$'),
    -- JSON, not JSONB: the canonical text is kept exactly as hashed (JSONB would normalise
    -- numbers such as 1.152921504606847e+18 and -0.0, and the hash would no longer verify).
    payload         JSON        NOT NULL CHECK (json_typeof(payload) = 'object'),
    recorded_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT events_event_id_key UNIQUE (event_id),
    CONSTRAINT events_key_sequence_key UNIQUE (key, sequence)
);
CREATE INDEX events_type_position ON events (type, position);
CREATE INDEX events_tenant_position ON events (tenant_id, position);

-- Stored events are immutable: updates, deletes and truncation are refused.
CREATE FUNCTION refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only: % refused', TG_TABLE_NAME, TG_OP
        USING ERRCODE = 'restrict_violation';
END;
$$;
CREATE TRIGGER events_append_only BEFORE UPDATE OR DELETE ON events
    FOR EACH ROW EXECUTE FUNCTION refuse_change();
CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events
    FOR EACH STATEMENT EXECUTE FUNCTION refuse_change();

-- Events a reader could not decode (unknown type or version, malformed), with the reason.
CREATE TABLE dead_letters (
    id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    source       TEXT        NOT NULL,
    partition    INTEGER     NOT NULL,
    "offset"     BIGINT      NOT NULL,
    code         TEXT        NOT NULL,
    reason       TEXT        NOT NULL,
    raw          TEXT        NOT NULL,
    recorded_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    CONSTRAINT dead_letters_source_position_key UNIQUE (source, partition, "offset")
);

-- Where each stream processor has read to; written in the same transaction as its outputs.
CREATE TABLE processor_positions (
    processor    TEXT        NOT NULL,
    partition    INTEGER     NOT NULL CHECK (partition >= 0),
    next_offset  BIGINT      NOT NULL CHECK (next_offset >= 0),
    updated_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (processor, partition)
);

-- The Kafka log's sequencer and idempotency index: per-key sequence and hash chain head,
-- and where each event landed. Kafka cannot refuse a duplicate key/sequence; this table can.
CREATE TABLE kafka_appends (
    event_id        UUID    PRIMARY KEY,
    topic           TEXT    NOT NULL,
    key             TEXT    NOT NULL,
    sequence        BIGINT  NOT NULL CHECK (sequence >= 1),
    hash            TEXT    NOT NULL,
    content_digest  TEXT    NOT NULL,
    partition       INTEGER NOT NULL,
    "offset"        BIGINT  NOT NULL,
    CONSTRAINT kafka_appends_key_sequence_key UNIQUE (topic, key, sequence)
);
CREATE INDEX kafka_appends_end ON kafka_appends (topic, partition, "offset");
