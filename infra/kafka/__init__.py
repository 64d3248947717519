"""Kafka adapters: the event log over a topic, and explicit topic creation."""
