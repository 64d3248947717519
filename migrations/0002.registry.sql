-- depends: 0001.event-log
-- The registry: tenants and keys, specialists, adapter versions, releases, datasets,
-- training runs, evaluations and promotions.

CREATE TABLE tenants (
    tenant_id   TEXT PRIMARY KEY CHECK (tenant_id ~ '^[A-Za-z0-9][A-Za-z0-9_.:@/-]{0,199}$'),
    name        TEXT NOT NULL,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Only a hash of each API key is stored; the key itself is shown once, when it is made.
CREATE TABLE api_keys (
    key_id      UUID PRIMARY KEY,
    tenant_id   TEXT NOT NULL REFERENCES tenants (tenant_id),
    key_hash    TEXT NOT NULL UNIQUE CHECK (key_hash ~ '^[0-9a-f]{64}$'),
    scopes      TEXT[] NOT NULL CHECK (scopes <@ ARRAY['chat', 'admin']::TEXT[] AND cardinality(scopes) > 0),
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    revoked_at  TIMESTAMPTZ
);

CREATE TABLE specialists (
    name        TEXT PRIMARY KEY CHECK (name ~ '^[a-z][a-z0-9_-]{0,63}$'),
    description TEXT NOT NULL DEFAULT '',
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- Immutable, content-addressed LoRA weights. Version numbers are issued here, never in memory.
CREATE TABLE adapter_versions (
    adapter_version_id  BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    specialist          TEXT    NOT NULL REFERENCES specialists (name),
    version             INTEGER NOT NULL CHECK (version >= 0),
    parent_id           BIGINT REFERENCES adapter_versions (adapter_version_id),
    sha256              TEXT    NOT NULL CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    path                TEXT    NOT NULL,
    rank                INTEGER NOT NULL CHECK (rank >= 1),
    base_model          TEXT    NOT NULL,
    created_at          TIMESTAMPTZ NOT NULL DEFAULT now(),
    UNIQUE (specialist, version),
    CHECK ((version = 0) = (parent_id IS NULL))
);

CREATE TRIGGER adapter_versions_immutable BEFORE UPDATE OR DELETE ON adapter_versions
    FOR EACH ROW EXECUTE FUNCTION refuse_change();

CREATE TABLE releases (
    release_id        TEXT PRIMARY KEY,
    parent_release_id TEXT REFERENCES releases (release_id),
    base_model        TEXT NOT NULL,
    router_version    TEXT NOT NULL,
    harness_version   TEXT NOT NULL,
    hcp_version       TEXT NOT NULL,
    active            BOOLEAN NOT NULL DEFAULT false,
    created_at        TIMESTAMPTZ NOT NULL DEFAULT now()
);
-- Exactly one release is active at a time.
CREATE UNIQUE INDEX releases_one_active ON releases (active) WHERE active;

CREATE TABLE release_adapters (
    release_id          TEXT   NOT NULL REFERENCES releases (release_id),
    specialist          TEXT   NOT NULL REFERENCES specialists (name),
    adapter_version_id  BIGINT NOT NULL REFERENCES adapter_versions (adapter_version_id),
    PRIMARY KEY (release_id, specialist)
);

-- An immutable slice of the experience stream: log positions per partition, filter, hash.
CREATE TABLE dataset_snapshots (
    snapshot_id     UUID PRIMARY KEY,
    specialist      TEXT  NOT NULL REFERENCES specialists (name),
    start_positions JSONB NOT NULL,
    end_positions   JSONB NOT NULL,
    filter_version  TEXT  NOT NULL,
    content_hash    TEXT  NOT NULL CHECK (content_hash ~ '^[0-9a-f]{64}$'),
    record_count    INTEGER NOT NULL CHECK (record_count >= 0),
    created_at      TIMESTAMPTZ NOT NULL DEFAULT now()
);

CREATE TRIGGER dataset_snapshots_immutable BEFORE UPDATE OR DELETE ON dataset_snapshots
    FOR EACH ROW EXECUTE FUNCTION refuse_change();

CREATE TABLE training_runs (
    run_id              UUID PRIMARY KEY,
    specialist          TEXT   NOT NULL REFERENCES specialists (name),
    parent_adapter_id   BIGINT NOT NULL REFERENCES adapter_versions (adapter_version_id),
    snapshot_id         UUID   NOT NULL REFERENCES dataset_snapshots (snapshot_id),
    recipe              TEXT   NOT NULL,
    status              TEXT   NOT NULL CHECK (status IN ('queued', 'running', 'succeeded', 'failed')),
    result_adapter_id   BIGINT REFERENCES adapter_versions (adapter_version_id),
    error               TEXT,
    created_at          TIMESTAMPTZ NOT NULL DEFAULT now(),
    finished_at         TIMESTAMPTZ
);
-- At most one run in flight per specialist.
CREATE UNIQUE INDEX training_runs_one_in_flight ON training_runs (specialist)
    WHERE status IN ('queued', 'running');

CREATE TABLE evaluations (
    evaluation_id       UUID PRIMARY KEY,
    run_id              UUID REFERENCES training_runs (run_id),
    release_id          TEXT REFERENCES releases (release_id),
    adapter_version_id  BIGINT REFERENCES adapter_versions (adapter_version_id),
    contract_version    TEXT  NOT NULL,
    scores              JSONB NOT NULL,
    passed              BOOLEAN NOT NULL,
    created_at          TIMESTAMPTZ NOT NULL DEFAULT now()
);

CREATE TABLE promotions (
    promotion_id      UUID PRIMARY KEY,
    kind              TEXT NOT NULL CHECK (kind IN ('promoted', 'rejected', 'rolled_back')),
    from_release_id   TEXT REFERENCES releases (release_id),
    to_release_id     TEXT REFERENCES releases (release_id),
    run_id            UUID REFERENCES training_runs (run_id),
    reason            TEXT NOT NULL,
    created_at        TIMESTAMPTZ NOT NULL DEFAULT now()
);
