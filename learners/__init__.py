"""The learning loop: the Celery tasks (``worker.py``) and their rooms: ``training/``, the
adapter recipe (``recipes/``), ``evaluation/``, ``rollouts/`` and ``routing/``."""
