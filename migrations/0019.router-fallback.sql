-- depends: 0018.trigger-left-out
-- A router run that unlearns forgotten tenants replaces a router that must go whatever it
-- scores, so it is judged against the router it would fall back to: the newest ancestor of the
-- exposed one that was fitted on none of their labels (`server.unlearning`), not against the
-- exposed router itself, whose labels the refit may not keep.
ALTER TABLE router_runs
    ADD COLUMN judged_against TEXT REFERENCES router_versions (router_version);
