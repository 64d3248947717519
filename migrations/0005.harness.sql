-- depends: 0004.metrics-scope
-- Harness versions: immutable, content-addressed harness specs (core/harness/artifact.py).
-- Version numbers are issued here (`harness@N`), never in memory; `sha256` is the address of
-- `spec` (sha256 of its canonical JSON), checked again on every read. A release names its
-- harness as `harness@N` in `releases.harness_version`; releases made before this migration
-- say `harness-1`, which is read as `harness@0` (the same prompts, registered on first start).
CREATE TABLE harness_versions (
    id              BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    version         INTEGER NOT NULL UNIQUE CHECK (version >= 0),
    name            TEXT    NOT NULL UNIQUE,
    sha256          TEXT    NOT NULL UNIQUE CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    parent_version  INTEGER REFERENCES harness_versions (version),
    spec            JSONB   NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now(),
    CHECK (name = 'harness@' || version),
    CHECK ((version = 0) = (parent_version IS NULL)),
    CHECK (parent_version IS NULL OR parent_version < version)
);

CREATE TRIGGER harness_versions_immutable BEFORE UPDATE OR DELETE ON harness_versions
    FOR EACH ROW EXECUTE FUNCTION refuse_change();

-- The experience builder builds a turn's training context with the harness the turn ran under
-- (its TurnReceived's stamp); turns recorded before this column existed ran under harness@0.
ALTER TABLE experience_turns ADD COLUMN harness_version TEXT;
