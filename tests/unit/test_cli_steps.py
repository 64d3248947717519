"""A long command that is not watched on a terminal still says where it is: one line on stderr
per new step, with the seconds since the start."""

from __future__ import annotations

import re

import pytest

from macaron.cli.common import err_console, steps


def test_off_a_terminal_each_new_step_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert not err_console.is_terminal  # pytest captures stderr
    with steps("starting") as step:
        for name in ("starting", "measuring", "measuring", "training: step 1 of 2", "measuring"):
            step(name)
    lines = capsys.readouterr().err.splitlines()
    assert [re.sub(r"^\[ *[0-9]+\.[0-9] s\] ", "", line) for line in lines] == [
        "starting",
        "measuring",
        "training: step 1 of 2",
        "measuring",
    ]
    assert all(re.match(r"^\[ *[0-9]+\.[0-9] s\] ", line) for line in lines)
