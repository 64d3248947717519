"""PostgreSQL adapters: the event log, processor positions, migrations."""
