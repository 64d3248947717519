"""Engines behind the ``Engine`` port (core/engine.py): the local multi-adapter engine
(``local/``) and the vLLM fleet (``vllm/``); what both use (prompts, the adapter table, grammars,
the shared foreground/background engine) lies here, and ``instant.py`` answers without a model."""
