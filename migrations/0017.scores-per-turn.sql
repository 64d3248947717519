-- depends: 0016.tenant-data-keys
-- Live scores per turn (processor `live-scores-2`): each scored turn's row holds its own
-- counters and its tenant, and `live_scores` is their sum per release and specialist. Forgetting
-- a tenant deletes its turns' rows, so the sums are what a clean replay gives. The rows of
-- `live-scores-1` are dropped; `live-scores-2` rebuilds them from the log.
DROP TABLE live_scores;
DELETE FROM score_turns;
DELETE FROM processor_positions WHERE processor = 'live-scores-1';
ALTER TABLE score_turns
    ADD COLUMN tenant_id   TEXT NOT NULL,
    ADD COLUMN turns       BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN ups         BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN downs       BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN edits       BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN regenerates BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN actions     BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN actions_ok  BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN genui       BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN genui_valid BIGINT NOT NULL DEFAULT 0,
    ADD COLUMN latency_ms  DOUBLE PRECISION NOT NULL DEFAULT 0;
CREATE INDEX score_turns_tenant ON score_turns (tenant_id);
CREATE VIEW live_scores AS
    SELECT release_id, specialist,
        sum(turns)::bigint AS turns, sum(ups)::bigint AS ups, sum(downs)::bigint AS downs,
        sum(edits)::bigint AS edits, sum(regenerates)::bigint AS regenerates,
        sum(actions)::bigint AS actions, sum(actions_ok)::bigint AS actions_ok,
        sum(genui)::bigint AS genui, sum(genui_valid)::bigint AS genui_valid,
        sum(latency_ms) AS latency_ms
    FROM score_turns WHERE specialist IS NOT NULL GROUP BY release_id, specialist;
