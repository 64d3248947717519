"""Router: what the turn's context adds to the message alone, for the seed router.

- Follow-ups: the 60 cases of ``learners/routing-followups.jsonl`` (40 short follow-ups, 20
  changes of subject) routed with the specialist of the conversation's previous turn, against
  the message alone (the baseline); target (issue 36) >= 90 %.
- Client tools: the task bank's agent prompts routed as a request with client tools
  (``tool_callers`` = the agent), against the message alone; and the held-out turns of the
  other specialists, which tools must not pull away when the text clearly asks for them.

Usage: python -m bench.router_context
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from transformers.utils import logging as transformers_logging

from bench.report import Row, report, row
from bench.router import HELDOUT
from core.routing import RouterDecision
from core.routing_labels import LabelledTurn
from learners.routing.training import load_examples, load_follow_ups
from learners.tasks import BANK_V1, load_bank
from macaron import wiring
from server.router import SentenceEmbedder

TOOL_CALLERS = ("agent",)  # the specialists whose harness@0 output includes tool_call


def share(route: Callable[[str], RouterDecision], turns: Sequence[LabelledTurn]) -> float:
    """The per cent of ``turns`` routed to their specialist."""
    return 100 * sum(route(t.text).specialist == t.specialist for t in turns) / len(turns)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    transformers_logging.disable_progress_bar()
    router = wiring.seed_router(SentenceEmbedder())
    follow_ups = load_follow_ups()
    with_previous = (
        100
        * sum(
            router.route(c.text, previous=c.previous).specialist == c.specialist for c in follow_ups
        )
        / len(follow_ups)
    )
    agent = [
        LabelledTurn(text=t.prompt, specialist=t.specialist)
        for t in load_bank(BANK_V1)
        if t.specialist == "agent"
    ]
    others = [t for t in load_examples(HELDOUT) if t.specialist not in TOOL_CALLERS]

    def with_tools(text: str) -> RouterDecision:
        return router.route(text, tool_callers=TOOL_CALLERS)

    rows: list[Row] = [
        row(
            f"multi-turn follow-ups, {len(follow_ups)} cases (vs the message alone)",
            with_previous,
            "%",
            share(router.route, follow_ups),
            ">= 90 %",
        ),
        row(
            f"bank agent prompts to the agent with client tools, {len(agent)} (vs alone)",
            share(with_tools, agent),
            "%",
            share(router.route, agent),
            "report",
        ),
        row(
            f"held-out turns of other specialists kept with client tools, {len(others)} (vs alone)",
            share(with_tools, others),
            "%",
            share(router.route, others),
            "report",
        ),
    ]
    print(f"wrote {report('router_context', rows)}")


if __name__ == "__main__":
    main()
