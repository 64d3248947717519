"""The harness: deterministic tools the agent specialist calls, and their replayable state."""
