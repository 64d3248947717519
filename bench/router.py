"""Router: decision latency (embed + decide, one turn at a time) and held-out accuracy.

Trains the router on the seed set, then routes 50-word turns one at a time after a warm-up,
and scores every held-out turn. Targets and baselines:
- latency (lower is better): p99 <= 15 ms for embed + decide; the pure policy alone gets 1 ms of
  that. No baseline is natural, so the target stands in for it (ratio = value / target).
- accuracy: >= 90% on the held-out set (the target stands in for the baseline, as for latency),
  and above a multinomial naive Bayes over words trained on the same seed set in the same run.
- fitting the classifier on cached seed embeddings: well under a few seconds (<= 2 s).
The encoder runs with its linear layers in int8 (as the server runs it) and in float32 (the
baseline), turn by turn in alternation, so both see the same machine load; both on one intra-op
thread of their own (as the server runs them).
- under the server's thread budget: the same decisions while the local engine generates on
  SmolLM2-135M in its own thread (four answers at a time, as a busy server does): p99 <= 15 ms
  (``--no-engine`` skips it); and the int8 encoder on torch's own thread count, as it ran
  before it had a thread of its own, for comparison.
- accuracy after labelled traffic (issue 19): the seed router retrained on N turns of the task
  bank's prompts (the simulator's traffic, never in the seed or held-out sets), each labelled
  as the experience builder labels it: a ``correction`` when the router of the moment
  misrouted it, else a thumbs-up (``up``); N = 0, 50, 200; accuracy on the held-out file
  (>= 95 % after each) and on the bank prompts never labelled (>= 95 % after 200), baseline
  N = 0; and the same for routers of schema 1 (the embedding alone) on the same labels, against
  schema 2 (with the turn's words). The labels are built in memory as
  ``streams.routing_rules`` derives them, not read back from a log.
- the routing cascade (issue 62): the server's router (schema 3: a words head decides the turns
  it is sure of, the embedding only the rest) against schema 2 (every turn embedded), on the
  real turns of the split's routing files (``--split``: ``development``, the default, is
  ``routing-v1.jsonl`` and ``routing-dev.jsonl``; ``test`` is contract 5's sealed
  ``routing-test.jsonl``, for reporting only): decision p99 idle (<= 5 ms) and beside the
  busy engine (<= 10 ms), the share of turns decided without the embedding, and accuracy
  (within 1 point of schema 2's).

Usage: python -m bench.router [--decisions N] [--warmup W] [--threads T] [--no-engine]
       [--split development|test]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch
from transformers.utils import logging as transformers_logging

from bench.report import Row, report, row
from core.engine import GenerationRequest, SamplingParams
from core.events import RoutingLabelled
from core.router_cascade import decide_by_words
from core.router_features import router_features
from core.routing import RouterDecision, decide
from core.routing_labels import LabelledTurn
from core.settings import Settings
from engines.local.engine import LocalEngine
from learners.files import DATA
from learners.routing.training import (
    SEED_EXAMPLES,
    ClassifierTrainer,
    TrainingConfig,
    load_examples,
)
from learners.tasks import BANK_V1, load_bank
from macaron import wiring
from server.router import RouterService, SentenceEmbedder

HELDOUT = DATA / "routing-v1.jsonl"
SPLITS = {
    "development": (HELDOUT, DATA / "routing-dev.jsonl"),
    "test": (DATA / "routing-test.jsonl",),
}
CASCADE_IDLE_MS = 5.0
CASCADE_BUSY_MS = 10.0
TURN_WORDS = 50
P99_TARGET_MS = 15.0
POLICY_TARGET_MS = 1.0
ACCURACY_TARGET = 90.0
FIT_TARGET_MS = 2000.0
CORRECTED_TARGET = 95.0
TRAFFIC = (0, 50, 200)
BUSY_LABELS = ("engine busy", "float32, engine busy", "on torch's threads, engine busy")
_WORD = re.compile(r"[a-z0-9']+")


def fifty_word_turns(texts: Sequence[str], stride: int = 10) -> list[str]:
    """Windows of 50 consecutive words over the held-out turns run together: realistic words,
    every window a different turn."""
    words = " ".join(texts).split()
    return [
        " ".join(words[start : start + TURN_WORDS])
        for start in range(0, len(words) - TURN_WORDS + 1, stride)
    ]


def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def naive_bayes_accuracy(train: Sequence[LabelledTurn], test: Sequence[LabelledTurn]) -> float:
    """Multinomial naive Bayes over lower-cased words with add-one smoothing: what routing
    without embeddings gets from the same seed set."""
    counts: dict[str, Counter[str]] = {}
    for example in train:
        counts.setdefault(example.specialist, Counter()).update(_WORD.findall(example.text.lower()))
    vocabulary = set().union(*counts.values())
    priors = Counter(e.specialist for e in train)
    totals = {name: sum(c.values()) for name, c in counts.items()}

    def log_posterior(name: str, words: list[str]) -> float:
        denominator = totals[name] + len(vocabulary)
        likelihood = sum(math.log((counts[name][w] + 1) / denominator) for w in words)
        return math.log(priors[name] / len(train)) + likelihood

    right = 0
    for turn in test:
        words = [w for w in _WORD.findall(turn.text.lower()) if w in vocabulary]
        guess = max(sorted(counts), key=lambda name: log_posterior(name, words))
        right += guess == turn.specialist
    return right / len(test)


def time_decisions(
    routes: Sequence[Callable[[str], RouterDecision]],
    turns: Sequence[str],
    warmup: int,
    decisions: int,
) -> list[list[float]]:
    """Milliseconds per decision for each way of routing, one turn at a time, after ``warmup``
    untimed ones. The ways take turns on every text, so all see the same machine load."""
    for i in range(warmup):
        for route in routes:
            route(turns[i % len(turns)])
    latencies: list[list[float]] = [[] for _ in routes]
    for i in range(decisions):
        text = turns[i % len(turns)]
        for route, samples in zip(routes, latencies, strict=True):
            started = time.perf_counter()
            route(text)
            samples.append((time.perf_counter() - started) * 1000)
    return latencies


def latency_rows(label: str, latencies_ms: Sequence[float]) -> list[Row]:
    """p50 against the target; p99 with the p50 as its baseline (ratio = tail over median)."""
    p50, p99 = percentile(latencies_ms, 50), percentile(latencies_ms, 99)
    return [
        row(f"decision p50 ({label})", p50, "ms", p50, "report"),
        row(f"decision p99 ({label})", p99, "ms", p50, f"<= {P99_TARGET_MS:g} ms"),
    ]


def accuracy(route: Callable[[str], RouterDecision], turns: Sequence[LabelledTurn]) -> float:
    return 100 * sum(route(t.text).specialist == t.specialist for t in turns) / len(turns)


def router_on(
    embedder: SentenceEmbedder, seed: Sequence[LabelledTurn], schema_version: Literal[1, 2, 3] = 2
) -> RouterService:
    """A router service that starts with, and retrains on, the ``seed`` examples, fitting
    routers of ``schema_version``."""
    config = TrainingConfig(schema_version=schema_version)
    trainer = ClassifierTrainer(embedder, seed, config=config)
    return RouterService(embedder, trainer, trainer.seed_model())


def labelled_traffic(
    embedder: SentenceEmbedder, seed: Sequence[LabelledTurn], traffic: Sequence[LabelledTurn]
) -> list[RoutingLabelled]:
    """The labels ``traffic`` gives, turn by turn: a correction when the router of the moment
    (retrained after every 10 labels, as a loop would) misroutes the turn, else a thumbs-up."""
    router = router_on(embedder, seed)
    labels: list[RoutingLabelled] = []
    for n, turn in enumerate(traffic):
        if n and n % 10 == 0:
            router.retrain(labels)
        wrong = router.route(turn.text).specialist != turn.specialist
        labels.append(
            RoutingLabelled(
                label_id=uuid.uuid4(),
                turn_id=uuid.uuid4(),
                text=turn.text,
                specialist=turn.specialist,
                source="correction" if wrong else "up",
            )
        )
    return labels


Accuracies = dict[int, tuple[float, float]]


def accuracy_after_traffic(
    embedder: SentenceEmbedder, seed: Sequence[LabelledTurn], heldout: Sequence[LabelledTurn]
) -> tuple[Accuracies, Accuracies]:
    """Held-out accuracy, and accuracy on the bank prompts never labelled (the last 120 of
    them, shuffled with seed 0), of the seed router retrained on the labels of the first N:
    routers of schema 2 (the words beside the embedding), then of schema 1 (the embedding
    alone) on the same labels."""
    bank = [LabelledTurn(text=t.prompt, specialist=t.specialist) for t in load_bank(BANK_V1)]
    random.Random(0).shuffle(bank)
    labels = labelled_traffic(embedder, seed, bank[: max(TRAFFIC)])
    unseen = bank[max(TRAFFIC) :]
    found: tuple[Accuracies, Accuracies] = ({}, {})
    schemas: tuple[Literal[1, 2, 3], ...] = (2, 1)
    for schema_version, accuracies in zip(schemas, found, strict=True):
        for n in TRAFFIC:
            router = router_on(embedder, seed, schema_version)
            router.retrain(labels[:n])
            accuracies[n] = accuracy(router.route, heldout), accuracy(router.route, unseen)
    return found


class BusyEngine:
    """The local engine on SmolLM2-135M answering four requests at a time, in its own thread,
    until stopped: the load a router decision shares the CPU with in a busy server."""

    def __init__(self, model_dir: Path) -> None:
        self.engine = LocalEngine(model_dir)
        self.stop = threading.Event()
        self.tokens = 0
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        prompt = self.engine.chat_prompt([{"role": "user", "content": "Tell me about rivers."}])

        async def answer(n: int) -> None:
            request = GenerationRequest(
                request_id=f"busy-{n}", prompt=prompt, params=SamplingParams(max_tokens=64)
            )
            async for _ in self.engine.generate(request):
                self.tokens += 1

        n = 0
        while not self.stop.is_set():
            await asyncio.gather(*(answer(n + i) for i in range(4)))
            n += 4

    def __enter__(self) -> BusyEngine:
        self.thread.start()
        time.sleep(5)  # the first answers are under way
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join()
        self.engine.close()


def busy_latencies(
    routes: Sequence[Callable[[str], RouterDecision]],
    turns: Sequence[str],
    warmup: int,
    decisions: int,
) -> list[list[float]]:
    """``time_decisions`` while the engine generates beside them (``BusyEngine``)."""
    with BusyEngine(wiring.model_dir(Settings())) as busy:
        latencies = time_decisions(routes, turns, warmup, decisions)
    print(f"the engine generated {busy.tokens} tokens meanwhile")
    return latencies


def fit_time_ms(embedder: SentenceEmbedder, seed: Sequence[LabelledTurn]) -> float:
    """Milliseconds to fit the classifier on the seed set, embedded beforehand (the words
    hashed in the fit's time)."""
    trainer = ClassifierTrainer(embedder, seed)
    trainer.seed_model()  # embeds the seed set
    started = time.perf_counter()
    trainer.seed_model()
    return (time.perf_counter() - started) * 1000


def accuracy_rows(
    int8_accuracy: float,
    float_accuracy: float,
    baseline: float,
    after: tuple[Accuracies, Accuracies],
    fit_ms: float,
) -> list[Row]:
    """Held-out accuracy (int8, float32), after labelled traffic (schema 2; schema 1 on the
    same labels beside it), and the fit's time."""
    words, alone = after
    target = f">= {CORRECTED_TARGET:g} %"
    return [
        row(
            "held-out accuracy (vs word naive Bayes)",
            int8_accuracy,
            "%",
            baseline,
            f">= {ACCURACY_TARGET:g} %",
        ),
        row(
            "held-out accuracy, int8 (vs float32)",
            int8_accuracy,
            "%",
            float_accuracy,
            ">= 0.99x",
        ),
        *(
            row(
                f"{where} accuracy after {n} labelled traffic turns (vs none)",
                words[n][i],
                "%",
                words[0][i],
                target if where == "held-out" or n == max(TRAFFIC) else "report",
            )
            for n in TRAFFIC
            if n
            for i, where in enumerate(("held-out", "unlabelled traffic"))
        ),
        *(
            row(
                f"{where} accuracy after {n} labelled traffic turns, embedding alone (vs words)",
                alone[n][i],
                "%",
                words[n][i],
                "report",
            )
            for n in TRAFFIC
            for i, where in enumerate(("held-out", "unlabelled traffic"))
        ),
        row(
            "classifier fit on the seed set (embedded)",
            fit_ms,
            "ms",
            fit_ms,
            f"<= {FIT_TARGET_MS:g} ms",
        ),
    ]


def cascade_rows(
    embedder: SentenceEmbedder, seed: Sequence[LabelledTurn], args: argparse.Namespace
) -> list[Row]:
    """The cascade (schema 3) against schema 2 on the real turns of ``args.split``."""
    turns = [turn for path in SPLITS[args.split] for turn in load_examples(path)]
    texts = [turn.text for turn in turns]
    cascade, whole = router_on(embedder, seed, 3), router_on(embedder, seed, 2)
    idle = time_decisions([cascade.route, whole.route], texts, args.warmup, args.decisions)
    busy = (
        []
        if args.no_engine
        else busy_latencies([cascade.route, whole.route], texts, args.warmup, args.decisions)
    )
    by_words = sum(decide_by_words(t, cascade.model, cascade.active) is not None for t in texts)
    whole_accuracy = accuracy(whole.route, turns)
    label = f"{args.split} turns"
    rows = [
        row(
            f"cascade decision p99, idle, {label} (vs schema 2)",
            percentile(idle[0], 99),
            "ms",
            percentile(idle[1], 99),
            f"<= {CASCADE_IDLE_MS:g} ms",
        ),
        row(
            f"cascade decision p50, idle, {label} (vs schema 2)",
            percentile(idle[0], 50),
            "ms",
            percentile(idle[1], 50),
            "report",
        ),
        *(
            [
                row(
                    f"cascade decision p99, engine busy, {label} (vs schema 2)",
                    percentile(busy[0], 99),
                    "ms",
                    percentile(busy[1], 99),
                    f"<= {CASCADE_BUSY_MS:g} ms",
                )
            ]
            if busy
            else []
        ),
        row(
            f"{label} decided without the embedding, {len(texts)} (vs all)",
            100 * by_words / len(texts),
            "%",
            100.0,
            "report",
        ),
        row(
            f"cascade accuracy, {label} (vs schema 2; target: within 1 point of it)",
            accuracy(cascade.route, turns),
            "%",
            whole_accuracy,
            f">= {whole_accuracy - 1:.1f} %",
        ),
    ]
    print(
        f"cascade {cascade.version} (words head sure from {cascade.model.words.clear:g})"
        if cascade.model.words
        else ""
    )
    return rows


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=300, help="timed decisions (>= 200)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--no-engine", action="store_true", help="skip the rows under load")
    parser.add_argument(
        "--split",
        choices=sorted(SPLITS),
        default="development",
        help="the routing turns the cascade rows run on (test: contract 5's, to report only)",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    transformers_logging.disable_progress_bar()
    load_before = os.getloadavg()[0]
    if args.threads:
        torch.set_num_threads(args.threads)
    seed = load_examples(SEED_EXAMPLES)
    heldout = load_examples(HELDOUT)
    embedder = SentenceEmbedder()
    router = router_on(embedder, seed)
    float32 = SentenceEmbedder(int8=False)
    fit_ms = fit_time_ms(embedder, seed)
    turns = fifty_word_turns([t.text for t in heldout])
    schema = router.model.schema_version
    features = {text: router_features(schema, embedder.embed_one(text), text) for text in turns}

    float_router = router_on(float32, seed)
    unpinned = router_on(SentenceEmbedder(threads=None), seed)

    def route_float32(text: str) -> RouterDecision:
        return float_router.route(text)

    def policy_only(text: str) -> RouterDecision:
        return decide(features[text], router.model, router.active)

    int8_ms, float_ms, policy_ms = time_decisions(
        [router.route, route_float32, policy_only], turns, args.warmup, args.decisions
    )
    busy = [router.route, route_float32, unpinned.route]
    loaded = [] if args.no_engine else busy_latencies(busy, turns, args.warmup, args.decisions)
    int8_accuracy = accuracy(router.route, heldout)
    after = accuracy_after_traffic(embedder, seed, heldout)
    float_accuracy = accuracy(route_float32, heldout)
    baseline = 100 * naive_bayes_accuracy(seed, heldout)

    print(
        f"router {router.version}; {len(seed)} seed examples, {len(heldout)} held-out turns; "
        f"{args.decisions} decisions over {len(turns)} distinct {TURN_WORDS}-word turns; "
        f"torch threads: {torch.get_num_threads()}; "
        f"load average before the run {load_before:.2f} on {os.cpu_count()} CPUs"
    )
    rows: list[Row] = [
        *latency_rows("embed + decide", int8_ms),
        *latency_rows("float32 embed + decide", float_ms),
        row(
            "decision p99, int8 encoder (vs float32)",
            percentile(int8_ms, 99),
            "ms",
            percentile(float_ms, 99),
            "report",
        ),
        row(
            "policy p99 (decide only)",
            percentile(policy_ms, 99),
            "ms",
            percentile(policy_ms, 50),
            f"<= {POLICY_TARGET_MS:g} ms",
        ),
        *(
            line
            for label, samples in zip(BUSY_LABELS, loaded, strict=False)
            for line in latency_rows(f"embed + decide, {label}", samples)
        ),
        *(
            [
                row(
                    "decision p99, engine busy, one encoder thread (vs torch's count)",
                    percentile(loaded[0], 99),
                    "ms",
                    percentile(loaded[2], 99),
                    "report",
                )
            ]
            if loaded
            else []
        ),
        *accuracy_rows(int8_accuracy, float_accuracy, baseline, after, fit_ms),
        *cascade_rows(embedder, seed, args),
    ]
    path = report("router", rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
