"""The pure routing policy: decisions, hints, active specialists, typed errors, labels from the
log. The classifiers here are small hand-written models: what the policy does with a model does
not depend on how the model was trained."""

from __future__ import annotations

import itertools
import math
import uuid

import pytest
from pydantic import ValidationError

from core.errors import MacaronError
from core.events import (
    UPCASTERS,
    HarnessStamp,
    NewEvent,
    RouterDecided,
    RouterEvaluated,
    RoutingLabelled,
    RoutingSource,
)
from core.mapper import Mapper
from core.router_cascade import TurnContext, decide_by_words, route_text
from core.router_features import WORD_BUCKETS, router_features, word_buckets, word_features
from core.routing import (
    CLEARLY_OTHER,
    DEFAULT_SPECIALISTS,
    FOLLOW_UP_CLEAR,
    InvalidFeatures,
    InvalidSpecialistName,
    NoActiveSpecialist,
    RouterDecision,
    RouterModel,
    UnknownSpecialist,
    WordsHead,
    decide,
    following,
    specialist_name,
)
from core.routing_labels import API_MODEL_WEIGHT, LabelledTurn, labels_of

DIGEST = "0" * 64


def one_hot_model(specialists: tuple[str, ...] = DEFAULT_SPECIALISTS) -> RouterModel:
    """Feature ``i`` votes for specialist ``i``: the features say which one should win."""
    n = len(specialists)
    weights = [[4.0 if row == col else 0.0 for col in range(n)] for row in range(n)]
    return RouterModel.create(specialists, weights, [0.0] * n, DIGEST)


def towards(index: int, dim: int = 4) -> list[float]:
    return [1.0 if i == index else 0.0 for i in range(dim)]


MODEL = one_hot_model()
ALL = frozenset(DEFAULT_SPECIALISTS)


def test_classifier_picks_the_most_probable_and_scores_every_active_specialist() -> None:
    decision = decide(towards(2), MODEL, ALL)
    assert decision.specialist == "coding"
    assert decision.reason == "classifier"
    assert decision.router_version == MODEL.version
    assert set(decision.scores) == ALL
    assert math.isclose(sum(decision.scores.values()), 1.0, abs_tol=1e-12)
    assert decision.scores["coding"] == max(decision.scores.values())
    # softmax of logits (4, 0, 0, 0)
    assert math.isclose(decision.scores["coding"], math.exp(4) / (math.exp(4) + 3))


def test_scores_sum_to_one_for_any_features_and_active_set() -> None:
    grid = [-3.0, -0.5, 0.0, 0.7, 2.5]
    for features in itertools.product(grid, repeat=4):
        for size in (2, 3, 4):
            for active in itertools.combinations(DEFAULT_SPECIALISTS, size):
                decision = decide(list(features), MODEL, active)
                assert set(decision.scores) == set(active)
                assert math.isclose(sum(decision.scores.values()), 1.0, abs_tol=1e-9)
                assert decision.specialist in active


def test_a_hint_naming_an_active_specialist_wins() -> None:
    by_classifier = decide(towards(2), MODEL, ALL)
    hinted = decide(towards(2), MODEL, ALL, hint="genui")
    assert hinted.specialist == "genui"
    assert hinted.reason == "hint"
    assert hinted.scores == by_classifier.scores, "the log keeps what the classifier said"


@pytest.mark.parametrize("hint", ["genui", "no-such-specialist"])
def test_a_hint_naming_an_inactive_or_unknown_specialist_is_ignored(hint: str) -> None:
    decision = decide(towards(3), MODEL, {"chat", "coding"}, hint=hint)
    assert decision.reason == "classifier"
    assert decision.specialist in {"chat", "coding"}


def test_an_inactive_specialist_is_never_chosen() -> None:
    active = ALL - {"coding"}
    for strength in (0.5, 5.0, 50.0, 500.0):
        features = [strength * x for x in towards(2)]
        decision = decide(features, MODEL, active)
        assert decision.specialist != "coding"
        assert "coding" not in decision.scores
        assert decide(features, MODEL, active, hint="coding").specialist != "coding"


def test_a_lone_active_specialist_is_chosen_outright() -> None:
    decision = decide(towards(0), MODEL, {"genui"}, hint="chat")
    assert decision.specialist == "genui"
    assert decision.reason == "only_specialist"
    assert decision.scores == {"genui": 1.0}


def test_a_specialist_added_at_run_time_can_be_chosen() -> None:
    extended = one_hot_model((*DEFAULT_SPECIALISTS, "legal"))
    decision = decide(towards(4, dim=5), extended, {*DEFAULT_SPECIALISTS, "legal"})
    assert decision.specialist == "legal"
    assert decision.reason == "classifier"
    assert decide(towards(1, dim=5), extended, ALL | {"legal"}, hint="legal").specialist == "legal"


def test_ties_go_to_the_earlier_specialist_of_the_model() -> None:
    decision = decide([0.0] * 4, MODEL, ALL)
    assert decision.specialist == "chat"
    assert all(math.isclose(p, 0.25) for p in decision.scores.values())


def test_wrong_feature_dimension_is_a_typed_error() -> None:
    with pytest.raises(InvalidFeatures) as caught:
        decide([0.1] * 5, MODEL, ALL)
    assert caught.value.code == "invalid_features"
    assert isinstance(caught.value, MacaronError)
    assert "takes 4 features, not 5" in caught.value.message
    with pytest.raises(InvalidFeatures):
        decide([], MODEL, ALL)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_features_are_a_typed_error(bad: float) -> None:
    with pytest.raises(InvalidFeatures):
        decide([0.0, bad, 0.0, 0.0], MODEL, ALL)


def test_an_empty_active_set_is_a_typed_error() -> None:
    with pytest.raises(NoActiveSpecialist) as caught:
        decide(towards(0), MODEL, set())
    assert caught.value.code == "no_active_specialist"
    assert isinstance(caught.value, MacaronError)


def test_an_active_specialist_unknown_to_the_classifier_is_a_typed_error() -> None:
    with pytest.raises(UnknownSpecialist) as caught:
        decide(towards(0), MODEL, {"chat", "legal"})
    assert caught.value.code == "unknown_specialist"


def test_specialist_names_must_fit_adapter_names() -> None:
    assert specialist_name("data-viz_2") == "data-viz_2"
    for bad in ("", "Coding", "2fast", "coding@7", "x" * 65):
        with pytest.raises(InvalidSpecialistName) as caught:
            specialist_name(bad)
        assert caught.value.code == "invalid_specialist_name"


# --- the classifier as data ------------------------------------------------------------------


def test_router_version_is_a_content_hash() -> None:
    assert one_hot_model().version == MODEL.version
    assert MODEL.version.startswith("router-") and len(MODEL.version) == len("router-") + 12
    nudged = RouterModel.create(
        MODEL.specialists, MODEL.weights, [0.0, 0.0, 0.0, 1e-9], MODEL.training_digest
    )
    assert nudged.version != MODEL.version
    other_data = RouterModel.create(MODEL.specialists, MODEL.weights, MODEL.bias, "1" * 64)
    assert other_data.version != MODEL.version


def test_a_model_of_schema_2_scores_the_embedding_and_the_words() -> None:
    """Schema 2 adds the turn's hashed words to the embedding; a model stored before schemas
    existed is schema 1 with the version it had; an unknown schema does not validate."""
    words = word_features("Plot my running pace per km, per km")
    assert len(words) == WORD_BUCKETS and math.isclose(math.fsum(w * w for w in words), 1.0)
    assert words == word_features("plot MY running pace per km per km!")  # case, punctuation
    assert sum(w > 0 for w in words) == 6 + 6  # distinct words and distinct pairs of words
    assert word_features("") == [0.0] * WORD_BUCKETS
    embedding = [0.5, 0.5, 0.5, 0.5]
    assert router_features(1, embedding, "hi there") == embedding
    assert router_features(2, embedding, "hi there") == [*embedding, *word_features("hi there")]

    wide = [[*row, *([0.0] * WORD_BUCKETS)] for row in MODEL.weights]
    two = RouterModel.create(MODEL.specialists, wide, MODEL.bias, DIGEST, schema_version=2)
    assert (two.dim, two.embedding_dim) == (4 + WORD_BUCKETS, 4)
    features = router_features(2, towards(1), "draw a chart of my pace")
    assert decide(features, two, ALL).specialist == MODEL.specialists[1]
    as_one = RouterModel.create(MODEL.specialists, wide, MODEL.bias, DIGEST)
    assert as_one.version != two.version  # the schema is part of the content

    stored = MODEL.model_dump(mode="json")
    del stored["schema_version"]
    assert RouterModel.model_validate(stored) == MODEL  # written before schemas: schema 1
    with pytest.raises(ValidationError, match="schema_version"):
        RouterModel.model_validate(two.model_dump(mode="json") | {"schema_version": 4})
    with pytest.raises(ValidationError, match="takes more than 4 features"):
        RouterModel.create(MODEL.specialists, MODEL.weights, MODEL.bias, DIGEST, schema_version=2)


def cascade(clear: float = 0.9) -> RouterModel:
    """A schema-3 model whose words head knows one word per specialist ("chat", "agent",
    "coding", "genui" vote for their own), and whose whole classifier reads the embedding."""
    head_rows = [[0.0] * WORD_BUCKETS for _ in DEFAULT_SPECIALISTS]
    for row, name in zip(head_rows, DEFAULT_SPECIALISTS, strict=True):
        [bucket], _ = word_buckets(name)
        row[bucket] = 20.0
    head = WordsHead(
        weights=tuple(map(tuple, head_rows)), bias=(0.0,) * len(DEFAULT_SPECIALISTS), clear=clear
    )
    wide = [[*row, *([0.0] * WORD_BUCKETS)] for row in MODEL.weights]
    return RouterModel.create(MODEL.specialists, wide, MODEL.bias, DIGEST, 3, head)


def no_embedding(text: str) -> list[float]:
    raise AssertionError(f"{text!r} was embedded")


def test_a_schema_3_router_decides_a_clear_turn_by_its_words_alone() -> None:
    """The words head decides the turns it is sure of without the embedding; the others, and
    every short follow-up, go to the whole classifier, whose decision is schema 2's."""
    model = cascade()
    clear = route_text("genui", model, no_embedding, ALL)
    assert (clear.specialist, clear.reason) == ("genui", "classifier")
    assert clear.scores["genui"] >= 0.9 and clear.router_version == model.version
    assert (
        route_text("coding", model, no_embedding, ALL, TurnContext(hint="chat")).specialist
        == "chat"
    )
    assert route_text("x", model, no_embedding, {"agent"}).reason == "only_specialist"

    embedded: list[str] = []

    def embed(text: str) -> list[float]:
        embedded.append(text)
        return towards(2)

    unclear = route_text("tell me something", model, embed, ALL)
    features = router_features(3, towards(2), "tell me something")
    assert unclear == decide(features, model, ALL) and unclear.specialist == "coding"
    follow_up = route_text("genui", model, embed, ALL, TurnContext(previous="chat"))
    assert follow_up.specialist == "coding" and embedded == ["tell me something", "genui"]
    assert decide_by_words("genui", MODEL, ALL) is None  # schema 1 has no words head


def test_a_words_head_must_fit_its_router() -> None:
    """A words head only on schema 3, one row of ``WORD_BUCKETS`` per specialist, never less
    sure than the follow-up rule; it is part of the version."""
    model = cascade()
    wide = model.weights
    with pytest.raises(ValidationError, match="exactly when it is of schema 3"):
        RouterModel.create(MODEL.specialists, wide, MODEL.bias, DIGEST, 3)
    with pytest.raises(ValidationError, match="exactly when it is of schema 3"):
        RouterModel.create(MODEL.specialists, wide, MODEL.bias, DIGEST, 2, model.words)
    with pytest.raises(ValidationError, match="one row per specialist"):
        RouterModel.create(MODEL.specialists[:3], wide[:3], MODEL.bias[:3], DIGEST, 3, model.words)
    with pytest.raises(ValidationError, match="clear"):
        cascade(clear=FOLLOW_UP_CLEAR - 0.1)
    with pytest.raises(ValidationError, match=f"{WORD_BUCKETS} weights"):
        WordsHead(weights=((1.0,),), bias=(0.0,), clear=0.9)
    assert cascade(0.95).version != model.version
    assert RouterModel.model_validate_json(model.model_dump_json()) == model


def test_a_stored_model_round_trips_and_an_altered_one_does_not_validate() -> None:
    stored = MODEL.model_dump_json()
    assert RouterModel.model_validate_json(stored) == MODEL
    altered = MODEL.model_dump(mode="json")
    altered["bias"] = [0.0, 0.0, 0.5, 0.0]
    with pytest.raises(ValidationError, match="does not match the content"):
        RouterModel.model_validate(altered)


@pytest.mark.parametrize(
    ("specialists", "weights", "bias"),
    [
        (("chat", "chat"), [[1.0], [1.0]], [0.0, 0.0]),
        (("chat", "agent"), [[1.0]], [0.0, 0.0]),
        (("chat", "agent"), [[1.0], [1.0, 2.0]], [0.0, 0.0]),
        (("chat", "agent"), [[], []], [0.0, 0.0]),
        (("chat", "agent"), [[1.0], [1.0]], [0.0]),
        (("Chat",), [[1.0]], [0.0]),
        (("chat",), [[math.nan]], [0.0]),
    ],
)
def test_inconsistent_models_do_not_validate(
    specialists: tuple[str, ...], weights: list[list[float]], bias: list[float]
) -> None:
    with pytest.raises(ValidationError):
        RouterModel(
            specialists=specialists,
            weights=tuple(tuple(row) for row in weights),
            bias=tuple(bias),
            training_digest=DIGEST,
            version="router-000000000000",
        )


# --- decisions as events ---------------------------------------------------------------------


def test_a_decision_becomes_the_router_decided_payload() -> None:
    decision = decide(towards(1), MODEL, ALL)
    turn_id = uuid.uuid4()
    stamp = HarnessStamp(harness_version="harness-test", hcp_version="hcp-1")
    payload = decision.to_event(turn_id, "agent@3", stamp)
    assert payload == RouterDecided(
        harness=stamp,
        turn_id=turn_id,
        scores=decision.scores,
        specialist="agent",
        adapter_version="agent@3",
        router_version=MODEL.version,
        reason="classifier",
        tool_callers=[],
    )
    sealed = Mapper().seal(NewEvent(payload=payload, tenant_id="tenant-a", key="conv-1"), 1, None)
    assert sealed.envelope.payload["router_version"] == MODEL.version
    assert sealed.envelope.schema_version == 2


def test_a_v1_decision_reads_back_with_no_reason_and_no_context() -> None:
    v1 = {
        "turn_id": str(uuid.uuid4()),
        "scores": {"chat": 1.0},
        "specialist": "chat",
        "adapter_version": "chat@0",
        "router_version": "r",
        "harness": {"harness_version": "harness@0", "hcp_version": "hcp-1"},
    }
    payload = RouterDecided.model_validate(UPCASTERS.upcast("RouterDecided", 1, v1, 2))
    assert (payload.reason, payload.tool_callers, payload.specialist) == (None, [], "chat")
    verdict = {
        "run_id": str(uuid.uuid4()),
        "router_version": "r2",
        "parent_router_version": "r1",
        "contract_version": "3",
        "candidate_accuracy": 0.9,
        "parent_accuracy": 0.9,
        "passed": False,
    }
    evaluated = RouterEvaluated.model_validate(UPCASTERS.upcast("RouterEvaluated", 1, verdict, 2))
    assert evaluated.labels_left_out == 0


# --- requests with client tools ----------------------------------------------------------------

UNCLEAR_CHAT = [0.3, 0.0, 0.1, 0.0]  # chat most probable, at 0.49


def test_client_tools_send_an_unclear_turn_to_the_specialist_that_calls_tools() -> None:
    alone = decide(UNCLEAR_CHAT, MODEL, ALL)
    assert (alone.specialist, alone.reason, alone.tool_callers) == ("chat", "classifier", ())
    assert alone.scores["chat"] < CLEARLY_OTHER
    decision = decide(UNCLEAR_CHAT, MODEL, ALL, tool_callers={"agent"})
    assert (decision.specialist, decision.reason) == ("agent", "client_tools")
    assert decision.scores == alone.scores and decision.tool_callers == ("agent",)
    event = decision.to_event(
        uuid.uuid4(), "agent@0", HarnessStamp(harness_version="h", hcp_version="hcp-1")
    )
    assert (event.reason, event.tool_callers) == ("client_tools", ["agent"])


def test_client_tools_leave_a_clear_other_specialist_a_hint_and_an_inactive_caller_alone() -> None:
    clear = decide(towards(2), MODEL, ALL, tool_callers={"agent"})
    assert clear.scores["coding"] >= CLEARLY_OTHER
    assert (clear.specialist, clear.reason) == ("coding", "classifier")
    hinted = decide(UNCLEAR_CHAT, MODEL, ALL, hint="genui", tool_callers={"agent"})
    assert (hinted.specialist, hinted.reason) == ("genui", "hint")
    inactive = decide(UNCLEAR_CHAT, MODEL, ALL - {"agent"}, tool_callers={"agent"})
    assert (inactive.specialist, inactive.reason) == ("chat", "classifier")
    chosen = decide(towards(1), MODEL, ALL, tool_callers={"agent"})
    assert (chosen.specialist, chosen.reason) == ("agent", "classifier")
    # Of two tool callers, the more probable one answers.
    both = decide([0.3, 0.0, 0.0, 0.25], MODEL, ALL, tool_callers={"agent", "genui"})
    assert (both.specialist, both.reason) == ("genui", "client_tools")


def test_a_decision_must_be_consistent() -> None:
    with pytest.raises(ValidationError, match="sum to 1"):
        RouterDecision(
            scores={"chat": 0.5, "agent": 0.4},
            specialist="chat",
            reason="classifier",
            router_version="router-x",
        )
    with pytest.raises(ValidationError, match="has no score"):
        RouterDecision(
            scores={"chat": 1.0}, specialist="agent", reason="hint", router_version="router-x"
        )


# --- training labels from the log ------------------------------------------------------------


def test_the_latest_label_of_a_turn_wins_and_corrections_weigh_more() -> None:
    ids = [uuid.uuid4() for _ in range(4)]

    def label(n: int, specialist: str, source: RoutingSource) -> RoutingLabelled:
        return RoutingLabelled(
            label_id=uuid.uuid4(),
            turn_id=ids[n],
            text=f"turn {n}",
            specialist=specialist,
            source=source,
        )

    labels = [
        label(0, "chat", "hint"),
        label(1, "chat", "up"),
        label(0, "agent", "correction"),  # later: it wins, and moves to its place in the log
        label(2, "genui", "kept"),
        label(3, "coding", "api_model"),  # an API client's model field counts a quarter
    ]
    assert labels_of(labels, correction_weight=3.0) == [
        LabelledTurn(text="turn 1", specialist="chat"),
        LabelledTurn(text="turn 0", specialist="agent", weight=3.0),
        LabelledTurn(text="turn 2", specialist="genui", weight=3.0),
        LabelledTurn(text="turn 3", specialist="coding", weight=API_MODEL_WEIGHT),
    ]
    assert API_MODEL_WEIGHT == 0.25
    assert labels_of([]) == []


# --- follow-ups ----------------------------------------------------------------------------------


def test_an_unclear_follow_up_stays_with_the_previous_turns_specialist() -> None:
    decision = decide(UNCLEAR_CHAT, MODEL, ALL, previous="coding")
    assert decision.scores["chat"] < FOLLOW_UP_CLEAR
    assert (decision.specialist, decision.reason, decision.previous) == (
        "coding",
        "follow_up",
        "coding",
    )
    event = decision.to_event(
        uuid.uuid4(), "coding@0", HarnessStamp(harness_version="h", hcp_version="hcp-1")
    )
    assert (event.reason, event.previous) == ("follow_up", "coding")


def test_a_clear_change_of_subject_a_hint_client_tools_and_an_inactive_previous_win() -> None:
    clear = decide(towards(3), MODEL, ALL, previous="coding")
    assert clear.scores["genui"] >= FOLLOW_UP_CLEAR
    assert (clear.specialist, clear.reason) == ("genui", "classifier")
    hinted = decide(UNCLEAR_CHAT, MODEL, ALL, hint="genui", previous="coding")
    assert (hinted.specialist, hinted.reason) == ("genui", "hint")
    tools = decide(UNCLEAR_CHAT, MODEL, ALL, tool_callers={"agent"}, previous="coding")
    assert (tools.specialist, tools.reason) == ("agent", "client_tools")
    gone = decide(UNCLEAR_CHAT, MODEL, ALL - {"coding"}, previous="coding")
    assert (gone.specialist, gone.reason) == ("chat", "classifier")
    same = decide(UNCLEAR_CHAT, MODEL, ALL, previous="chat")
    assert (same.specialist, same.reason) == ("chat", "classifier")


def test_a_follow_up_is_six_words_at_most() -> None:
    assert following("and in Fahrenheit?", "agent") == "agent"
    assert following("add a test for negative numbers", "coding") == "coding"
    assert following("Write a Python function that turns Celsius into Fahrenheit", "agent") is None
    assert following("and in Fahrenheit?", None) is None
