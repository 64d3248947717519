"""Stream processors: pure handlers and their hosts (faust over Kafka; a position-tracking
runner over the PostgreSQL log), projections and replay."""
