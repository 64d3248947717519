-- depends: 0020.adapter-erasures
-- The `turns` projection no longer copies what was said: a user's message and the answer (or
-- the edit that replaced it) were stored here in plaintext, read by no code path (a
-- conversation is rebuilt from the log, where they are sealed under the tenant's data key), and
-- a forget's DELETE left them in dead tuples and the write-ahead log. The projection keeps
-- the turn's facts: tenant, times, route, release, finish, latency, actions, feedback kinds.
ALTER TABLE turns DROP COLUMN content, DROP COLUMN answer;
