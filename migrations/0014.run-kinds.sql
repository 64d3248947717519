-- depends: 0013.adapter-leases
-- A run's kind says what it makes: `adapter` (a successor adapter trained on its snapshot) or
-- `harness` (a harness successor proposed for its specialist; its recipe `harness.<change>`
-- names the change). Runs from before the kind was stored carry it in that recipe prefix.
ALTER TABLE training_runs
    ADD COLUMN kind TEXT NOT NULL DEFAULT 'adapter' CHECK (kind IN ('adapter', 'harness'));
UPDATE training_runs SET kind = 'harness' WHERE starts_with(recipe, 'harness.');
ALTER TABLE training_runs ALTER COLUMN kind DROP DEFAULT;
