"""The routing cascade of schema-3 routers: the words head decides the turns it is clear about
(``decide_by_words``), and the whole classifier, on the sentence embedding, the rest
(``route_text``, as the server routes a turn). Pure, as ``core.routing`` is."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from core.router_features import router_features, word_buckets
from core.routing import (
    RouterDecision,
    RouterModel,
    check_active,
    decide,
    decision_from_logits,
)


@dataclass(frozen=True)
class TurnContext:
    """What a turn brings besides its text: a client's hint, the specialists that call tools
    (when the request has client tools) and the previous turn's specialist (when the message
    is a short follow-up: ``core.routing.following``)."""

    hint: str | None = None
    tool_callers: Collection[str] = ()
    previous: str | None = None


NO_CONTEXT = TurnContext()


def decide_by_words(
    text: str, model: RouterModel, active: Collection[str], context: TurnContext = NO_CONTEXT
) -> RouterDecision | None:
    """The decision of a schema-3 router's words head when it is clear about ``text`` (its
    most probable active specialist at ``clear`` or above) and the turn is no short follow-up
    (``context.previous`` is ``None``: a follow-up's few words say little, and on the development
    split the words head took 3 to 12 points of follow-ups from the whole classifier), or when
    no classifier is needed (one active specialist, or a hint naming one); ``None`` when the
    whole classifier must decide. Only the buckets present are read: a few hundred
    operations."""
    if model.words is None:
        return None
    check_active(model, active)
    head = model.words
    candidates = [i for i, name in enumerate(model.specialists) if name in active]
    buckets, scale = word_buckets(text)
    logits = [scale * sum(head.weights[i][b] for b in buckets) + head.bias[i] for i in candidates]
    decision = decision_from_logits(
        model, candidates, logits, context.hint, context.tool_callers, context.previous
    )
    if decision.reason in ("only_specialist", "hint"):
        return decision
    if context.previous is None and max(decision.scores.values()) >= head.clear:
        return decision
    return None


def route_text(
    text: str,
    model: RouterModel,
    embed: Callable[[str], Sequence[float]],
    active: Collection[str],
    context: TurnContext = NO_CONTEXT,
) -> RouterDecision:
    """Route ``text`` as the server does: a schema-3 router's words head first
    (``decide_by_words``), then, for the turns it is not clear about (and every turn of an
    earlier schema), the whole classifier on the features of ``embed(text)``."""
    early = decide_by_words(text, model, active, context)
    if early is not None:
        return early
    features = router_features(model.schema_version, embed(text), text)
    return decide(features, model, active, context.hint, context.tool_callers, context.previous)
