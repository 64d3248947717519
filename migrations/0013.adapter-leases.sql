-- depends: 0012.router-versions
-- Servers sharing one vLLM fleet hold a lease on each adapter version they serve or still
-- answer with; a server renews its leases every health check. An adapter leaves the replicas
-- only when the server letting go of it finds no other live lease (`server.engines.vllm.unloads`),
-- so no server's turn meets an adapter another server has unloaded. A lease of a server that
-- died expires; the server that deferred the unload tries it again.
CREATE TABLE adapter_leases (
    adapter    TEXT        NOT NULL,
    holder     TEXT        NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (adapter, holder)
);
