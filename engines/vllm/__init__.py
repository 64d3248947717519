"""The vLLM fleet engine (``fleet.py``) and its replica side: one replica's HTTP calls, its
streamed completions, balancing, shared unloads, and how its refusals map to typed errors."""
