-- depends: 0021.projections-without-words
-- The experience builder's join state holds tenants' words sealed under their data keys
-- (core.events.privacy.Cells): base64 text that no table, dead tuple or write-ahead log segment
-- can read, and that no longer opens once the tenant is forgotten. The plaintext columns are
-- dropped with what they held: a turn recorded before this migration has no words here, and the
-- live builder derives nothing more from it, nor from a later turn whose context it is part of
-- (infra.postgres.experience_joins.joined_turn). Feedback given on such a turn afterwards is derived
-- by a backfill of the live filter version, which rebuilds the join state from the log
-- (`macaron replay experience --filter-version N`; records already derived are not appended
-- again). Stop the stream processors before migrating (docs/deploy.md).
ALTER TABLE experience_turns DROP COLUMN content, DROP COLUMN response, DROP COLUMN actions;
ALTER TABLE experience_turns ADD COLUMN sealed_content TEXT, ADD COLUMN sealed_response TEXT,
    ADD COLUMN sealed_actions TEXT[] NOT NULL DEFAULT '{}';
ALTER TABLE experience_conversations DROP COLUMN history;
ALTER TABLE experience_conversations ADD COLUMN sealed_history TEXT;
