"""The router with real all-MiniLM-L6-v2 embeddings: accuracy on held-out turns it never trained
on, retraining from corrections, a specialist added at run time, hints."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from core.events import RoutingLabelled, RoutingSource
from core.router_features import WORD_BUCKETS
from core.routing import (
    DEFAULT_SPECIALISTS,
    InsufficientTrainingData,
    RouterInvalid,
    RouterModel,
    RoutingError,
)
from core.routing_labels import LabelledTurn, RouterFit
from learners.routing.training import (
    SEED_EXAMPLES,
    ClassifierTrainer,
    TrainingConfig,
    load_examples,
    load_follow_ups,
)
from macaron import wiring
from server.router import RouterService, SentenceEmbedder
from tests.numeric import assert_close

HELDOUT = Path(__file__).resolve().parents[2] / "learners" / "routing-v1.jsonl"
DIGEST = "0" * 64

LEGAL_EXAMPLES = (
    "Is a verbal agreement legally binding?",
    "My landlord kept my deposit without explanation, what are my rights?",
    "Can I be fired for posting about my employer on social media?",
    "What is the difference between a will and a living trust?",
    "Do I need a lawyer to file for divorce?",
    "Is it legal to record a phone call without telling the other person?",
    "What happens if I break my apartment lease early?",
    "Can a company use my photo in an ad without my permission?",
    "How does copyright apply to songs I cover on YouTube?",
    "What are my rights if I'm stopped by the police while driving?",
)
LEGAL_PROBES = [
    "My employer hasn't paid my overtime for three months, can I take legal action?",
    "Is the non-compete clause in my employment contract enforceable?",
    "Who is liable if my neighbour's tree falls on my car?",
    "Can my landlord enter my apartment without giving notice?",
    "What legal steps do I need to take to trademark my business name?",
]


def normalised(text: str) -> str:
    return " ".join(text.casefold().split())


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """On a shared CPU, torch's intra-op threads wait for each other whenever one is
    descheduled (hundreds of ms per turn on a busy two-core machine); one thread is steady."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def embedder() -> SentenceEmbedder:
    return SentenceEmbedder()


@pytest.fixture(scope="module")
def heldout() -> list[LabelledTurn]:
    return load_examples(HELDOUT)


@pytest.fixture(scope="module")
def seed_router(embedder: SentenceEmbedder) -> RouterService:
    """Shared by the tests that only route; tests that retrain build their own."""
    return wiring.seed_router(embedder)


@pytest.fixture
def router(embedder: SentenceEmbedder) -> Iterator[RouterService]:
    yield wiring.seed_router(embedder)


def accuracy(router: RouterService, turns: list[LabelledTurn]) -> float:
    right = sum(router.route(t.text).specialist == t.specialist for t in turns)
    return right / len(turns)


def test_the_heldout_set_is_large_balanced_and_never_trained_on(
    heldout: list[LabelledTurn],
) -> None:
    seed = load_examples(SEED_EXAMPLES)
    seed_counts = Counter(e.specialist for e in seed)
    heldout_counts = Counter(t.specialist for t in heldout)
    assert set(seed_counts) == set(heldout_counts) == set(DEFAULT_SPECIALISTS)
    assert min(seed_counts.values()) >= 30
    assert len(heldout) >= 200 and min(heldout_counts.values()) >= 50
    assert not {normalised(t.text) for t in heldout} & {normalised(e.text) for e in seed}
    assert len({normalised(t.text) for t in heldout}) == len(heldout), "no duplicate turns"


@pytest.mark.numeric
def test_embeddings_are_unit_length_mean_pooled_sentence_vectors(
    embedder: SentenceEmbedder,
) -> None:
    """Unit length and batched as alone, to float32's rounding. Guards the pooling: a vector
    left unnormalised, or padding averaged in (the attention mask ignored), is far off."""
    texts = ["How do I reverse a list in Python?", "Book me a table for two tonight, please."]
    exact = SentenceEmbedder(int8=False)
    batch = exact.embed(texts)  # batched (the int8 encoder embeds one text at a time)
    assert batch.shape == (2, 384)
    assert_close(batch.norm(dim=1), torch.ones(2), ulps=16)
    # padding the shorter text in a batch must not change its embedding (the mask is honoured)
    alone = torch.tensor([exact.embed_one(t) for t in texts], dtype=batch.dtype)
    assert_close(batch, alone, ulps=32)
    paraphrase = torch.tensor(embedder.embed_one("What's the way to invert a Python list?"))
    served = embedder.embed(texts)
    assert float(paraphrase @ served[0]) > float(paraphrase @ served[1]) + 0.3
    assert torch.equal(served[1], torch.tensor(embedder.embed_one(texts[1])))


@pytest.mark.numeric
def test_the_int8_encoder_embeds_as_the_float32_one(embedder: SentenceEmbedder) -> None:
    exact = SentenceEmbedder(int8=False)
    for text in ["Show me a chart of my sleep", "Why is the sky blue?", "Email Ana the slides"]:
        int8, float32 = torch.tensor(embedder.embed_one(text)), torch.tensor(exact.embed_one(text))
        assert float(int8 @ float32) > 0.9  # unit vectors: the cosine


@pytest.mark.numeric
@pytest.mark.usefixtures("two_torch_threads")
def test_an_embedder_runs_on_its_own_threads_and_leaves_torchs_count_to_the_others() -> None:
    """Its passes use one intra-op thread (or torch's count when it is given none: two here),
    while the thread that made it, and a thread that starts afterwards (as the engine's does),
    keep torch's count. The embedding on one thread is the embedding on two, to float32's
    rounding: guards a pass whose result depends on the threads it ran on."""
    count = torch.get_num_threads()
    assert count == 2
    pinned, unpinned = SentenceEmbedder(), SentenceEmbedder(threads=None)
    assert (pinned.threads, unpinned.threads, torch.get_num_threads()) == (1, count, count)
    later: list[int] = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert later == [count]
    one, two = (torch.tensor(e.embed_one("Why is the sky blue?")) for e in (pinned, unpinned))
    assert_close(one, two, ulps=16)


@pytest.mark.numeric
def test_heldout_accuracy_of_the_seed_router(
    seed_router: RouterService, heldout: list[LabelledTurn]
) -> None:
    decisions = [seed_router.route(t.text) for t in heldout]
    right = Counter(
        t.specialist
        for t, d in zip(heldout, decisions, strict=True)
        if d.specialist == t.specialist
    )
    total = Counter(t.specialist for t in heldout)
    assert sum(right.values()) / len(heldout) >= 0.90
    for specialist in DEFAULT_SPECIALISTS:
        assert right[specialist] / total[specialist] >= 0.80, specialist
    assert all(d.reason == "classifier" for d in decisions)
    assert all(d.router_version == seed_router.version for d in decisions)


def test_a_router_of_schema_1_still_loads_and_routes_on_the_embedding_alone(
    embedder: SentenceEmbedder, heldout: list[LabelledTurn]
) -> None:
    """Routers fitted before the words (schema 1) are served as they were: their decisions
    read the embedding alone. New fits are schema 3, and a router made for another embedder
    is refused."""
    router = wiring.seed_router(embedder)
    assert router.model.schema_version == 3
    assert router.model.dim == embedder.dim + WORD_BUCKETS
    seed = load_examples(SEED_EXAMPLES)
    old = ClassifierTrainer(embedder, seed, config=TrainingConfig(schema_version=1)).seed_model()
    assert (old.schema_version, old.dim) == (1, embedder.dim)
    router.serve_model(old)
    decided = [router.route(t.text) for t in heldout]
    assert {d.router_version for d in decided} == {old.version}
    old_accuracy = sum(d.specialist == t.specialist for d, t in zip(decided, heldout, strict=True))
    assert old_accuracy / len(heldout) >= 0.90
    narrow = RouterModel.create(old.specialists, [r[:8] for r in old.weights], old.bias, DIGEST)
    with pytest.raises(RouterInvalid, match="embeddings of 8 features"):
        router.serve_model(narrow)
    assert router.version == old.version


def test_follow_ups_stay_and_changes_of_subject_leave(seed_router: RouterService) -> None:
    """The multi-turn suite (40 short follow-ups, 20 changes of subject) routed with the
    previous turn's specialist: >= 90 % right (56 of 60 measured), against 33 on the message
    alone."""
    cases = load_follow_ups()
    assert len(cases) == 60 and sum(c.previous == c.specialist for c in cases) == 40
    alone = sum(seed_router.route(c.text).specialist == c.specialist for c in cases)
    decided = [seed_router.route(c.text, previous=c.previous) for c in cases]
    right = sum(d.specialist == c.specialist for d, c in zip(decided, cases, strict=True))
    print(f"follow-ups: {right} of 60 right with the previous turn, {alone} alone")
    assert right >= 54 and right > alone
    assert {d.reason for d in decided} == {"classifier", "follow_up"}
    long = [d for d, c in zip(decided, cases, strict=True) if len(c.text.split()) > 6]
    assert long and all(d.previous is None for d in long)


def test_training_is_deterministic(embedder: SentenceEmbedder, seed_router: RouterService) -> None:
    again = wiring.seed_router(embedder)
    assert again.version == seed_router.version
    assert again.model == seed_router.model


def test_a_hint_overrides_the_classifier(seed_router: RouterService) -> None:
    text = "Write a Python function that merges two sorted lists."
    assert seed_router.route(text).specialist == "coding"
    hinted = seed_router.route(text, hint="genui")
    assert (hinted.specialist, hinted.reason) == ("genui", "hint")
    assert seed_router.route(text, hint="nonexistent").specialist == "coding"


def label(text: str, specialist: str, source: RoutingSource) -> RoutingLabelled:
    turn_id = uuid.uuid4()
    return RoutingLabelled(
        label_id=turn_id, turn_id=turn_id, text=text, specialist=specialist, source=source
    )


def test_corrections_retrain_the_router(router: RouterService) -> None:
    corrected = "Give me my calendar for next week"
    first = router.route(corrected)
    assert first.specialist == "agent", "precondition: the seed router sends it to agent"
    before = router.version
    assert router.retrain([]).version == before  # no experience: the seed's classifier

    # labels of a specialist the router does not cover are left out
    assert router.retrain([label(corrected, "poetry", "correction")]).version == before

    labels = [
        label(corrected, "genui", "correction"),
        label("Plot my running pace per km", "genui", "up"),
    ]
    model = router.retrain(labels)
    assert model.version != before
    after = router.route(corrected)
    assert after.specialist == "genui"
    assert after.router_version == model.version != first.router_version
    assert router.retrain(labels).version == model.version  # the same log, the same router

    # a specialist added later keeps what the corrections taught
    fit = RouterFit(specialists=(*router.specialists, "legal"), added={"legal": LEGAL_EXAMPLES})
    router.retrain(labels, fit)
    assert router.route(corrected).specialist == "genui"


def test_a_specialist_added_at_run_time_gets_its_turns(
    router: RouterService, heldout: list[LabelledTurn]
) -> None:
    seed, before = router.specialists, router.version
    fit = RouterFit(specialists=(*seed, "legal"), added={"legal": LEGAL_EXAMPLES})
    added = router.retrain([], fit)
    assert added.version != before
    assert "legal" in router.active and router.specialists[-1] == "legal"
    for probe in LEGAL_PROBES:
        decision = router.route(probe)
        assert decision.specialist == "legal", probe
        assert set(decision.scores) == {*DEFAULT_SPECIALISTS, "legal"}
    assert accuracy(router, heldout) >= 0.88, "the old specialists still get their turns"

    # disabled: a fit that leaves it out, though its examples are still known
    assert router.retrain([], RouterFit(specialists=seed, added=fit.added)).version == before
    for probe in LEGAL_PROBES:
        decision = router.route(probe, hint="legal")
        assert decision.specialist != "legal"
        assert "legal" not in decision.scores
    assert router.retrain([], fit).version == added.version  # enabled again: the same router
    assert router.route(LEGAL_PROBES[0]).specialist == "legal"

    with pytest.raises(InsufficientTrainingData, match="astrology"):
        router.retrain([], RouterFit(specialists=(*seed, "astrology")))


def test_a_malformed_examples_file_is_a_typed_error(tmp_path: Path) -> None:
    bad = tmp_path / "examples.jsonl"
    bad.write_text('{"text": "hi", "specialist": "chat"}\n{"text": "", "specialist": "Chat!"}\n')
    with pytest.raises(RoutingError) as caught:
        load_examples(bad)
    assert caught.value.code == "routing_error" and "examples.jsonl:2" in caught.value.message
