-- depends: 0019.router-fallback
-- An adapter version that learned from a forgotten tenant keeps its record (adapter_versions
-- is immutable: lineage still names it), but once no active release serves it its weights leave
-- the artifact store (`server.erasure.erase_replaced`). This table says which were erased,
-- when and why; a release naming one is refused for promotion and rollback.
CREATE TABLE adapter_erasures (
    adapter_version_id  BIGINT PRIMARY KEY REFERENCES adapter_versions (adapter_version_id),
    erased_at           TIMESTAMPTZ NOT NULL DEFAULT now(),
    reason              TEXT NOT NULL CHECK (reason <> '')
);
