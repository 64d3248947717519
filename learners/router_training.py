"""Router training, in one room: the labelled examples (the seed set and the follow-up suite
ship here), the fit of the router's classifier (a multinomial logistic regression over sentence
embeddings and hashed words, ``core.router_features``, as plain data,
``core.routing.RouterModel``, named by a digest of everything the fit depends on), the trainer
the router service and the learning loop retrain with, the router run.

A router run trains a successor classifier on the seed examples and every routing label of the
log up to the run's end, judges it against the router of the active release on the contract's
routing suite (``core.contract.decide_routing``), and, when it passes, registers it, files a
release naming it (adapters and harness unchanged) and has the serving process promote it.
``RouterEvaluated`` records the verdict either way.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, Self
from uuid import UUID

import torch
from pydantic import BaseModel, ConfigDict, Field

from core.canonical import canonical_json, sha256_hex
from core.contract import decide_routing
from core.errors import ContractInvalid
from core.events import NewEvent, RouterEvaluated, RoutingLabelled, SpecialistAdded
from core.ids import derived_id
from core.log import EventLog
from core.router_features import extra_features, word_features
from core.routing import (
    ROUTER_RUNS_KEY,
    ROUTING_KEY,
    SPECIALISTS_KEY,
    InsufficientTrainingData,
    RouterModel,
    RoutingError,
    UnknownSpecialist,
    decide,
)
from core.routing_labels import FollowUp, LabelledTurn, RouterFit, added_examples, labels_of
from infra.jsonl import load_jsonl
from infra.postgres.promotions import promoted_once, request_promotion, wait_for_request
from infra.postgres.registry import active_release, file_release
from infra.postgres.routers import (
    claim_router_run,
    finish_router_run,
    register_router,
    router_model,
    router_run,
)
from learners.contract_runner import load_contract
from learners.runtime import RunBusy, RunFailed, Runtime

EMBEDDER_NAME = "sentence-transformers/all-MiniLM-L6-v2, int8 linear layers"  # every fit's features
SEED_EXAMPLES = Path(__file__).resolve().with_name("routing-seed.jsonl")
FOLLOW_UPS = SEED_EXAMPLES.with_name("routing-followups.jsonl")


def load_examples(path: Path) -> list[LabelledTurn]:
    """Labelled turns from a JSON-lines file of ``{"text", "specialist"}`` objects."""
    return load_jsonl(path, LabelledTurn, RoutingError)


def load_follow_ups(path: Path = FOLLOW_UPS) -> list[FollowUp]:
    return load_jsonl(path, FollowUp, RoutingError)


def logged_labels(log: EventLog, end: Mapping[int, int] | None = None) -> list[RoutingLabelled]:
    """The routing labels of ``log`` up to ``end`` (default: its end now)."""
    events = log.read(key=ROUTING_KEY, end=end, types=["RoutingLabelled"])
    return [e.payload for e in events if isinstance(e.payload, RoutingLabelled)]


def router_fit(log: EventLog, specialists: Sequence[str]) -> RouterFit:
    """A fit of ``specialists`` with the examples of those added at run time, from ``log``."""
    events = log.read(key=SPECIALISTS_KEY, types=["SpecialistAdded"])
    added = added_examples(e.payload for e in events if isinstance(e.payload, SpecialistAdded))
    return RouterFit(
        specialists=tuple(specialists),
        added={name: texts for name, texts in added.items() if name in specialists},
    )


class TrainingConfig(BaseModel):
    """How the classifier is fitted.

    ``l2`` was chosen by 5-fold cross-validation on the seed set (about 90% at 1e-3, against
    89% at 1e-2 and 80% at 3e-2). Corrections count ``correction_weight`` times an ordinary
    example: a person said explicitly where the turn belongs. ``schema_version`` names the
    features (``core.router_features``): 2, the embedding and the turn's words, kept the
    held-out accuracy as labelled traffic grew where 1, the embedding alone, lost it
    (``bench/router.py``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1, 2] = 2
    l2: float = Field(default=1e-3, ge=0.0)
    max_iter: int = Field(default=100, ge=1, le=10_000)
    correction_weight: float = Field(default=4.0, gt=0.0)


def training_digest(
    examples: Sequence[LabelledTurn], specialists: Sequence[str], config: TrainingConfig
) -> str:
    """sha256 over everything a fit depends on besides the embedder's weights."""
    content = {
        "embedder": EMBEDDER_NAME,
        "config": config.model_dump(mode="json"),
        "specialists": list(specialists),
        "examples": [e.model_dump(mode="json") for e in examples],
    }
    return sha256_hex(canonical_json(content))


def check_training_set(examples: Sequence[LabelledTurn], specialists: Sequence[str]) -> None:
    """Every specialist needs an example, and every example a known specialist."""
    labelled = {e.specialist for e in examples}
    missing = [name for name in specialists if name not in labelled]
    if missing:
        raise InsufficientTrainingData(f"no training examples for specialists {missing}")
    unknown = sorted(labelled.difference(specialists))
    if unknown:
        raise UnknownSpecialist(f"training examples name unknown specialists {unknown}")


def fit_router(
    features: torch.Tensor,
    examples: Sequence[LabelledTurn],
    specialists: Sequence[str],
    config: TrainingConfig,
) -> RouterModel:
    """Multinomial logistic regression on ``features`` (one row per example), full batch LBFGS.

    Starts from zero weights (the loss is convex, so there is nothing random to seed) and
    weighs every specialist equally whatever its number of examples, so a specialist added with
    ten examples is not drowned by ones with sixty.
    """
    check_training_set(examples, specialists)
    index = {name: i for i, name in enumerate(specialists)}
    x = features.to(torch.float64)
    y = torch.tensor([index[e.specialist] for e in examples])
    weight = torch.tensor([e.weight for e in examples], dtype=torch.float64)
    per_class = torch.zeros(len(specialists), dtype=torch.float64).index_add_(0, y, weight)
    weight = weight / per_class[y] / len(specialists)

    w = torch.zeros(len(specialists), x.shape[1], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(len(specialists), dtype=torch.float64, requires_grad=True)
    optimiser = torch.optim.LBFGS(
        [w, b], lr=1.0, max_iter=config.max_iter, history_size=20, line_search_fn="strong_wolfe"
    )

    def loss() -> torch.Tensor:
        optimiser.zero_grad()
        logits = x @ w.T + b
        cross_entropy = torch.nn.functional.cross_entropy(logits, y, reduction="none")
        value = (weight * cross_entropy).sum() + config.l2 * (w * w).sum()
        value.backward()
        return value

    optimiser.step(loss)
    return RouterModel.create(
        specialists,
        w.detach().tolist(),
        b.detach().tolist(),
        training_digest(examples, specialists, config),
        config.schema_version,
    )


class Embedder(Protocol):
    """Sentence features, one unit-length row per text (``server.router.SentenceEmbedder``)."""

    def embed(self, texts: Sequence[str]) -> torch.Tensor: ...


class ClassifierTrainer:
    """Fits router classifiers (``core.routing.RouterTrainer``) on ``embedder``'s features:
    the base examples (the seed set's, or those given; with those a specialist was added with)
    and what routing experience taught. Each text is embedded once per trainer."""

    def __init__(
        self,
        embedder: Embedder,
        examples: Sequence[LabelledTurn],
        *,
        config: TrainingConfig | None = None,
    ) -> None:
        self._embedder = embedder
        self._config = config if config is not None else TrainingConfig()
        self._features: dict[str, torch.Tensor] = {}
        self._base = list(examples)
        self.specialists = tuple(dict.fromkeys(e.specialist for e in self._base))
        if not self.specialists:
            raise InsufficientTrainingData("the router needs examples of at least one specialist")

    @classmethod
    def from_seed(cls, embedder: Embedder, *, config: TrainingConfig | None = None) -> Self:
        """A trainer on the examples shipped with the code."""
        return cls(embedder, load_examples(SEED_EXAMPLES), config=config)

    def seed_model(self) -> RouterModel:
        """The classifier of the base examples alone, over every specialist they name."""
        return self._fit(self._base, self.specialists)

    def retrain(self, labels: Iterable[RoutingLabelled], fit: RouterFit) -> RouterModel:
        """A classifier of ``fit``'s specialists on their base examples (the seed set's, and
        those of specialists added at run time) plus the routing experience of them
        (``core.routing.labels_of``).

        Pass the whole window of the log each time: the result depends only on it, the fit and
        the seed set, so replaying the same log gives the same router version.
        """
        names = set(fit.specialists)
        added = [
            LabelledTurn(text=text, specialist=name)
            for name, texts in fit.added.items()
            if name in names
            for text in texts
        ]
        base = [e for e in self._base if e.specialist in names] + added
        missing = sorted(names - {e.specialist for e in base})
        if missing:
            raise InsufficientTrainingData(
                f"no examples of {', '.join(missing)}: the router learns a specialist from "
                "the seed set or from the examples it was added with"
            )
        weight = self._config.correction_weight
        learned = [t for t in labels_of(labels, correction_weight=weight) if t.specialist in names]
        return self._fit([*base, *learned], fit.specialists)

    def outcomes(self, model: RouterModel, turns: Sequence[LabelledTurn]) -> dict[str, list[bool]]:
        """Per specialist, whether each of its ``turns`` (in order) goes to it under ``model``,
        every specialist of ``model`` active (a turn of a specialist it lacks goes wrong)."""
        features = self._features_of([t.text for t in turns], model.schema_version).tolist()
        active = frozenset(model.specialists)
        found: dict[str, list[bool]] = {}
        for turn, row in zip(turns, features, strict=True):
            chosen = decide(row, model, active).specialist
            found.setdefault(turn.specialist, []).append(chosen == turn.specialist)
        return found

    def _fit(self, examples: Sequence[LabelledTurn], specialists: Sequence[str]) -> RouterModel:
        features = self._features_of([e.text for e in examples], self._config.schema_version)
        return fit_router(features, examples, specialists, self._config)

    def _features_of(self, texts: Sequence[str], schema_version: int) -> torch.Tensor:
        """The features of ``texts`` in ``schema_version``, each text embedded once per trainer
        (retraining is cheap)."""
        new = [t for t in dict.fromkeys(texts) if t not in self._features]
        if new:
            for text, row in zip(new, self._embedder.embed(new), strict=True):
                self._features[text] = row
        embedded = torch.stack([self._features[t] for t in texts])
        if not extra_features(schema_version):
            return embedded
        words = torch.tensor([word_features(t) for t in texts], dtype=embedded.dtype)
        return torch.cat([embedded, words], dim=1)


# --- the router run -----------------------------------------------------------------------------


PROMOTION_TIMEOUT_S = 300.0
LEASE_S = 600
"""A router run's lease: a worker that died mid-run leaves it to the next after this long."""


@dataclass(frozen=True)
class RouterOutcome:
    """What a router run ended as: ``refused``, ``promoted``, ``promotion failed``."""

    status: str
    router_version: str | None = None
    release_id: str | None = None


def train_router_run(rt: Runtime, run_id: UUID) -> RouterOutcome:
    """Train and judge the run's router successor, record the verdict, and have a release
    naming it promoted when it passed. A redelivered run that was judged already only records
    the verdict again and asks for the promotion it may lack; one a live worker holds is
    ``RunBusy``."""
    with rt.pool.connection() as conn, conn.transaction():
        run = claim_router_run(conn, run_id, LEASE_S)
        done = router_run(conn, run_id) if run is None else None
    if run is None:
        if done is None:
            raise RunFailed(f"no router run {run_id}")
        if done["status"] in ("queued", "running"):
            raise RunBusy(f"router run {run_id} is held by a worker whose lease is live")
        return _settled(rt, done)
    try:
        judged = _judged(rt, run)
    except Exception as exc:
        with rt.pool.connection() as conn, conn.transaction():
            finish_router_run(conn, run_id, status="failed", error=repr(exc)[:2000])
        raise
    return _settled(rt, judged)


def _judged(rt: Runtime, run: dict[str, Any]) -> dict[str, Any]:
    """Fit the successor, judge it against the active release's router, register it, file the
    release naming it when it passed; returns the run as recorded."""
    with rt.pool.connection() as conn:
        release = active_release(conn)
        parent = router_model(conn, release.router_version)
    contract = load_contract(rt.contract_path)
    if contract.routing is None:
        raise ContractInvalid(f"contract {contract.version} has no routing suite")
    suite_path = rt.contract_path.parent / contract.routing.suite
    suite = load_jsonl(suite_path, LabelledTurn, ContractInvalid)
    if not suite:
        raise ContractInvalid(f"{suite_path}: the routing suite has no turns")
    end = {int(p): o for p, o in run["labels_end"].items()}
    labels = logged_labels(rt.log, end)
    trainer = rt.router_trainer()
    candidate = trainer.retrain(labels, router_fit(rt.log, parent.specialists))
    judged = trainer.outcomes(candidate, suite), trainer.outcomes(parent, suite)
    decision = decide_routing(*judged, contract.routing)
    passed = decision.passed and candidate.version != parent.version
    child = release.successor(router_version=candidate.version) if passed else None
    evaluation = {
        "contract_version": contract.version,
        "labels": len(labels),
        "labels_left_out": sum(t.specialist not in parent.specialists for t in labels_of(labels)),
        "candidate_accuracy": _accuracy(judged[0]),
        "parent_accuracy": _accuracy(judged[1]),
        "gain": decision.gain,
        "p_value": decision.p_value,
        "recall_drops": decision.regressions,
        "reasons": decision.reasons or ([] if passed else ["the labels change nothing"]),
    }
    with rt.pool.connection() as conn, conn.transaction():
        register_router(conn, candidate, parent=parent.version)
        if child is not None:
            file_release(conn, child)
        finish_router_run(
            conn,
            run["run_id"],
            status="passed" if passed else "refused",
            parent=parent.version,
            router_version=candidate.version,
            release_id=None if child is None else child.release_id,
            evaluation=evaluation,
        )
        recorded = router_run(conn, run["run_id"])
    if recorded is None:
        raise RunFailed(f"router run {run['run_id']} is gone")
    return recorded


def _settled(rt: Runtime, run: dict[str, Any]) -> RouterOutcome:
    """Record the verdict of a judged run (again, for a redelivery: its id is derived) and ask
    for the promotion of a passed run's release unless it was promoted once (as it is, or
    rebased onto a release promoted since; a rollback since is the operator's word)."""
    if run["status"] not in ("passed", "refused"):
        return RouterOutcome(run["status"], run["router_version"], run["release_id"])
    rt.log.append([_evaluated(run)])
    if run["status"] == "refused":
        return RouterOutcome("refused", run["router_version"])
    with rt.pool.connection() as conn:
        if promoted_once(conn, run["release_id"]):  # perhaps rebased, perhaps rolled back since
            return RouterOutcome("promoted", run["router_version"], run["release_id"])
    by = f"router run {run['run_id']}"
    if run["left_out_tenants"]:
        by += f", which unlearns {len(run['left_out_tenants'])} forgotten tenant(s)"
    request = request_promotion(rt.pool, run["release_id"], requested_by=by)
    final = wait_for_request(rt.pool, request, PROMOTION_TIMEOUT_S)
    status = "promoted" if final["status"] == "done" else f"promotion {final['status']}"
    return RouterOutcome(status, run["router_version"], run["release_id"])


def _accuracy(outcomes: dict[str, list[bool]]) -> float:
    every = [ok for turns in outcomes.values() for ok in turns]
    return sum(every) / len(every)


def _evaluated(run: dict[str, Any]) -> NewEvent:
    """``RouterEvaluated`` from the run as recorded."""
    evaluation = run["evaluation"]
    return NewEvent(
        payload=RouterEvaluated(
            run_id=run["run_id"],
            router_version=run["router_version"],
            parent_router_version=run["parent_router_version"],
            contract_version=evaluation["contract_version"],
            candidate_accuracy=evaluation["candidate_accuracy"],
            parent_accuracy=evaluation["parent_accuracy"],
            passed=run["status"] == "passed",
            reasons=evaluation["reasons"],
            labels_left_out=evaluation.get("labels_left_out", 0),  # none counted before v2
        ),
        tenant_id="system",
        key=ROUTER_RUNS_KEY,
        event_id=derived_id("router-evaluated", run["run_id"]),
        causation_id=run["run_id"],
    )
