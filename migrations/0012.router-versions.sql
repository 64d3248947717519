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
