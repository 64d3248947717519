-- depends: 0014.run-kinds
-- Where a turn's words came in (`TurnReceived.front_end`, v7): `chat` (a person at a chat
-- client) or `openai` (a program, whose `model` field may be fixed in its code). Turns joined
-- before it was recorded have none.
ALTER TABLE experience_turns
    ADD COLUMN front_end TEXT CHECK (front_end IN ('chat', 'openai'));
