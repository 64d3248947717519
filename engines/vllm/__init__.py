"""The vLLM side of the fleet engine: one replica's HTTP calls, its streamed completions, and
how its refusals map to typed errors."""
