-- depends: 0017.scores-per-turn
-- The tenants forgotten while the trigger's pending records were counted: their records in the
-- range are unreadable, so the range is counted again without them and its snapshot leaves them
-- out (`dataset_snapshots.left_out_tenants`) instead of failing as `snapshot_forgotten`.
ALTER TABLE trigger_state ADD COLUMN left_out_tenants TEXT[] NOT NULL DEFAULT '{}';
-- A router run that unlearns forgotten tenants (`tenants forget --retrain`) names them: their
-- labels before its end are unreadable, so the router it fits never saw them.
ALTER TABLE router_runs ADD COLUMN left_out_tenants TEXT[] NOT NULL DEFAULT '{}';
