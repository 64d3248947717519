"""Engines behind the ``Engine`` port (core/engine.py): the local multi-adapter engine
(``local.py``) and the vLLM fleet (``fleet.py``, with its replica side in ``vllm/``)."""
