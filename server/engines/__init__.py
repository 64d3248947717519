"""Engines behind the ``Engine`` port (core/engine.py): the local multi-adapter engine."""
