"""The worker's tool loop (issue 23) without devices or an engine: the service on the fake
engine, which plays the model's text round by round, vLLM's real hermes parser, and a fake
toolbox that records each call. What is checked: rounds run until the model answers, parallel
calls, confirmation, client calls in the same round, the limits, the namespace rules, and the
progress journal that keeps a redelivered request from calling a device twice."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from devtools.fakes import FakeToolbox, Harness
from devtools.waiting import PATIENCE
from worker.core.history import user_message
from worker.engine.tokenizer import ChatTokenizer
from worker.engine.vllm import tool_support
from worker.session import (
    UNKNOWN_RESULT,
    Progress,
    ToolCall,
    Turn,
    WorkerCallRecord,
    assistant_message,
    tool_message,
)
from worker.store.port import encode_progress
from worker.store.sqlite import SqliteStore
from worker.tools.port import CallContext, ToolOutcome, WorkerTool

LAMP = WorkerTool(
    "lamp_set",
    "Switch the lamp",
    {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]},
    ("u",),
    source="mqtt",
)
SENSOR = WorkerTool("sensor_read", "Read the room sensor", None, ("*",), source="mqtt")
SAFE = WorkerTool("door_open", "Open the front door", None, ("u",), confirm=True, source="mqtt")
SECRET = WorkerTool("vault_open", "Other namespace's", None, ("admin",), source="mqtt")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def call(name: str, arguments: dict[str, Any] | None = None) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments or {})}}}\n</tool_call>'


@pytest.fixture
def box() -> FakeToolbox:
    return FakeToolbox(LAMP, SENSOR, SAFE, SECRET)


def make(tokenizer: ChatTokenizer, box: FakeToolbox, **kwargs: Any) -> Harness:
    return Harness(tools=tool_support("auto", tokenizer, "tiny"), toolbox=box, **kwargs)


def ask(h: Harness, session: str, *payloads: dict[str, Any], timeout: float = PATIENCE) -> list[dict[str, Any]]:
    async def scenario() -> None:
        before = len(h.transport.replies(session))
        for payload in payloads:
            h.transport.deliver(f"chat/u/{session}/request", payload)
        await h.run_until(lambda: len(h.transport.replies(session)) == before + len(payloads), timeout)

    asyncio.run(scenario())
    return h.transport.replies(session)[-len(payloads) :]


def test_a_device_loop_runs_until_the_model_answers(tokenizer: ChatTokenizer, box: FakeToolbox) -> None:
    h = make(tokenizer, box)
    box.answer = lambda name, args: '{"occupied": false}' if name == "sensor_read" else '{"on": false}'
    h.engine.rounds["r1"] = [call("sensor_read"), call("lamp_set", {"on": False}), "The room is empty; lamp off."]
    payload = {"message": "Lamp off if empty", "requestId": "r1", "workerTools": ["*"], "stream": True}
    (reply,) = ask(h, "s", payload)
    assert reply["reply"] == "The room is empty; lamp off." and reply["finishReason"] == "stop"
    assert "toolCalls" not in reply
    assert [(n, a) for n, a, _ in box.calls] == [("sensor_read", {}), ("lamp_set", {"on": False})]
    listed = reply["workerCalls"]
    assert [c["name"] for c in listed] == ["sensor_read", "lamp_set"] and [c["round"] for c in listed] == [0, 1]
    assert all(c["outcome"] == "ok" for c in listed) and listed[1]["result"] == '{"on": false}'
    assert len(reply["rounds"]) == 3
    # The devices got the request's id and the call's id (their dedup key).
    contexts = [ctx for _, _, ctx in box.calls]
    assert all(ctx.request_id == "r1" and ctx.session == "u/s" for ctx in contexts)
    assert [ctx.tool_call_id for ctx in contexts] == [c["id"] for c in listed]
    # The session holds every call and result as messages.
    (turn,) = h.service.sessions.get("u/s").turns
    assert [m["role"] for m in turn.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert turn.messages[4]["content"] == '{"on": false}'
    # The stream: a start and an end event per call, the answer's text, no markup.
    deltas = [p for t, p in h.transport.published if t.endswith("/s/stream")]
    events = [d["toolEvent"] for d in deltas if "toolEvent" in d]
    assert [(e["event"], e["name"]) for e in events] == [
        ("start", "sensor_read"),
        ("end", "sensor_read"),
        ("start", "lamp_set"),
        ("end", "lamp_set"),
    ]
    assert events[1]["outcome"] == "ok" and events[1]["durationMs"] >= 0
    assert [d["seq"] for d in deltas] == list(range(len(deltas)))
    text = "".join(d["delta"] for d in deltas)
    assert "<tool_call>" not in text and text.endswith("lamp off.")


def test_calls_of_one_round_run_at_once_and_results_keep_the_calls_order(
    tokenizer: ChatTokenizer, box: FakeToolbox
) -> None:
    box.delay = 0.2
    h = make(tokenizer, box)
    h.engine.rounds["p1"] = [call("sensor_read") + "\n" + call("lamp_set", {"on": True}), "Done."]
    (reply,) = ask(h, "p", {"message": "Both", "requestId": "p1", "workerTools": ["lamp_set", "sensor_read"]})
    assert reply["reply"] == "Done." and box.most_running == 2
    (turn,) = h.service.sessions.get("u/p").turns
    tools = [m["name"] for m in turn.messages if m["role"] == "tool"]
    assert tools == ["sensor_read", "lamp_set"]


def test_a_confirmed_tool_runs_only_once_approved(tokenizer: ChatTokenizer, box: FakeToolbox) -> None:
    h = make(tokenizer, box)
    h.engine.rounds["c1"] = [call("door_open")]
    (asked,) = ask(h, "c", {"message": "Open the door", "requestId": "c1", "workerTools": ["*"]})
    assert asked["finishReason"] == "tool_calls" and not box.calls
    (pending,) = asked["toolCalls"]
    assert pending["needsConfirmation"] is True and pending["function"]["name"] == "door_open"
    # A result instead of an approval is refused, and changes nothing.
    (wrong,) = ask(h, "c", {"toolResults": [{"toolCallId": pending["id"], "content": "ok"}], "requestId": "c2"})
    assert wrong["error"]["code"] == "invalid_request" and "approved" in wrong["error"]["message"]
    h.engine.rounds["c3"] = ["The door is open."]
    (done,) = ask(h, "c", {"toolResults": [{"toolCallId": pending["id"], "approved": True}], "requestId": "c3"})
    assert done["reply"] == "The door is open." and [n for n, _, _ in box.calls] == ["door_open"]
    assert done["workerCalls"][0]["id"] == pending["id"]
    # Declined: the model is told, nothing runs.
    h.engine.rounds["c4"] = [call("door_open")]
    (again,) = ask(h, "c", {"message": "Open it again", "requestId": "c4"})
    h.engine.rounds["c5"] = ["Fine, it stays shut."]
    declined = {"toolCallId": again["toolCalls"][0]["id"], "approved": False}
    (answer,) = ask(h, "c", {"toolResults": [declined], "requestId": "c5"})
    assert answer["reply"] == "Fine, it stays shut." and len(box.calls) == 1
    last = h.service.sessions.get("u/c").turns[-1]
    assert any(m["role"] == "tool" and "declined" in m["content"] for m in last.messages)


def test_client_calls_in_a_worker_round_end_the_request(tokenizer: ChatTokenizer, box: FakeToolbox) -> None:
    h = make(tokenizer, box)
    h.engine.rounds["m1"] = [call("sensor_read") + "\n" + call("get_weather", {"city": "Oslo"})]
    payload = {"message": "Weather and room", "requestId": "m1", "workerTools": ["*"], "tools": [WEATHER]}
    (reply,) = ask(h, "m", payload)
    assert reply["finishReason"] == "tool_calls" and [n for n, _, _ in box.calls] == ["sensor_read"]
    assert [c["function"]["name"] for c in reply["toolCalls"]] == ["get_weather"]
    assert "needsConfirmation" not in reply["toolCalls"][0]
    assert reply["workerCalls"][0]["name"] == "sensor_read"
    h.engine.rounds["m2"] = ["Oslo: 3 C; the room is empty."]
    result = {"toolCallId": reply["toolCalls"][0]["id"], "content": "3 C"}
    (answer,) = ask(h, "m", {"toolResults": [result], "requestId": "m2"})
    assert answer["reply"] == "Oslo: 3 C; the room is empty." and len(box.calls) == 1


def test_the_last_round_is_generated_without_tools(tokenizer: ChatTokenizer, box: FakeToolbox) -> None:
    h = make(tokenizer, box, tools_section={"max_tool_rounds": 2})
    h.engine.rounds["l1"] = [call("sensor_read"), call("sensor_read"), "Answer " + call("sensor_read")]
    (reply,) = ask(h, "l", {"message": "Loop", "requestId": "l1", "workerTools": ["*"]})
    assert len(box.calls) == 2 and reply["finishReason"] == "stop" and reply["reply"] == "Answer"
    assert "max_tool_rounds" in reply["toolParseError"]
    # A forced choice applies to the first round only: the second generation was not forced.
    first, second, third = h.engine.requests[-3:]
    assert (
        first.sampling.structured is None and second.sampling.structured is None and third.sampling.structured is None
    )


def test_a_forced_choice_applies_to_the_first_round_only(tokenizer: ChatTokenizer, box: FakeToolbox) -> None:
    h = make(tokenizer, box)
    h.engine.rounds["f1"] = ['{"name": "sensor_read", "arguments": {}}', "Read it."]
    payload = {"message": "Read", "requestId": "f1", "workerTools": ["*"], "toolChoice": "required"}
    (reply,) = ask(h, "f", payload)
    assert reply["reply"] == "Read it." and [n for n, _, _ in box.calls] == ["sensor_read"]
    forced, free = h.engine.requests[-2:]
    assert forced.sampling.structured is not None and free.sampling.structured is None


def test_limits_calls_per_round_and_tool_time(tokenizer: ChatTokenizer, box: FakeToolbox) -> None:
    h = make(tokenizer, box, tools_section={"max_calls_per_round": 1})
    h.engine.rounds["k1"] = [call("sensor_read") + "\n" + call("sensor_read"), "ok"]
    (reply,) = ask(h, "k", {"message": "Two", "requestId": "k1", "workerTools": ["*"]})
    assert len(box.calls) == 1 and [c["outcome"] for c in reply["workerCalls"]] == ["ok", "skipped"]
    box.delay = 0.5
    h2 = make(tokenizer, box, tools_section={"max_tool_time": 0.2})
    h2.engine.rounds["t1"] = [call("sensor_read"), "late"]
    (slow,) = ask(h2, "t", {"message": "Slow", "requestId": "t1", "workerTools": ["*"]})
    assert slow["reply"] == "late" and slow["workerCalls"][0]["outcome"] == "timeout"


def test_a_timeout_or_error_is_a_result_and_the_turn_goes_on(tokenizer: ChatTokenizer, box: FakeToolbox) -> None:
    h = make(tokenizer, box)
    box.answer = lambda name, args: ToolOutcome("Error: the device did not answer within 5 s.", "timeout")
    h.engine.rounds["e1"] = [call("lamp_set", {"on": True}), "The lamp did not answer."]
    (reply,) = ask(h, "e", {"message": "On", "requestId": "e1", "workerTools": ["lamp_set"]})
    assert reply["reply"] == "The lamp did not answer." and reply["workerCalls"][0]["outcome"] == "timeout"
    assert h.service.stats.tool_calls["timeout"] == 1


def test_long_results_are_cut_and_the_cut_is_said(tokenizer: ChatTokenizer, box: FakeToolbox) -> None:
    h = make(tokenizer, box, tools_section={"max_tool_result_tokens": 16})
    box.answer = lambda name, args: "word " * 500
    h.engine.rounds["x1"] = [call("sensor_read"), "ok"]
    ask(h, "x", {"message": "Big", "requestId": "x1", "workerTools": ["*"]})
    (turn,) = h.service.sessions.get("u/x").turns
    result = next(m["content"] for m in turn.messages if m["role"] == "tool")
    assert result.count("word") == 16 and "cut" in result and "500" in result


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        ({"workerTools": ["nope"]}, "not a worker tool"),
        ({"workerTools": ["vault_open"]}, "not a worker tool"),  # configured, but for admin only
        ({"workerTools": ["*", "lamp_set"]}, '["*"] alone'),
        ({"workerTools": ["lamp_set"], "tools": [{"type": "function", "function": {"name": "lamp_set"}}]}, "name"),
    ],
)
def test_worker_tools_a_namespace_may_not_use_are_refused(
    tokenizer: ChatTokenizer, box: FakeToolbox, payload: dict[str, Any], words: str
) -> None:
    h = make(tokenizer, box)
    (reply,) = ask(h, "w", {"message": "Hi", "requestId": "w1", **payload})
    assert reply["error"]["code"] == "invalid_request" and words in reply["error"]["message"]
    assert not h.engine.requests and h.service.sessions.get("u/w").worker_tools == []


def test_the_session_keeps_its_worker_tools_and_never_offers_others(tokenizer: ChatTokenizer, box: FakeToolbox) -> None:
    h = make(tokenizer, box)
    h.engine.rounds["o1"] = ["hi"]
    ask(h, "o", {"message": "Hi", "requestId": "o1", "workerTools": ["*"]})
    assert h.service.sessions.get("u/o").worker_tools == ["*"]
    # The model calls a tool of another namespace: not offered, so not taken as a call.
    h.engine.rounds["o2"] = [call("vault_open")]
    (reply,) = ask(h, "o", {"message": "Open the vault", "requestId": "o2"})
    assert not box.calls and "not a declared tool" in reply["toolParseError"]
    h.engine.rounds["o3"] = ["plain"]
    ask(h, "o", {"message": "Stop", "requestId": "o3", "workerTools": []})
    assert h.service.sessions.get("u/o").worker_tools == []


def test_a_redelivered_request_never_calls_a_device_twice(tmp_path: Any, tokenizer: ChatTokenizer) -> None:
    """The progress of a request that died mid-loop, as the store kept it: the first call has
    its result, the second was (maybe) sent with none. A redelivery reuses the first result,
    gives the second an unknown outcome, calls nothing, and answers once."""
    store = SqliteStore(tmp_path)
    box = FakeToolbox(LAMP, SENSOR)
    h = make(tokenizer, box, store=store)
    turn = Turn("d1", [user_message("Lamp off if empty")])
    sensor_id, lamp_id = "call_a_0", "call_b_0"
    turn.messages.append(assistant_message("", [ToolCall(sensor_id, "sensor_read", {})]))
    turn.messages.append(tool_message(sensor_id, "sensor_read", '{"occupied": false}'))
    turn.messages.append(assistant_message("", [ToolCall(lamp_id, "lamp_set", {"on": False})]))
    progress = Progress(turn, {sensor_id: WorkerCallRecord("ok", 12.0, 0)})
    h.service.sessions.get("u/d")  # the session exists
    asyncio.run(_save_state(h, workerTools=["*"]))
    store.save_progress("u/d", "d1", encode_progress(progress))
    h.engine.rounds["d1"] = ["I could not tell whether the lamp switched."]
    (reply,) = ask(h, "d", {"message": "Lamp off if empty", "requestId": "d1"})
    assert not box.calls  # nothing sent again
    assert reply["reply"] == "I could not tell whether the lamp switched."
    outcomes = {c["name"]: c["outcome"] for c in reply["workerCalls"]}
    assert outcomes == {"sensor_read": "ok", "lamp_set": "unknown"}
    (stored,) = h.service.sessions.get("u/d").turns
    assert stored.messages[-2]["content"] == UNKNOWN_RESULT
    assert store.load_progress("u/d", "d1") is None  # the answer replaced it
    # The same request delivered once more: the stored answer, still no call.
    (again,) = ask(h, "d", {"message": "Lamp off if empty", "requestId": "d1"})
    assert again == reply and not box.calls


def test_progress_is_stored_before_a_call_is_sent(tmp_path: Any, tokenizer: ChatTokenizer) -> None:
    store = SqliteStore(tmp_path)
    box = FakeToolbox(LAMP)
    seen: list[str | None] = []

    def answer(name: str, args: Any) -> str:
        seen.append(store.load_progress("u/j", "j1"))
        return "on"

    box.answer = answer
    h = make(tokenizer, box, store=store)
    h.engine.rounds["j1"] = [call("lamp_set", {"on": True}), "On."]
    ask(h, "j", {"message": "On", "requestId": "j1", "workerTools": ["*"]})
    (at_call,) = seen
    assert at_call is not None and '"lamp_set"' in at_call  # the call was on record before it ran


async def _save_state(h: Harness, **session: Any) -> None:
    history = await h.service.sessions.aget("u/d")
    draft = history.draft()
    draft.worker_tools = session["workerTools"]
    await h.service.sessions.asave("u/d", draft, "setup", None)


def test_context_ids_are_stable_for_a_redelivery() -> None:
    from worker.core.calls import call_id, call_key

    request = call_key("chat/gpu-1", "u/s", "r1")
    assert call_id(request, 0, 0) == call_id(call_key("chat/gpu-1", "u/s", "r1"), 0, 0) != call_id(request, 1, 0)
    assert CallContext("r1", call_id(request, 0, 0), "u/s").tool_call_id.startswith("call_")


def test_call_ids_are_unique_across_users_sessions_and_workers() -> None:
    """The same requestId in another namespace, another session or another worker (group)
    names other calls; parts cannot run into each other."""
    from worker.core.calls import call_id, call_key

    keys = [
        call_key("chat/gpu-1", "alice/s1", "h1"),
        call_key("chat/gpu-1", "bob/s1", "h1"),
        call_key("chat/gpu-1", "alice/s2", "h1"),
        call_key("chat/gpu-2", "alice/s1", "h1"),
        call_key("other/gpu-1", "alice/s1", "h1"),
        call_key("chat/gpu-1", "alice/s1", "h2"),
        call_key("chat/gpu-1", "alice/s1h", "1"),
        call_key("chat/gpu-1", "alice/s1", "\ud800"),  # any text encodes
    ]
    ids = {call_id(key, round_, index) for key in keys for round_ in range(3) for index in range(3)}
    assert len(ids) == len(keys) * 9


def test_the_next_generation_continues_the_ids_the_model_generated(tiny_model: Any, tmp_path: Any) -> None:
    """A forced call's JSON as generated (compact, split into tokens the way the model chose)
    and as the template writes it again (spaced): the next prompt is the previous prompt, the
    generated ids and the rest encoded, so the prefix cache holds everything before the
    results. A text the template rewrote into another value is not continued."""
    import shutil

    from devtools.tinymodel import qwen25_chat_template
    from worker.core.pending import Continuation as _Continuation

    model = tmp_path / "qwen"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        shutil.copy(tiny_model / name, model / name)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = qwen25_chat_template()
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    renderer = ChatTokenizer(str(model))
    runner = Harness().service.turns
    runner.renderer = renderer
    tools = [LAMP.spec().template_form()]
    asked = [{"role": "user", "content": "Lamp on"}]
    prompt_text = renderer.render_text(asked, add_generation_prompt=True, tools=tools) + "<tool_call>\n"
    prompt_ids = renderer.encode(prompt_text)
    generated_text = '{"name":"lamp_set","arguments":{"on":true}}'
    # One id per character: certainly not how the text encodes.
    generated_ids = [i for c in generated_text for i in renderer.encode(c)] + list(renderer.stop_token_ids[:1])
    previous = _Continuation(prompt_ids, prompt_text, generated_text, generated_ids, forced=True)
    stored = [*asked, assistant_message("", [ToolCall("call_1", "lamp_set", {"on": True})])]
    stored.append(tool_message("call_1", "lamp_set", '{"on": true}'))
    next_text = renderer.render_text(stored, add_generation_prompt=True, tools=tools)
    assert generated_text not in next_text  # the template spaced it
    ids = runner._continuation(previous, next_text)
    assert ids is not None and ids[: len(prompt_ids) + len(generated_ids) - 1] == prompt_ids + generated_ids[:-1]
    rest = renderer.encode(next_text[next_text.rindex("\n</tool_call>") :])
    assert ids[len(prompt_ids) + len(generated_ids) - 1 :] == rest and "</tool_call>" in next_text
    other = _Continuation(
        prompt_ids, prompt_text, '{"name":"lamp_set","arguments":{"on":false}}', generated_ids, forced=True
    )
    assert runner._continuation(other, next_text) is None


def test_a_redelivery_does_not_force_its_first_round_again(tmp_path: Any, tokenizer: ChatTokenizer) -> None:
    """The forced first round happened before the crash (its call is in the progress): the
    redelivered request goes on with the next round, generated freely, not forced again."""
    from worker.core.calls import call_id, call_key

    store = SqliteStore(tmp_path)
    box = FakeToolbox(SENSOR)
    h = make(tokenizer, box, store=store)
    first = call_id(call_key(h.service.turns.call_scope, "u/g", "g1"), 0, 0)  # as the first delivery named it
    turn = Turn("g1", [user_message("Anyone in?")])
    turn.messages.append(assistant_message("", [ToolCall(first, "sensor_read", {})]))
    turn.messages.append(tool_message(first, "sensor_read", '{"occupied": false}'))
    store.save_progress("u/g", "g1", encode_progress(Progress(turn, {first: WorkerCallRecord("ok", 3.0, 0)})))
    h.engine.rounds["g1"] = ["Nobody is in."]
    sensor = {"type": "function", "function": {"name": "sensor_read"}}
    payload = {"message": "Anyone in?", "requestId": "g1", "workerTools": ["*"], "toolChoice": sensor}
    (reply,) = ask(h, "g", payload)
    assert reply["reply"] == "Nobody is in." and not box.calls
    (generation,) = h.engine.requests
    assert generation.sampling.structured is None  # not forced again


def test_an_approved_call_is_on_record_before_it_runs(tmp_path: Any, tokenizer: ChatTokenizer) -> None:
    store = SqliteStore(tmp_path)
    box = FakeToolbox(SAFE)
    seen: list[str | None] = []

    def answer(name: str, args: Any) -> str:
        seen.append(store.load_progress("u/v", "v2"))
        return "open"

    box.answer = answer
    h = make(tokenizer, box, store=store)
    h.engine.rounds["v1"] = [call("door_open")]
    (asked,) = ask(h, "v", {"message": "Open", "requestId": "v1", "workerTools": ["*"]})
    approval = {"toolCallId": asked["toolCalls"][0]["id"], "approved": True}
    h.engine.rounds["v2"] = ["Open."]
    ask(h, "v", {"toolResults": [approval], "requestId": "v2"})
    (at_call,) = seen
    assert at_call is not None and asked["toolCalls"][0]["id"] in at_call


def test_a_request_cancelled_before_its_approved_calls_ran_sends_none(
    tokenizer: ChatTokenizer, box: FakeToolbox
) -> None:
    """An approval cancelled while it waits for its turn: the approved call is not sent and the
    session is as it was (the call still pending, so a later approval runs it, once)."""
    h = make(tokenizer, box)
    h.engine.rounds["q1"] = [call("door_open")]
    (asked,) = ask(h, "q", {"message": "Open", "requestId": "q1", "workerTools": ["*"]})
    approval = {"toolCallId": asked["toolCalls"][0]["id"], "approved": True}

    async def scenario() -> None:
        # The cancel is dispatched right after the approval, before its turn starts.
        h.transport.deliver("chat/u/q/request", {"toolResults": [approval], "requestId": "q2"})
        h.transport.deliver("chat/u/q/control", {"action": "cancel", "requestId": "q2"})
        await h.run_until(lambda: len(h.transport.replies("q")) == 2)

    asyncio.run(scenario())
    cancelled = h.transport.replies("q")[-1]
    assert cancelled["requestId"] == "q2" and cancelled["finishReason"] == "cancelled", cancelled
    assert not box.calls
    session = h.service.sessions.get("u/q")
    assert session.open_turn is not None and [c.name for c in session.open_turn.pending_calls()] == ["door_open"]
    h.engine.rounds["q3"] = ["Opened."]
    (done,) = ask(h, "q", {"toolResults": [approval], "requestId": "q3"})
    assert done["reply"] == "Opened." and [n for n, _, _ in box.calls] == ["door_open"]
