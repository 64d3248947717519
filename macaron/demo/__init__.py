"""The learning-loop demo (``macaron demo``): the whole loop, generation after generation, on the
model and stack the settings name, with simulated users as the traffic.

It composes what ``macaron serve``, ``macaron streams run`` and ``macaron worker`` run: the chat
server (uvicorn on a free port of 127.0.0.1, in a thread), the stream processors (in a thread)
and a Celery worker (a ``macaron worker`` subprocess given the same settings as ``MACARON_*``
variables). Generation 0 is the contract score of the release active at the start. Each
generation then plays simulated users until the training trigger queues a run, waits until
every queued run is trained, evaluated under the contract and promoted or rejected, and
scores the release now active: as its evaluation recorded it, or else exactly as for generation
0 (the serving engine, greedy decoding, the contract's answer budgets). ``demo.json`` and
``demo.png`` in the output folder record every generation.

Simulated turns only need answers long enough to be judged (a GenUI tree or a tool call fits in
96 tokens; the oracle's edits do the teaching), so unless the settings say otherwise the demo
serves at most ``DEMO_MAX_NEW_TOKENS`` new tokens per step (``MACARON_MAX_NEW_TOKENS``), does
not rate-limit its own simulated users (``MACARON_TURNS_PER_MINUTE``: its server is private),
and trains with the CPU recipe ``learners/recipes/lora-cpu.yaml`` (``MACARON_TRAINING_CONFIG``).
"""

from macaron.demo.generations import DEMO_MAX_NEW_TOKENS, demo_settings, run_demo
from macaron.demo.options import DemoOptions
from macaron.demo.output import demo_table, generation_table, plot_scores, write_outputs
from macaron.demo.records import DemoFailed, DemoReport, GenerationRecord, RunRecord
from macaron.demo.stage import Stage, running_loop, worker_environment

__all__ = [
    "DEMO_MAX_NEW_TOKENS",
    "DemoFailed",
    "DemoOptions",
    "DemoReport",
    "GenerationRecord",
    "RunRecord",
    "Stage",
    "demo_settings",
    "demo_table",
    "generation_table",
    "plot_scores",
    "run_demo",
    "running_loop",
    "worker_environment",
    "write_outputs",
]
