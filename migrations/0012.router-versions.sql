-- depends: 0011.backfills
-- Router versions are release artifacts: a release names one (`releases.router_version`),
-- promotion swaps it with the adapters and the harness. A version is its classifier's content
-- hash (`core.routing.RouterModel.version`: specialists, weights, bias and the digest of its
-- training set, which names the embedding model), stored whole so any server can load it.
CREATE TABLE router_versions (
    router_version TEXT        PRIMARY KEY,
    parent_version TEXT        REFERENCES router_versions (router_version),
    model          JSONB       NOT NULL,
    created_at     TIMESTAMPTZ NOT NULL DEFAULT now()
);
-- Router runs: a successor classifier trained on the seed examples and every routing label of
-- the log up to `labels_end` (`streams.router_trigger` queues one when enough new labels came),
-- judged on the contract's routing suite, and promoted in a release of its own when it passes.
CREATE TABLE router_runs (
    run_id                UUID        PRIMARY KEY,
    labels_end            JSONB       NOT NULL,
    label_count           INTEGER     NOT NULL,
    status                TEXT        NOT NULL
                          CHECK (status IN ('queued', 'running', 'passed', 'refused', 'failed')),
    parent_router_version TEXT        REFERENCES router_versions (router_version),
    router_version        TEXT        REFERENCES router_versions (router_version),
    release_id            TEXT        REFERENCES releases (release_id),
    evaluation            JSONB,
    error                 TEXT,
    lease_until           TIMESTAMPTZ,
    created_at            TIMESTAMPTZ NOT NULL DEFAULT now(),
    finished_at           TIMESTAMPTZ
);
CREATE UNIQUE INDEX router_runs_one_in_flight ON router_runs ((true))
    WHERE status IN ('queued', 'running');
-- The router trigger's count of routing labels since its last run.
CREATE TABLE router_trigger_state (
    key     TEXT    PRIMARY KEY CHECK (key = 'routing'),
    pending INTEGER NOT NULL
);
