-- depends: 0015.front-end
-- Tenants' data keys (core/events/privacy.py): each tenant's words in the event log are sealed
-- with its own AES-256 key, stored here wrapped by a master key (infra/master_key.py). Forgetting
-- a tenant destroys its key (wrapped and master_key_id become NULL) and keeps the row, so the
-- tenant reads as forgotten everywhere and its id is never given a new key.
CREATE TABLE tenant_data_keys (
    tenant_id     TEXT        PRIMARY KEY,
    key_id        UUID        NOT NULL,
    master_key_id TEXT,
    wrapped       BYTEA,
    created_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    forgotten_at  TIMESTAMPTZ,
    CONSTRAINT tenant_data_keys_live_or_destroyed CHECK (
        (forgotten_at IS NULL) = (wrapped IS NOT NULL AND master_key_id IS NOT NULL)
    )
);

-- A conversation's history (ConversationStarted) belongs to its tenant: erased with it.
ALTER TABLE experience_conversations ADD COLUMN tenant_id TEXT;
UPDATE experience_conversations c SET tenant_id = t.tenant_id
    FROM experience_turns t WHERE t.conversation_id = c.conversation_id;

-- A snapshot that retrains without forgotten tenants (`macaron tenants forget --retrain`) names
-- them: their records in its range are left out of its hash and its training.
ALTER TABLE dataset_snapshots ADD COLUMN left_out_tenants TEXT[] NOT NULL DEFAULT '{}';
