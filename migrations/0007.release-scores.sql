-- depends: 0006.harness-runs
-- A release scored on its own (the demo's measurement of the active release, `macaron contract
-- run`) is an evaluation with no run and no verdict, kept so that the loop reuses its per-task
-- outcomes: a release is scored once per contract version. A run's evaluation has a verdict.
ALTER TABLE evaluations
    ALTER COLUMN passed DROP NOT NULL,
    ADD CONSTRAINT evaluations_verdict_of_a_run CHECK (
        (run_id IS NULL) = (passed IS NULL) AND (run_id IS NOT NULL OR release_id IS NOT NULL)
    );
