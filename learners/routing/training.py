"""Router training: the labelled examples (the seed set and the follow-up suite ship here),
the fit of the router's classifier (a multinomial logistic regression over sentence embeddings
and hashed words, ``core.router_features``, as plain data, ``core.routing.RouterModel``, named
by a digest of everything the fit depends on), and the trainer the router service and the
learning loop (``learners.routing.run``) retrain with.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Literal, Protocol, Self

import torch
from pydantic import BaseModel, ConfigDict, Field

from core.canonical import canonical_json, sha256_hex
from core.events import RoutingLabelled, SpecialistAdded
from core.log import EventLog
from core.router_cascade import TurnContext, route_text
from core.router_features import extra_features, word_features
from core.routing import (
    FOLLOW_UP_CLEAR,
    ROUTING_KEY,
    SPECIALISTS_KEY,
    InsufficientTrainingData,
    RouterModel,
    RoutingError,
    UnknownSpecialist,
    WordsHead,
    following,
)
from core.routing_labels import FollowUp, LabelledTurn, RouterFit, added_examples, labels_of
from infra.jsonl import load_jsonl
from learners.files import DATA

EMBEDDER_NAME = "sentence-transformers/all-MiniLM-L6-v2, int8 linear layers"  # every fit's features
SEED_EXAMPLES = DATA / "routing-seed.jsonl"
FOLLOW_UPS = SEED_EXAMPLES.with_name("routing-followups.jsonl")
WORDS_CLEAR = 0.9
"""How sure a schema-3 router's words head must be to decide a turn alone (chosen on the
development split: ``bench/router.py``, ``docs/serving.md``, "Cascade")."""
WORDS_L2 = 1e-5
"""The words head's L2 penalty: lower makes it surer, and so decide more turns alone."""


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
    (``bench/router.py``); 3 routes as 2 does, after a classifier of the words alone
    (``core.routing.WordsHead``) that decides the turns it is at least ``words_clear`` sure of
    without the embedding.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1, 2, 3] = 3
    words_clear: float = Field(default=WORDS_CLEAR, ge=FOLLOW_UP_CLEAR, lt=1.0)
    words_l2: float = Field(default=WORDS_L2, ge=0.0)
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
    words: torch.Tensor | None = None,
) -> RouterModel:
    """The router of ``config``'s schema on ``features`` (one row per example), and for schema
    3 its words head on ``words`` (the examples' word features alone), each fitted by
    ``logistic_regression``."""
    weights, bias = logistic_regression(features, examples, specialists, config)
    head = None
    if config.schema_version == 3:
        if words is None:
            raise ValueError("a schema-3 router needs the examples' word features")
        head_config = config.model_copy(update={"l2": config.words_l2})
        head_weights, head_bias = logistic_regression(words, examples, specialists, head_config)
        head = WordsHead(
            weights=tuple(tuple(row) for row in head_weights),
            bias=tuple(head_bias),
            clear=config.words_clear,
        )
    return RouterModel.create(
        specialists,
        weights,
        bias,
        training_digest(examples, specialists, config),
        config.schema_version,
        head,
    )


def logistic_regression(
    features: torch.Tensor,
    examples: Sequence[LabelledTurn],
    specialists: Sequence[str],
    config: TrainingConfig,
) -> tuple[list[list[float]], list[float]]:
    """Multinomial logistic regression on ``features`` (one row per example), full batch LBFGS:
    a weight row and a bias per specialist.

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
    return w.detach().tolist(), b.detach().tolist()


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
        every specialist of ``model`` active (a turn of a specialist it lacks goes wrong), routed
        as the server routes it (``core.router_cascade.route_text``: a ``FollowUp`` after its
        previous turn)."""
        self._embed([t.text for t in turns])
        active = frozenset(model.specialists)
        found: dict[str, list[bool]] = {}
        for turn in turns:
            previous = turn.previous if isinstance(turn, FollowUp) else None
            chosen = route_text(
                turn.text,
                model,
                lambda text: self._features[text].tolist(),
                active,
                TurnContext(previous=following(turn.text, previous)),
            ).specialist
            found.setdefault(turn.specialist, []).append(chosen == turn.specialist)
        return found

    def _fit(self, examples: Sequence[LabelledTurn], specialists: Sequence[str]) -> RouterModel:
        texts = [e.text for e in examples]
        features = self._features_of(texts, self._config.schema_version)
        words = _words_of(texts) if self._config.schema_version == 3 else None
        return fit_router(features, examples, specialists, self._config, words)

    def _embed(self, texts: Sequence[str]) -> None:
        """Embed the ``texts`` not embedded yet (each text once per trainer)."""
        new = [t for t in dict.fromkeys(texts) if t not in self._features]
        if new:
            for text, row in zip(new, self._embedder.embed(new), strict=True):
                self._features[text] = row

    def _features_of(self, texts: Sequence[str], schema_version: int) -> torch.Tensor:
        """The features of ``texts`` in ``schema_version``, each text embedded once per trainer
        (retraining is cheap)."""
        self._embed(texts)
        embedded = torch.stack([self._features[t] for t in texts])
        if not extra_features(schema_version):
            return embedded
        return torch.cat([embedded, _words_of(texts).to(embedded.dtype)], dim=1)


def _words_of(texts: Sequence[str]) -> torch.Tensor:
    return torch.tensor([word_features(t) for t in texts])
