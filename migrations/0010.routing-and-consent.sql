-- depends: 0009.regenerations
-- The experience builder derives routing labels (`RoutingLabelled`) from turns: it keeps the
-- specialist a user picked for a typed message (`TurnReceived.specialist_hint`) and the kind of
-- input, so a GenUI interaction or a regeneration is never taken for the user's own pick.
ALTER TABLE experience_turns ADD COLUMN specialist_hint TEXT;
ALTER TABLE experience_turns ADD COLUMN input_kind TEXT NOT NULL DEFAULT 'text';
-- Whether the client asked for its own decoding (`TurnReceived.decoding`, v5: a length, stop
-- strings, a response format): such an answer teaches no adapter in the harness's context.
ALTER TABLE experience_turns ADD COLUMN client_decoding BOOLEAN NOT NULL DEFAULT false;
-- Whether a GenUI turn's tree was valid (`GenUIRendered.valid`): a live reward of its answer.
ALTER TABLE experience_turns ADD COLUMN genui_valid BOOLEAN;
-- A tenant's training consent as the experience builder has read it (`TenantTrainingSet`): no
-- row means the tenant teaches.
CREATE TABLE experience_tenants (
    tenant_id TEXT PRIMARY KEY,
    training  BOOLEAN NOT NULL
);
-- Live rewards (`trajectory` records) are chained into a snapshot's hash from this version on.
-- A range the trigger began before (and its snapshot) hashes without them, as it was begun.
ALTER TABLE trigger_state ADD COLUMN rewards_hashed BOOLEAN NOT NULL DEFAULT false;
ALTER TABLE trigger_state ALTER COLUMN rewards_hashed SET DEFAULT true;
ALTER TABLE dataset_snapshots ADD COLUMN rewards_hashed BOOLEAN NOT NULL DEFAULT false;
