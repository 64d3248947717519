-- depends: 0022.sealed-join-state
-- A router version fitted on a forgotten tenant's routing labels keeps its row (releases and
-- lineage name it), but once the active release routes with a version that learned from no
-- forgotten tenant its weights are erased (`server.erasure.erase_replaced`): `model` is
-- cleared, and when and why are said here. A release naming an erased router version can be
-- neither promoted nor rolled back to (`router_erased`).
ALTER TABLE router_versions ALTER COLUMN model DROP NOT NULL;
ALTER TABLE router_versions ADD COLUMN erased_at TIMESTAMPTZ, ADD COLUMN erased_reason TEXT;
ALTER TABLE router_versions ADD CONSTRAINT router_versions_model_or_erased CHECK (
    (model IS NULL) = (erased_at IS NOT NULL) AND (erased_at IS NULL) = (erased_reason IS NULL)
);
