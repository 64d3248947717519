-- depends: 0002.registry
-- Tables the stream processors own (each writes them in the transaction that saves its
-- position, see infra/postgres/positions.py).

-- projections: conversations and turns, for history and tenant queries.
CREATE TABLE conversations (
    conversation_id UUID PRIMARY KEY,
    tenant_id       TEXT        NOT NULL,
    release_id      TEXT,
    started_at      TIMESTAMPTZ NOT NULL,
    turns           INTEGER     NOT NULL DEFAULT 0
);
CREATE INDEX conversations_tenant ON conversations (tenant_id, started_at);

CREATE TABLE turns (
    turn_id         UUID PRIMARY KEY,
    conversation_id UUID        NOT NULL REFERENCES conversations (conversation_id),
    tenant_id       TEXT        NOT NULL,
    received_at     TIMESTAMPTZ NOT NULL,
    content         TEXT        NOT NULL,
    input_kind      TEXT        NOT NULL,
    specialist      TEXT,
    adapter_version TEXT,
    release_id      TEXT,
    answer          TEXT,
    finish_reason   TEXT,
    latency_ms      DOUBLE PRECISION,
    actions         INTEGER     NOT NULL DEFAULT 0,
    genui_valid     BOOLEAN,
    feedback        TEXT[]      NOT NULL DEFAULT '{}',
    completed       BOOLEAN     NOT NULL DEFAULT false
);
CREATE INDEX turns_conversation ON turns (conversation_id, received_at);

-- experience builder: what it has seen of each turn so far.
CREATE TABLE experience_turns (
    turn_id         UUID PRIMARY KEY,
    conversation_id UUID    NOT NULL,
    tenant_id       TEXT    NOT NULL,
    position        BIGINT  NOT NULL,  -- the TurnReceived's sequence in its conversation
    content         TEXT    NOT NULL,
    specialist      TEXT,
    adapter_version TEXT,
    release_id      TEXT,
    response        TEXT,
    actions         JSONB   NOT NULL DEFAULT '[]',
    completed       BOOLEAN NOT NULL DEFAULT false
);
CREATE INDEX experience_turns_conversation ON experience_turns (conversation_id, position);
CREATE TABLE experience_conversations (
    conversation_id UUID PRIMARY KEY,
    history         JSONB NOT NULL
);

-- live contract scores per release and specialist.
CREATE TABLE score_turns (
    turn_id     UUID PRIMARY KEY,
    release_id  TEXT NOT NULL,
    specialist  TEXT
);
CREATE TABLE live_scores (
    release_id   TEXT   NOT NULL,
    specialist   TEXT   NOT NULL,
    turns        BIGINT NOT NULL DEFAULT 0,
    ups          BIGINT NOT NULL DEFAULT 0,
    downs        BIGINT NOT NULL DEFAULT 0,
    edits        BIGINT NOT NULL DEFAULT 0,
    regenerates  BIGINT NOT NULL DEFAULT 0,
    actions      BIGINT NOT NULL DEFAULT 0,
    actions_ok   BIGINT NOT NULL DEFAULT 0,
    genui        BIGINT NOT NULL DEFAULT 0,
    genui_valid  BIGINT NOT NULL DEFAULT 0,
    latency_ms   DOUBLE PRECISION NOT NULL DEFAULT 0,
    PRIMARY KEY (release_id, specialist)
);

-- training trigger: new experience per specialist since its last snapshot.
-- The records since the last snapshot are one key's events, so one partition: the range
-- starts at start_offset and running_hash chains their payload hashes in log order.
CREATE TABLE trigger_state (
    specialist    TEXT    PRIMARY KEY,
    partition     INTEGER NOT NULL,
    start_offset  BIGINT  NOT NULL,
    pending       INTEGER NOT NULL,
    running_hash  TEXT    NOT NULL
);

-- runs record the seed and config they trained with, and who promoted a release.
ALTER TABLE training_runs ADD COLUMN config JSONB NOT NULL DEFAULT '{}';
ALTER TABLE training_runs ADD COLUMN metrics JSONB NOT NULL DEFAULT '{}';
ALTER TABLE releases ADD COLUMN promoted_by TEXT;
ALTER TABLE releases ADD COLUMN run_id UUID REFERENCES training_runs (run_id);

-- Promotions are carried out by the serving process, which owns the engine: a request names
-- the release to make active; the server loads its adapters, sends a canary request, and flips
-- the active release in one transaction (or refuses, with the reason).
CREATE TABLE promotion_requests (
    request_id   UUID PRIMARY KEY,
    kind         TEXT NOT NULL CHECK (kind IN ('promote', 'rollback')),
    release_id   TEXT NOT NULL REFERENCES releases (release_id),
    run_id       UUID REFERENCES training_runs (run_id),
    requested_by TEXT NOT NULL,
    status       TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'done', 'failed')),
    reason       TEXT,
    requested_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    finished_at  TIMESTAMPTZ
);
CREATE UNIQUE INDEX promotion_requests_one_pending ON promotion_requests ((true))
    WHERE status = 'pending';
ALTER TABLE training_runs ADD COLUMN lease_until TIMESTAMPTZ;
