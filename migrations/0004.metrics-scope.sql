-- depends: 0003.streams
-- A third key scope, `metrics`: what a Prometheus scraper gets (the /metrics endpoints of the
-- server, the stream processors and the workers), and nothing else.
ALTER TABLE api_keys DROP CONSTRAINT api_keys_scopes_check;
ALTER TABLE api_keys ADD CONSTRAINT api_keys_scopes_check
    CHECK (scopes <@ ARRAY['chat', 'admin', 'metrics']::TEXT[] AND cardinality(scopes) > 0);
