"""Adapters to the outside world (PostgreSQL, Kafka, Redis, the embedded local stack)."""
