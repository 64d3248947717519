"""Tasks the loop writes itself: the model proposes new prompts of the bank's verifiable task
families, and a rule derives each prompt's checker from the prompt alone, never from an answer.

A *family* is a kind of prompt whose checker a rule can read off its words:
- ``genui-quoted``: a GenUI request that quotes what the tree must show ("a card titled 'Order
  shipped' that says 'Your parcel arrives on Friday'"); the checker asks for each quoted text;
- ``calculator``: an agent request to combine two numbers with one operation ("What is 45
  times 12?"); the checker asks for a calculator call that writes both numbers and the
  operation, and for its value, computed by the rule.

The writer is shown three of the family's bank prompts and asked for one more, with other words
and numbers. What it writes is kept only when the rule derives a checker from it and it is new:
not (nearly) a prompt of the bank, and not (nearly) a task of any contract version, which is
held out from everything trained on. Everything else is dropped and counted by reason, never
kept with an empty check.
"""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from core.canonical import canonical_json, sha256_hex
from core.engine import Engine, GenerationRequest, SamplingParams
from core.tasks import (
    NEAR_DUPLICATE,
    Calculation,
    Checker,
    GenUIChecker,
    Operator,
    Task,
    ToolCallChecker,
    prompt_words,
    word_overlap,
)

Family = Literal["genui-quoted", "calculator"]
FAMILIES: dict[Family, str] = {"genui-quoted": "genui", "calculator": "agent"}
"""Each family and the specialist whose tasks it writes."""
DropReason = Literal["no_checker", "copies_the_bank", "near_a_contract_task", "repeated"]
NO_REFERENCE = "(none: the loop wrote this task; its checker derives from the prompt)"
"""A written task's ``reference``: it has none, and nothing (no oracle, no training record)
ever reads one from it."""
EXAMPLES = 3
WRITER_VERSION = "writer-1"
WRITER_TEMPERATURE = 0.7
WRITER_TOKENS = 64
WRITER_CONCURRENCY = 16

_QUOTED = re.compile(r"""(?:^|(?<=[\s:(]))(['"])([^'"\n]{1,60}?)\1(?=[\s.,;:!?)]|$)""")
_SCREEN_THING = re.compile(
    r"(?i)\b(cards?|tables?|lists?|charts?|buttons?|forms?|pages?|banners?|badges?|panels?|"
    r"headings?|headers?|titles?|labels?|alerts?|notifications?|screens?|views?)\b"
)
MAX_PROMPT = 200
"""The longest prompt a rule reads a checker from: a request, not a story quoting a word."""
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.]*\d)")
_OPERATIONS: tuple[tuple[re.Pattern[str], Operator], ...] = (
    (re.compile(r"\b(plus|add|added to|sum of)\b"), "+"),
    (re.compile(r"\b(minus|subtract|subtracted from|take away)\b"), "-"),
    (re.compile(r"\b(times|multiplied by|multiply|product of)\b"), "*"),
    (re.compile(r"\b(divided by|divide|over)\b"), "/"),
)
_SIGNS: dict[str, Operator] = {
    "+": "+",
    "-": "-",
    "x": "*",
    "\u00d7": "*",  # the multiplication sign
    "*": "*",
    "/": "/",
    "\u00f7": "/",  # the division sign
}
_SIGN = re.compile("\\d\\s*([-+x*/\u00d7\u00f7])\\s*\\d")


def genui_checker(prompt: str) -> GenUIChecker | None:
    """The texts the prompt quotes (one to four, each with a letter), as a GenUI checker, when
    it is a request of the family: short, and naming a thing on a screen to make."""
    if len(prompt) > MAX_PROMPT or not _SCREEN_THING.search(prompt):
        return None
    quoted = [text.strip() for _, text in _QUOTED.findall(prompt)]
    quoted = list(dict.fromkeys(t for t in quoted if re.search(r"[A-Za-z]", t)))
    if not 1 <= len(quoted) <= 4:
        return None
    return GenUIChecker(kind="genui", must_contain=quoted)


def calculator_checker(prompt: str) -> ToolCallChecker | None:
    """Two numbers and one operation, named in words or by a sign between them, as a calculator
    call that must write both and the operation, and give the value the rule computes
    ("subtract A from B" is B - A)."""
    if len(prompt) > MAX_PROMPT:
        return None
    text = prompt.casefold()
    numbers = [float(n) for n in _NUMBER.findall(text)]
    operators = [op for pattern, op in _OPERATIONS if pattern.search(text)]
    operators += [_SIGNS[sign] for sign in _SIGN.findall(text)]
    if len(numbers) != 2 or len(operators) != 1:
        return None
    a, b = numbers
    op = operators[0]
    if op == "-" and re.search(r"\b(subtract|take away)\b.*\bfrom\b", text):
        a, b = b, a
    if op == "/" and b == 0:
        return None
    value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op]
    return ToolCallChecker(
        kind="tool_call",
        tool="calculator",
        result={"value": int(value) if value.is_integer() else value},
        calculation=Calculation(operands=[a, b], operators=[op]),
    )


def derive_checker(family: Family, prompt: str) -> Checker | None:
    """The checker the family's rule reads off ``prompt``, or ``None`` when it reads none."""
    return genui_checker(prompt) if family == "genui-quoted" else calculator_checker(prompt)


def family_examples(family: Family, bank: Sequence[Task]) -> list[Task]:
    """The bank tasks of the family: its specialist's, whose prompt the rule reads a checker
    of the same kind from."""
    specialist = FAMILIES[family]
    kind = "genui" if family == "genui-quoted" else "tool_call"
    return [
        task
        for task in bank
        if task.specialist == specialist
        and task.checker.kind == kind
        and derive_checker(family, task.prompt) is not None
    ]


def writing_prompt(family: Family, examples: Sequence[Task], rng: random.Random) -> str:
    """The writer's prompt: a numbered list of three of the family's bank prompts, with the
    next number to write (plain text, no chat template: a small model continues a list far
    better than it follows an instruction to write one, measured in ``bench/task_writing.py``)."""
    shown = rng.sample(list(examples), min(EXAMPLES, len(examples)))
    kind = (
        "Requests for a small screen, each quoting the texts it must show"
        if family == "genui-quoted"
        else "Requests to combine two numbers"
    )
    listed = "".join(f"{n}. {task.prompt}\n" for n, task in enumerate(shown, 1))
    return f"{kind}:\n{listed}{len(shown) + 1}."


def first_line(text: str) -> str:
    """What the writer proposed: its first line with text, without a list mark or quotes
    around the whole of it."""
    for line in text.splitlines():
        line = re.sub(r"^\s*(?:[-*•]|\d+[.)])\s*", "", line).strip()
        if len(line) >= 2 and line[0] == line[-1] and line[0] in "\"'":
            line = line[1:-1].strip()
        if line:
            return line[:300]
    return ""


@dataclass(frozen=True)
class Written:
    """One proposal and what became of it: kept as ``task``, or dropped for ``dropped``."""

    family: Family
    prompt: str
    task: Task | None
    dropped: DropReason | None


def judge_proposal(
    family: Family,
    prompt: str,
    bank: Sequence[Task],
    held_out: Sequence[Task],
    kept: Sequence[Task],
) -> Written:
    """Keep ``prompt`` as a task when the family's rule derives a checker from it and it is
    new: no (near) copy of a bank prompt, a task already kept, or a contract task."""
    checker = derive_checker(family, prompt) if prompt else None
    if checker is None:
        return Written(family, prompt, None, "no_checker")
    words = prompt_words(prompt)

    def near(tasks: Sequence[Task]) -> bool:
        return any(word_overlap(words, prompt_words(t.prompt)) >= NEAR_DUPLICATE for t in tasks)

    if near(held_out):
        return Written(family, prompt, None, "near_a_contract_task")
    if near(bank):
        return Written(family, prompt, None, "copies_the_bank")
    if near(kept):
        return Written(family, prompt, None, "repeated")
    digest = sha256_hex(canonical_json({"prompt": prompt, "checker": checker.model_dump()}))
    task = Task(
        id=f"written-{digest[:16]}",
        specialist=FAMILIES[family],
        prompt=prompt,
        checker=checker,
        reference=NO_REFERENCE,
    )
    return Written(family, prompt, task, None)


async def propose_tasks(
    engine: Engine,
    adapter: str | None,
    family: Family,
    bank: Sequence[Task],
    held_out: Sequence[Task],
    seeds: Sequence[int],
) -> list[Written]:
    """One proposal per seed from ``adapter`` on ``engine`` (three bank prompts of the family
    shown, chosen by the seed; the list's next line), each judged in order: kept as a task, or
    dropped."""
    examples = family_examples(family, bank)
    slots = asyncio.Semaphore(WRITER_CONCURRENCY)

    async def one(seed: int) -> str:
        prompt = writing_prompt(family, examples, random.Random(seed))  # noqa: S311
        request = GenerationRequest(
            request_id=f"writer-{seed}",
            prompt=prompt,
            adapter=adapter,
            params=SamplingParams(
                temperature=WRITER_TEMPERATURE,
                seed=seed,
                max_tokens=WRITER_TOKENS,
                stop=("\n",),
            ),
        )
        async with slots:
            return "".join([chunk.text async for chunk in engine.generate(request)])

    texts = await asyncio.gather(*(one(seed) for seed in seeds))
    written: list[Written] = []
    for text in texts:
        kept = [w.task for w in written if w.task is not None]
        written.append(judge_proposal(family, first_line(text), bank, held_out, kept))
    return written
