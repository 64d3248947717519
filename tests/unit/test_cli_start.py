"""The command line starts without the model code: ``macaron --help`` and the commands that
only read the database or the log must not load torch, transformers or peft (ten seconds on
this machine); the commands that run a model import it where they build it."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "transformers", "peft", "vllm")


def test_importing_the_command_line_loads_no_model_code() -> None:
    probe = (
        "import sys, macaron.cli; "
        f"print(','.join(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    found = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert found.stdout.strip() == ""
