"""Harness successors the loop proposes beside adapter successors, one change at a time, each
judged by the contract like a trained adapter:

- ``grammar``: enforce the specialist's output grammar at decode time, or stop enforcing it;
- ``tool_choice``: where the grammar is enforced and the specialist calls tools, require a tool
  call as a turn's first step, or stop requiring it;
- ``exemplars``: few-shot exemplars mined from the specialist's verified rollouts on the
  project's own prompts (never a tenant's words), well-formed for its output kinds;
- ``prompt``: the next variant of the specialist's system prompt.

A specialist's proposals take the changes that apply to it in turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from core.harness.artifact import MAX_EXEMPLAR_CHARS, Exemplar, HarnessSpec, SpecialistHarness
from core.harness.genui import parse_genui_output
from core.harness.hcp import tool_call_of

Change = Literal["grammar", "tool_choice", "exemplars", "prompt"]
RECIPE_PREFIX = "harness."
"""A harness run's recipe is ``harness.<change>``: it names the change to propose (the run's
``kind`` says that it proposes a harness)."""
EXEMPLARS = 2
"""Exemplars a proposal shows: each costs prompt tokens on every turn of the specialist."""

PROMPT_VARIANTS: dict[str, tuple[str, ...]] = {
    "chat": (
        "You are Macaron, a helpful assistant. Answer the question directly, in a sentence or two.",
    ),
    "agent": (
        "You are Macaron's agent, with tools. When a tool can answer, reply with only the JSON "
        'object {"tool": NAME, "args": {...}} for it, with the arguments the user gave; after '
        "its result, answer the user in plain text.",
    ),
    "coding": (
        "You are Macaron's coding assistant. Reply with one ```python fenced block that "
        "defines exactly what was asked, then one sentence.",
    ),
    "genui": (
        "You are Macaron's interface designer. Reply with exactly one JSON component tree from "
        "the catalogue below, nothing before or after it, and put the words the user asked "
        "for in its text.",
    ),
}


def changes(spec: HarnessSpec, specialist: str) -> list[Change]:
    """The changes a proposal for ``specialist`` may make, in the order they are taken."""
    own = spec.for_specialist(specialist)
    found: list[Change] = []
    if set(own.output) - {"text"}:
        found.append("grammar")
    if own.enforce_grammar and "tool_call" in own.output:
        found.append("tool_choice")
    found.append("exemplars")
    if PROMPT_VARIANTS.get(specialist):
        found.append("prompt")
    return found


def next_change(spec: HarnessSpec, specialist: str, proposed_before: int) -> Change:
    """The change of ``specialist``'s next proposal, after ``proposed_before`` earlier ones."""
    options = changes(spec, specialist)
    return options[proposed_before % len(options)]


def propose(
    spec: HarnessSpec,
    specialist: str,
    change: Change,
    *,
    examples: Sequence[Exemplar],
    attempt: int,
) -> HarnessSpec | None:
    """``spec`` with ``change`` made to ``specialist``'s harness, or ``None`` when the change
    has nothing to make (no verified example to show, no other prompt)."""
    own = spec.for_specialist(specialist)
    updated: SpecialistHarness
    if change == "grammar":
        updated = own.model_copy(update={"enforce_grammar": not own.enforce_grammar})
    elif change == "tool_choice":
        if "tool_call" not in own.output:
            return None
        required = "auto" if own.tool_choice == "required" else "required"
        updated = own.model_copy(update={"tool_choice": required})
    elif change == "exemplars":
        chosen = tuple(examples[:EXEMPLARS])
        if not chosen or chosen == own.exemplars:
            return None
        updated = own.model_copy(update={"exemplars": chosen})
    else:
        variants = [p for p in PROMPT_VARIANTS.get(specialist, ()) if p != own.system_prompt]
        if not variants:
            return None
        updated = own.model_copy(update={"system_prompt": variants[attempt % len(variants)]})
    return spec.model_copy(update={"specialists": {**spec.specialists, specialist: updated}})


def exemplar_of(spec: HarnessSpec, specialist: str, user: str, answer: str) -> Exemplar | None:
    """A verified answer as an exemplar for ``specialist``, if it fits: not too long, and of a
    form the specialist answers in (a GenUI tree that validates, a call of one of the harness's
    tools, or text where text is allowed)."""
    user, answer = user.strip(), answer.strip()
    if not user or not answer or max(len(user), len(answer)) > MAX_EXEMPLAR_CHARS:
        return None
    kinds = spec.for_specialist(specialist).output
    call = tool_call_of(answer)
    formed = (
        ("genui" in kinds and parse_genui_output(answer).valid)
        or ("tool_call" in kinds and call is not None and call.tool in _tools(spec))
        or ("text" in kinds and call is None and not answer.startswith("{"))
    )
    return Exemplar(user=user, assistant=answer) if formed else None


def _tools(spec: HarnessSpec) -> set[str]:
    return {tool.name for tool in spec.tools}
