"""The turn pipeline without a server: the chat service over the in-memory event log, the
instant engine (whose script sees the context the harness built) and a router that follows
hints. Each case checks the events appended, in order, and the frames sent."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncGenerator, Callable, Collection, Coroutine
from dataclasses import replace
from typing import Any, TypeVar

import pytest

from core.auth import Principal
from core.engine import GenerationChunk, GenerationRequest, OutputConstraint
from core.errors import (
    AdapterNotFound,
    ConstraintUnsupported,
    ConversationNotFound,
    HarnessInvalid,
    InvalidFrame,
    RateLimited,
    TurnInFlight,
    TurnNotFound,
)
from core.events import (
    ChatMessage,
    FeedbackGiven,
    GenUIRendered,
    HarnessActionExecuted,
    ModelResponded,
    RequestedDecoding,
    RouterDecided,
    RoutingCorrected,
    TurnCompleted,
    TurnReceived,
)
from core.harness.actions import MAX_ACTIONS_PER_TURN
from core.harness.artifact import (
    Decoding,
    Exemplar,
    HarnessVersion,
    SpecialistHarness,
    root_version,
)
from core.harness.grammars import output_constraint
from core.release import AdapterRef, Release, ServedRelease
from core.routing import RouterDecision, RouterModel, UnknownSpecialist
from engines.instant import InstantEngine, Script, fixed_reply
from infra.memory import InMemoryEventLog
from server.chat import ChatService
from server.entrypoints import protocol as wire
from server.entrypoints.ws import frame_of
from server.releases import prepare_harness
from server.turns import commands
from server.turns.items import TextDelta, TurnItem, TurnStarted
from server.turns.request import ChatLimits, TurnOutcome, TurnRequest
from server.turns.transcript import transcript

SPECIALISTS = ("chat", "agent", "coding", "genui")
ROOT = root_version()
TURN = ["TurnReceived", "RouterDecided", "ModelResponded", "TurnCompleted"]
T = TypeVar("T")


def adapter(specialist: str, version: int = 1) -> AdapterRef:
    return AdapterRef(
        adapter_version_id=version,
        specialist=specialist,
        version=version,
        sha256=f"{version:064x}",
        path=f"/adapters/{specialist}/{version}",
        rank=4,
    )


def release(release_id: str = "r1", version: int = 1, **adapters: AdapterRef) -> Release:
    return Release(
        release_id=release_id,
        parent_release_id=None,
        base_model="tiny",
        router_version="router-test",
        harness_version="harness@0",
        hcp_version="hcp-1",
        adapters=adapters or {s: adapter(s, version) for s in SPECIALISTS},
    )


class HintRouter:
    """The router protocol without a classifier: the hint, else ``chat``."""

    version = "router-test"
    specialists = SPECIALISTS
    active = frozenset(SPECIALISTS)

    def serve_model(self, model: RouterModel) -> None:
        raise NotImplementedError("a router without a classifier serves no other version")

    def route(
        self,
        text: str,
        hint: str | None = None,
        within: Collection[str] | None = None,
        tool_callers: Collection[str] = (),
        previous: str | None = None,
    ) -> RouterDecision:
        chosen = hint or "chat"
        return RouterDecision(
            scores={s: 1.0 if s == chosen else 0.0 for s in SPECIALISTS},
            specialist=chosen,
            reason="hint" if hint else "classifier",
            router_version=self.version,
        )


def requests_to(h: Harness, monkeypatch: pytest.MonkeyPatch) -> list[GenerationRequest]:
    """Every generation request ``h``'s engine gets from now on (it still answers them)."""
    sent: list[GenerationRequest] = []
    generate = h.engine.generate

    def recording(request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        sent.append(request)
        return generate(request)

    monkeypatch.setattr(h.engine, "generate", recording)
    return sent


class Harness:
    """A chat service, its log and engine, and the frames each turn sent."""

    def __init__(self, script: Script, serving: Release | None = None, **limits: Any) -> None:
        self.log = InMemoryEventLog()
        self.engine = InstantEngine(script)
        self.release = serving or release()
        for ref in self.release.adapters.values():
            self.engine.load_adapter(ref.name, ref.path)
        self.chat = ChatService(
            self.log,
            self.engine,
            HintRouter(),
            ServedRelease(release=self.release, harness=ROOT),
            limits=ChatLimits(**{"turns_per_minute": 1000, **limits}),
        )
        self.principal = principal()
        self.frames: list[wire.Frame] = []
        """The turn's items as a WebSocket client gets them."""

    async def sink(self, item: TurnItem) -> None:
        self.frames.append(frame_of(item))

    async def turn(
        self,
        content: str = "hello there",
        *,
        msg: str = "m1",
        conversation_id: uuid.UUID | None = None,
        hint: str | None = None,
        who: Principal | None = None,
    ) -> TurnOutcome:
        request = TurnRequest(msg, content, conversation_id, hint)
        return await self.chat.run_turn(who or self.principal, request, self.sink, asyncio.Event())

    def types(self, conversation_id: uuid.UUID | None = None) -> list[str]:
        key = None if conversation_id is None else str(conversation_id)
        return [r.envelope.type for r in self.log.read(key=key)]

    def frame_types(self) -> list[str]:
        return [f.type for f in self.frames]  # type: ignore[attr-defined]

    def tokens(self) -> str:
        return "".join(f.delta for f in self.frames if isinstance(f, wire.Token))

    def payloads(self, kind: type[T]) -> list[T]:
        return [r.payload for r in self.log.read() if isinstance(r.payload, kind)]


def principal(tenant: str = "tenant-a") -> Principal:
    return Principal(tenant_id=tenant, key_id=uuid.uuid4(), scopes=frozenset({"chat"}))


def run(case: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(case())


def tool_then(answer: str, call: dict[str, Any]) -> Script:
    """An agent that makes ``call`` once, then answers ``answer``."""

    def script(messages: list[dict[str, str]]) -> str:
        done = any(m["content"].startswith("Tool result:") for m in messages)
        return answer if done else json.dumps(call)

    return script


GENUI_TREE = {
    "type": "Card",
    "title": "Pick",
    "children": [{"type": "Button", "id": "ok", "label": "OK", "action": "confirm"}],
}


# --- a text turn ----------------------------------------------------------------------------


def test_a_text_turn_appends_its_events_in_order_and_streams_tokens() -> None:
    h = Harness(fixed_reply("Hi there, friend."))
    outcome = run(h.turn)
    assert h.types() == ["ConversationStarted", *TURN]
    assert [r.envelope.sequence for r in h.log.read()] == [1, 2, 3, 4, 5]
    assert h.frame_types() == ["turn_started", "token", "token", "token", "turn_completed"]
    assert h.tokens() == "Hi there, friend." == outcome.text
    started, completed = h.frames[0], h.frames[-1]
    assert isinstance(started, wire.TurnStarted) and isinstance(completed, wire.TurnCompleted)
    assert (started.specialist, started.adapter_version, started.release_id) == (
        "chat",
        "chat@1",
        "r1",
    )
    assert (completed.finish_reason, completed.resent) == ("stop", False)
    assert completed.usage.completion_tokens == 3
    [responded] = h.payloads(ModelResponded)
    assert (responded.text, responded.finish_reason, responded.adapter_version) == (
        "Hi there, friend.",
        "stop",
        "chat@1",
    )


def test_a_second_turn_continues_the_conversation_with_its_history() -> None:
    seen: list[list[dict[str, str]]] = []

    def script(messages: list[dict[str, str]]) -> str:
        seen.append(messages)
        return f"answer {len(seen)}"

    h = Harness(script)

    async def case() -> TurnOutcome:
        first = await h.turn("first question")
        return await h.turn("second question", msg="m2", conversation_id=first.conversation_id)

    second = run(case)
    assert h.types(second.conversation_id) == ["ConversationStarted", *TURN, *TURN]
    assert [m["content"] for m in seen[1][1:]] == ["first question", "answer 1", "second question"]


def test_history_from_the_openai_api_starts_the_conversation() -> None:
    h = Harness(fixed_reply("ok"))
    request = TurnRequest(
        "m1",
        "and now?",
        history=(
            ChatMessage(role="user", content="earlier"),
            ChatMessage(role="assistant", content="a"),
        ),
    )
    outcome = run(lambda: h.chat.run_turn(h.principal, request, h.sink, asyncio.Event()))
    rebuilt = run(lambda: h.chat.conversation(h.principal, outcome.conversation_id))
    assert [m.content for m in rebuilt.seed_history] == ["earlier", "a"]


# --- resend, in-flight, rate, tenants --------------------------------------------------------


def test_a_resent_message_returns_the_recorded_answer_and_appends_nothing() -> None:
    h = Harness(fixed_reply("only once"))

    async def case() -> tuple[TurnOutcome, TurnOutcome]:
        first = await h.turn(msg="same")
        h.frames.clear()
        again = await h.turn(msg="same", conversation_id=first.conversation_id)
        return first, again

    first, again = run(case)
    assert h.types() == ["ConversationStarted", *TURN]
    assert again.turn_id == first.turn_id and again.text == "only once"
    assert h.frame_types() == ["turn_started", "token", "turn_completed"]
    assert h.tokens() == "only once"
    completed = h.frames[-1]
    assert isinstance(completed, wire.TurnCompleted) and completed.resent is True


def test_a_resend_after_a_restart_is_answered_from_the_log() -> None:
    h = Harness(fixed_reply("kept in the log"))
    first = run(lambda: h.turn(msg="same"))
    restarted = ChatService(
        h.log, h.engine, HintRouter(), ServedRelease(release=h.release, harness=ROOT)
    )
    request = TurnRequest("same", "hello there", first.conversation_id)
    again = run(lambda: restarted.run_turn(h.principal, request, h.sink, asyncio.Event()))
    assert again.turn_id == first.turn_id and again.text == "kept in the log"
    assert h.types() == ["ConversationStarted", *TURN]


def test_a_second_turn_while_one_is_answered_is_turn_in_flight() -> None:
    h = Harness(fixed_reply("slow answer"))

    async def case() -> list[str]:
        opened = asyncio.Event()
        first = await h.turn()

        async def held(item: TurnItem) -> None:
            if isinstance(item, TurnStarted):
                await opened.wait()

        request = TurnRequest("m2", "next", first.conversation_id)
        busy = asyncio.create_task(h.chat.run_turn(h.principal, request, held, asyncio.Event()))
        await asyncio.sleep(0.01)
        with pytest.raises(TurnInFlight):
            await h.turn("meanwhile", msg="m3", conversation_id=first.conversation_id)
        opened.set()
        await busy
        await h.turn("after", msg="m4", conversation_id=first.conversation_id)
        return h.types(first.conversation_id)

    assert run(case) == ["ConversationStarted", *TURN, *TURN, *TURN]


def test_turns_beyond_the_rate_limit_are_refused_per_key() -> None:
    h = Harness(fixed_reply("ok"), turns_per_minute=2)

    async def case() -> None:
        await h.turn(msg="a")
        await h.turn(msg="b")
        with pytest.raises(RateLimited, match="at most 2 turns a minute"):
            await h.turn(msg="c")
        await h.turn(msg="d", who=principal())  # another key of the same tenant

    run(case)
    assert len(h.payloads(TurnReceived)) == 3


def test_a_regenerate_or_reroute_out_of_turns_is_refused_before_anything_is_recorded() -> None:
    h = Harness(fixed_reply("ok"), turns_per_minute=1)

    async def case() -> None:
        done = await h.turn("hello")  # the key's one turn this minute
        cid, tid = done.conversation_id, done.turn_id
        with pytest.raises(RateLimited):
            await h.chat.feedback(h.principal, cid, feedback(tid, "regenerate"))
        with pytest.raises(RateLimited):
            await h.chat.reroute(h.principal, cid, commands.Reroute(tid, "coding"))
        await h.chat.feedback(h.principal, cid, feedback(tid, "up"))  # no turn: not limited

    run(case)
    assert [f.kind for f in h.payloads(FeedbackGiven)] == ["up"]
    assert h.payloads(RoutingCorrected) == []


def test_a_clients_decoding_overrides_the_harness_and_the_server_caps_its_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Temperature 0 is kept (not taken for "unset"), the answer's length stays within the
    server's cap, stop strings and the seed reach the engine (the seed plus the step)."""
    h = Harness(fixed_reply("ok"), max_new_tokens=5)
    sent = requests_to(h, monkeypatch)
    asked = RequestedDecoding(max_tokens=50, temperature=0.0, seed=11, stop=("\n\n",))
    run(
        lambda: h.chat.run_turn(
            h.principal, TurnRequest("m", "hi", decoding=asked), h.sink, asyncio.Event()
        )
    )
    plain = run(h.turn)  # the harness's settings: its temperature, the turn's own seed
    first, second = (r.params for r in sent)
    assert (first.temperature, first.max_tokens, first.seed, first.stop) == (0.0, 5, 11, ("\n\n",))
    assert (second.temperature, second.stop) == (0.7, ())
    assert second.seed == plain.turn_id.int % 2**63
    [received, _] = h.payloads(TurnReceived)
    assert received.decoding == asked


def test_limits_replaced_at_run_time_apply_to_the_next_turn() -> None:
    h = Harness(fixed_reply("one two three four"))
    h.chat.limits = ChatLimits(turns_per_minute=10, max_new_tokens=2)
    outcome = run(h.turn)
    assert outcome.text == "one two"


def test_another_tenants_conversation_is_not_found() -> None:
    h = Harness(fixed_reply("mine"))
    mine = run(h.turn)
    with pytest.raises(ConversationNotFound):
        run(lambda: h.turn(msg="x", conversation_id=mine.conversation_id, who=principal("b")))
    with pytest.raises(ConversationNotFound):
        run(lambda: h.turn(msg="y", conversation_id=uuid.uuid4()))
    assert h.types() == ["ConversationStarted", *TURN]


# --- agent actions ------------------------------------------------------------------------


def test_an_agent_tool_call_is_executed_recorded_and_never_streamed_as_text() -> None:
    call = {"tool": "calculator", "args": {"expression": "6*7"}}
    h = Harness(tool_then("It is 42.", call))
    outcome = run(lambda: h.turn("what is 6*7?", hint="agent"))
    assert h.types() == [
        "ConversationStarted",
        "TurnReceived",
        "RouterDecided",
        "HarnessActionExecuted",
        "ModelResponded",
        "TurnCompleted",
    ]
    [action] = h.payloads(HarnessActionExecuted)
    assert (action.name, action.result, action.ok) == ("calculator", {"value": 42}, True)
    assert h.frame_types() == [
        "turn_started",
        "action",
        "token",
        "token",
        "token",
        "turn_completed",
    ]
    assert h.tokens() == "It is 42." == outcome.text
    assert outcome.actions == [action]


def test_an_agent_stops_after_the_most_actions_a_turn_may_take() -> None:
    h = Harness(fixed_reply(json.dumps({"tool": "clock", "args": {}})))
    outcome = run(lambda: h.turn("loop", hint="agent"))
    stopped = f"I stopped after {MAX_ACTIONS_PER_TURN} actions in one turn."
    assert outcome.text == stopped == h.tokens()
    assert len(h.payloads(HarnessActionExecuted)) == MAX_ACTIONS_PER_TURN == 4
    assert h.types()[-2:] == ["ModelResponded", "TurnCompleted"]
    assert h.payloads(ModelResponded)[0].text == stopped


def test_agent_json_that_is_not_a_tool_call_is_held_back_then_sent_whole() -> None:
    h = Harness(fixed_reply('{"answer": 1, "more": 2}'))
    run(lambda: h.turn(hint="agent"))
    assert h.frame_types() == ["turn_started", "token", "turn_completed"]
    assert h.tokens() == '{"answer": 1, "more": 2}'


def test_agent_plain_text_is_streamed_as_it_comes() -> None:
    h = Harness(fixed_reply("plain words here"))
    run(lambda: h.turn(hint="agent"))
    assert h.frame_types() == ["turn_started", "token", "token", "token", "turn_completed"]


# --- GenUI -------------------------------------------------------------------------------


def test_a_valid_genui_tree_is_rendered_not_streamed() -> None:
    h = Harness(fixed_reply(json.dumps(GENUI_TREE)))
    outcome = run(lambda: h.turn("show a card", hint="genui"))
    assert h.frame_types() == ["turn_started", "genui", "turn_completed"]
    genui = h.frames[1]
    assert isinstance(genui, wire.GenUI) and genui.tree["title"] == "Pick"
    assert h.types()[-4:] == ["RouterDecided", "GenUIRendered", "ModelResponded", "TurnCompleted"]
    [rendered] = h.payloads(GenUIRendered)
    assert rendered.valid and rendered.errors == []
    assert outcome.genui is not None and outcome.genui.valid


def test_an_invalid_genui_tree_falls_back_to_text() -> None:
    h = Harness(fixed_reply(json.dumps({"type": "Marquee", "text": "hi"})))
    run(lambda: h.turn("show", hint="genui"))
    assert h.frame_types() == ["turn_started", "token", "turn_completed"]
    assert h.tokens().startswith("I could not render that view (1 problem")
    [rendered] = h.payloads(GenUIRendered)
    assert rendered.valid is False and rendered.tree == {} and rendered.errors


def test_a_ui_event_becomes_a_turn_only_for_a_rendered_component() -> None:
    h = Harness(fixed_reply(json.dumps(GENUI_TREE)))

    async def case() -> TurnRequest:
        shown = await h.turn("show", hint="genui")
        command = commands.UIEvent(shown.turn_id, "nope", "click")
        with pytest.raises(InvalidFrame, match="rendered no component 'nope'"):
            await h.chat.ui_event_turn(h.principal, shown.conversation_id, command)
        ok = replace(command, component_id="ok")
        request = await h.chat.ui_event_turn(h.principal, shown.conversation_id, ok)
        await h.chat.run_turn(h.principal, request, h.sink, asyncio.Event())
        return request

    request = run(case)
    assert (request.input_kind, request.specialist_hint) == ("ui_event", "genui")
    assert json.loads(request.content.removeprefix("ui_event "))["component_id"] == "ok"
    assert [p.input_kind for p in h.payloads(TurnReceived)] == ["text", "ui_event"]


# --- cancellation and failure ---------------------------------------------------------------


def test_cancel_stops_generation_and_records_a_cancelled_response() -> None:
    h = Harness(fixed_reply(" ".join(f"w{i}" for i in range(50))))
    cancel = asyncio.Event()

    async def cancelling(item: TurnItem) -> None:
        await h.sink(item)
        if isinstance(item, TextDelta):
            cancel.set()

    request = TurnRequest("m1", "long story")
    outcome = run(lambda: h.chat.run_turn(h.principal, request, cancelling, cancel))
    assert outcome.finish_reason == "cancelled" and outcome.text == "w0 w1"
    assert h.frame_types() == ["turn_started", "token", "turn_completed"]
    assert h.types() == ["ConversationStarted", *TURN]
    assert h.payloads(ModelResponded)[0].finish_reason == "cancelled"


def test_an_engine_error_records_a_response_with_finish_error() -> None:
    h = Harness(fixed_reply("never"))
    h.engine.unload_adapter("chat@1")
    with pytest.raises(AdapterNotFound):
        run(h.turn)
    assert h.types() == ["ConversationStarted", "TurnReceived", "RouterDecided", "ModelResponded"]
    assert h.payloads(ModelResponded)[0].finish_reason == "error"
    assert h.frame_types() == ["turn_started"]


def test_a_release_without_the_specialist_appends_nothing() -> None:
    h = Harness(fixed_reply("x"), serving=release(chat=adapter("chat")))
    with pytest.raises(AdapterNotFound, match="no adapter for coding"):
        run(lambda: h.turn(hint="coding"))
    assert h.types() == [] and h.frames == []


# --- releases --------------------------------------------------------------------------------


def test_an_old_adapter_is_unloaded_only_after_the_last_turn_on_it_ends() -> None:
    h = Harness(fixed_reply("ok"), serving=release(chat=adapter("chat", 1)))
    h.engine.load_adapter("chat@2", "/adapters/chat/2")
    successor = release("r2", chat=adapter("chat", 2))

    async def case() -> tuple[list[str], list[str], TurnOutcome]:
        opened = asyncio.Event()

        async def held(item: TurnItem) -> None:
            if isinstance(item, TurnStarted):
                await opened.wait()

        busy = asyncio.create_task(
            h.chat.run_turn(h.principal, TurnRequest("m1", "hi"), held, asyncio.Event())
        )
        await asyncio.sleep(0.01)
        h.chat.serve(ServedRelease(release=successor, harness=ROOT))
        during = sorted(h.engine.loaded_adapters())
        opened.set()
        outcome = await busy
        return during, sorted(h.engine.loaded_adapters()), outcome

    during, after, outcome = run(case)
    assert during == ["chat@1", "chat@2"] and after == ["chat@2"]
    assert h.chat.release.release_id == "r2"
    assert h.payloads(ModelResponded)[0].release_id == "r1"  # the turn kept its release
    assert outcome.finish_reason == "stop"


def test_serving_a_new_release_with_no_turns_unloads_at_once() -> None:
    h = Harness(fixed_reply("ok"), serving=release(chat=adapter("chat", 1)))
    h.engine.load_adapter("chat@2", "/adapters/chat/2")
    since = h.chat.serving_since
    h.chat.serve(ServedRelease(release=release("r2", chat=adapter("chat", 2)), harness=ROOT))
    assert h.engine.loaded_adapters() == ["chat@2"] and h.chat.serving_since >= since
    run(h.turn)
    assert h.payloads(ModelResponded)[0].adapter_version == "chat@2"


def test_a_new_harness_answers_new_turns_with_its_prompt_exemplars_decoding_and_stamp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[list[dict[str, str]]] = []

    def script(messages: list[dict[str, str]]) -> str:
        seen.append(messages)
        return "ok"

    h = Harness(script, max_new_tokens=5)
    sent = requests_to(h, monkeypatch)
    chat = SpecialistHarness(
        system_prompt="Be brief.",
        exemplars=(Exemplar(user="2+2?", assistant="4"),),
        decoding=Decoding(temperature=0.2, top_p=0.9, max_new_tokens=64),
    )
    spec = ROOT.spec.model_copy(update={"specialists": {**ROOT.spec.specialists, "chat": chat}})
    harness = HarnessVersion(version=1, sha256=spec.address, parent_version=0, spec=spec)
    with pytest.raises(HarnessInvalid):  # the release must name the harness it is served with
        ServedRelease(release=h.release, harness=harness)
    h.chat.serve(ServedRelease(release=h.release.successor(harness=harness), harness=harness))
    run(h.turn)
    assert seen[-1][:3] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    params = sent[-1].params  # the harness's sampling, its length capped by the server's
    assert (params.temperature, params.top_p, params.max_tokens) == (0.2, 0.9, 5)
    stamped = {
        r.payload.harness
        for r in h.log.read()
        if isinstance(r.payload, TurnReceived | RouterDecided | ModelResponded | TurnCompleted)
    }
    assert stamped == {harness.stamp}


def test_an_enforcing_harness_constrains_every_step_of_its_structured_specialists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The instant engine enforces no grammar: the recording engine takes the constraint off
    after noting it, so this checks what the pipeline sends, not decoding."""
    agent_script = tool_then("It is noon.", {"tool": "clock", "args": {}})

    def script(messages: list[dict[str, str]]) -> str:
        if messages[0]["content"].startswith(ROOT.spec.specialists["agent"].system_prompt):
            return agent_script(messages)
        return json.dumps(GENUI_TREE) if "interface" in messages[0]["content"] else "hi"

    h = Harness(script)
    sent: list[tuple[str, OutputConstraint | None]] = []
    generate = h.engine.generate

    def recording(request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        sent.append((request.request_id, request.constraint))
        return generate(request.model_copy(update={"constraint": None}))

    monkeypatch.setattr(h.engine, "generate", recording)
    enforcing = {
        name: own.model_copy(update={"enforce_grammar": True})
        for name, own in ROOT.spec.specialists.items()
    }
    spec = ROOT.spec.model_copy(update={"specialists": enforcing})
    harness = HarnessVersion(version=1, sha256=spec.address, parent_version=0, spec=spec)
    h.chat.serve(ServedRelease(release=h.release.successor(harness=harness), harness=harness))
    agent = run(lambda: h.turn("What time is it?", msg="a", hint="agent"))
    genui = run(lambda: h.turn("Show a card.", msg="g", hint="genui"))
    run(lambda: h.turn("Hello.", msg="c", hint="chat"))
    steps = [constraint for _, constraint in sent]
    assert len(steps) == 4 and agent.text == "It is noon." and genui.genui is not None
    assert steps[0] == steps[1] == output_constraint(spec, "agent")  # the call, then the answer
    assert steps[0] is not None and steps[0].or_text
    assert steps[2] == output_constraint(spec, "genui") and steps[2] is not None
    assert not steps[2].or_text
    assert steps[3] is None  # chat answers in text: nothing to enforce


def test_preparing_a_harness_compiles_each_grammar_it_enforces_once() -> None:
    class Recording(InstantEngine):
        def __init__(self) -> None:
            super().__init__(fixed_reply("ok"))
            self.prepared: list[OutputConstraint] = []

        def prepare(self, constraint: OutputConstraint) -> None:
            self.prepared.append(constraint)

    engine = Recording()
    prepare_harness(engine, ROOT)
    assert engine.prepared == []  # harness@0 enforces nothing
    agent = ROOT.spec.specialists["agent"].model_copy(
        update={"enforce_grammar": True, "tool_choice": "required"}
    )
    genui = ROOT.spec.specialists["genui"].model_copy(update={"enforce_grammar": True})
    spec = ROOT.spec.model_copy(
        update={"specialists": {**ROOT.spec.specialists, "agent": agent, "genui": genui}}
    )
    prepare_harness(
        engine, HarnessVersion(version=1, sha256=spec.address, parent_version=0, spec=spec)
    )
    expected = [
        output_constraint(spec, "agent", first_step=True),  # a call and nothing else
        output_constraint(spec, "agent", first_step=False),  # then text or a call
        output_constraint(spec, "genui"),
    ]
    assert engine.prepared == expected and len({c.or_text for c in expected if c}) == 2
    with pytest.raises(ConstraintUnsupported):
        InstantEngine(fixed_reply("ok")).prepare(engine.prepared[-1])


# --- feedback ------------------------------------------------------------------------------


def test_feedback_is_recorded_and_an_edit_needs_its_text() -> None:
    h = Harness(fixed_reply("first answer"))

    async def case() -> None:
        done = await h.turn()
        cid, tid = done.conversation_id, done.turn_id
        with pytest.raises(InvalidFrame, match="needs edited_text"):
            await h.chat.feedback(h.principal, cid, feedback(tid, "edit"))
        with pytest.raises(InvalidFrame, match="only with feedback of kind edit"):
            await h.chat.feedback(h.principal, cid, feedback(tid, "up", "text"))
        with pytest.raises(TurnNotFound):
            await h.chat.feedback(h.principal, cid, feedback(uuid.uuid4(), "up"))
        with pytest.raises(TurnNotFound):
            await h.chat.feedback(h.principal, None, feedback(tid, "up"))
        await h.chat.feedback(h.principal, cid, feedback(tid, "edit", "better answer"))
        read_back = transcript(await h.chat.conversation(h.principal, cid))
        assert read_back.turns[0]["answer"] == "better answer"
        assert read_back.turns[0]["feedback"] == ["edit"]

    run(case)
    assert h.types()[-1] == "FeedbackGiven"
    assert [(f.kind, f.edited_text) for f in h.payloads(FeedbackGiven)] == [
        ("edit", "better answer")
    ]


def test_a_reroute_is_a_routing_correction_and_answers_again_with_that_specialist() -> None:
    h = Harness(fixed_reply("an answer"))

    reroute = commands.Reroute

    async def case() -> TurnOutcome:
        done = await h.turn("write me a haiku")  # chat, by the test router
        cid, tid = done.conversation_id, done.turn_id
        with pytest.raises(UnknownSpecialist, match="no active specialist 'poetry'"):
            await h.chat.reroute(h.principal, cid, reroute(tid, "poetry"))
        with pytest.raises(InvalidFrame, match="answered by chat already"):
            await h.chat.reroute(h.principal, cid, reroute(tid, "chat"))
        with pytest.raises(TurnNotFound):
            await h.chat.reroute(h.principal, cid, reroute(uuid.uuid4(), "coding"))
        with pytest.raises(ConversationNotFound):  # another tenant's
            await h.chat.reroute(principal("tenant-b"), cid, reroute(tid, "coding"))
        request = await h.chat.reroute(h.principal, cid, reroute(tid, "coding"))
        assert (request.content, request.specialist_hint, request.regenerates) == (
            "write me a haiku",
            "coding",
            tid,
        )
        return await h.chat.run_turn(h.principal, request, h.sink, asyncio.Event())

    again = run(case)
    assert [(c.turn_id, c.specialist) for c in h.payloads(RoutingCorrected)] == [
        (h.payloads(TurnReceived)[0].turn_id, "coding")
    ]
    assert h.payloads(RouterDecided)[-1].specialist == "coding"
    assert h.payloads(TurnReceived)[-1].regenerates == h.payloads(TurnReceived)[0].turn_id
    assert again.turn_id == h.payloads(TurnReceived)[-1].turn_id


def feedback(turn_id: uuid.UUID, kind: str, text: str | None = None) -> commands.Feedback:
    return commands.Feedback(turn_id, kind, text)  # type: ignore[arg-type]
