-- depends: 0007.release-scores
-- The experience builder's join state for rollouts: each sampled episode of a rollout group as it
-- arrives (`RolloutSampled`), its verifier's verdict once scored (`RolloutScored`). A group
-- yields its experience records when the last of its samples is scored.
CREATE TABLE experience_rollouts (
    rollout_id      UUID PRIMARY KEY,
    group_id        UUID    NOT NULL,
    sample          INTEGER NOT NULL,
    group_size      INTEGER NOT NULL,
    tenant_id       TEXT    NOT NULL,
    specialist      TEXT    NOT NULL,
    release_id      TEXT    NOT NULL,
    adapter_version TEXT,
    messages        JSONB   NOT NULL,  -- the context without the hint: what a record teaches in
    answer          TEXT    NOT NULL,  -- the episode's first step: what a record teaches
    hinted          BOOLEAN NOT NULL,  -- sampled with a hint: off the policy of its context
    scored          BOOLEAN NOT NULL DEFAULT false,
    reward          DOUBLE PRECISION,
    passed          BOOLEAN,
    failure         TEXT,
    UNIQUE (group_id, sample)
);
