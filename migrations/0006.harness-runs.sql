-- depends: 0005.harness
-- A run may propose a harness instead of training an adapter (its recipe is `harness.<change>`,
-- core/harness/proposals.py): its result is a registered harness version, its parent adapter
-- the specialist's adapter in the release it was proposed on. A run has one kind of result.
ALTER TABLE training_runs
    ADD COLUMN result_harness_version INTEGER REFERENCES harness_versions (version),
    ADD CONSTRAINT training_runs_one_result
        CHECK (result_adapter_id IS NULL OR result_harness_version IS NULL);
