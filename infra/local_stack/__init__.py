"""The embedded local stack: real PostgreSQL, Redis (Valkey) and, for development and tests, a
Kafka-protocol broker (Tansu), all from wheels, on loopback, with state under ``MACARON_HOME``.

Each server runs as a detached process whose PID is kept in a file; ``down`` stops each one by
that PID.
"""

from infra.local_stack.process import free_port
from infra.local_stack.stack import ComponentStatus, LocalStack

__all__ = ["ComponentStatus", "LocalStack", "free_port"]
