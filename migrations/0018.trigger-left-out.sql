-- depends: 0017.scores-per-turn
-- The tenants forgotten while the trigger's pending records were counted: their records in the
-- range are unreadable, so the range is counted again without them and its snapshot leaves them
-- out (`dataset_snapshots.left_out_tenants`) instead of failing as `snapshot_forgotten`.
ALTER TABLE trigger_state ADD COLUMN left_out_tenants TEXT[] NOT NULL DEFAULT '{}';
