-- depends: 0017.scores-per-turn
-- The tenants forgotten while the trigger's pending records were counted: their records in the
-- range are unreadable, so the range is counted again without them and its snapshot leaves them
-- out (`dataset_snapshots.left_out_tenants`) instead of failing as `snapshot_forgotten`.
ALTER TABLE trigger_state ADD COLUMN left_out_tenants TEXT[] NOT NULL DEFAULT '{}';
-- A router run that unlearns forgotten tenants (`tenants forget --retrain`) names them: their
-- labels before its end are unreadable, so the router it fits never saw them.
ALTER TABLE router_runs ADD COLUMN left_out_tenants TEXT[] NOT NULL DEFAULT '{}';
-- A run that unlearns forgotten tenants (`tenants forget --retrain`) is judged against the
-- release it would fall back to; the trigger's snapshots may leave tenants out too, so the
-- run says which it is. Until now only such runs had snapshots that left tenants out.
ALTER TABLE training_runs ADD COLUMN unlearning BOOLEAN NOT NULL DEFAULT false;
UPDATE training_runs r SET unlearning = true FROM dataset_snapshots s
    WHERE s.snapshot_id = r.snapshot_id AND cardinality(s.left_out_tenants) > 0;
