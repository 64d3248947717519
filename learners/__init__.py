"""Celery app and tasks: training recipes, dataset snapshots, the contract runner, adapter
export."""
