"""The chat client (``python -m worker.chat``) in a real terminal (pexpect's pseudo-terminal)
and as a one-shot command, against the real mosquitto and the shared worker on the vLLM CPU
engine. The tiny random model's text is meaningless: the tests check structure (what was
sent, what came back, what the terminal shows), never the words or the timing."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pexpect
import pytest

from devtools.chat_terminal import PROMPT, REPLY, TOOL_CALL, USAGE, Chat, run_chat, tool_prompt
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from devtools.net import free_port
from devtools.waiting import PATIENCE
from devtools.worker_process import BLOCK_SIZE, WorkerProcess

pytestmark = pytest.mark.e2e


def new_session() -> str:
    return "c-" + uuid.uuid4().hex[:12]


@pytest.fixture
def chats() -> Iterator[list[Chat]]:
    started: list[Chat] = []
    yield started
    for chat in started:
        chat.kill()


def observer(port: int, user: str, session: str) -> Client:
    """A plain MQTT client that sees the session's requests, controls, replies and deltas (and
    its own markers)."""
    return Client(port, [f"chat/{user}/{session}/#", f"marker/{user}/{session}"])


def messages(client: Client, user: str, session: str, kind: str) -> list[dict[str, Any]]:
    """The session's messages of one kind seen so far: those the broker had before a marker
    the observer publishes now, which has come back (what the chat client has seen, the broker
    had)."""
    client.publish(f"marker/{user}/{session}", b"")
    client.wait_topic(f"marker/{user}/{session}", timeout=PATIENCE)
    topic = f"chat/{user}/{session}/{kind}"
    return [json.loads(m.payload) for m in client.received(lambda m: m.topic == topic)]


def test_two_turns_stream_and_show_cached_tokens(
    shared_worker: WorkerProcess, broker: Mosquitto, chats: list[Chat]
) -> None:
    session = new_session()
    watch = observer(broker.port, "chatter", session)
    system = "You are a helpful assistant who answers briefly and kindly. " * 4
    chat = Chat(
        broker.port, "--user", "chatter", "--session", session, "--show-stats", "--max-tokens", "16",
        "--system-prompt", system,
    )  # fmt: skip
    chats.append(chat)
    shown1, usage1 = chat.turn("Hello, who are you and what can you do?")
    noted1 = chat.length_noted
    shown2, usage2 = chat.turn("Tell me more about the mountains in winter.")
    noted2 = chat.length_noted
    prompt1, prompt2 = int(usage1[1]), int(usage2[1])
    assert prompt2 > prompt1 >= BLOCK_SIZE  # the second turn carries the first
    assert int(usage2[2]) >= prompt1 // BLOCK_SIZE * BLOCK_SIZE > 0  # the first prompt, from the prefix cache
    assert chat.quit() == 0

    requests = messages(watch, "chatter", session, "request")
    replies = messages(watch, "chatter", session, "reply")
    deltas = messages(watch, "chatter", session, "stream")
    watch.close()
    assert [r["stream"] for r in requests] == [True, True]
    assert [r["systemPrompt"] for r in requests] == [system, system]
    assert [r["requestId"] for r in replies] == [r["requestId"] for r in requests]
    for reply, shown, usage, noted in zip(replies, (shown1, shown2), (usage1, usage2), (noted1, noted2), strict=True):
        assert reply["usage"]["promptTokens"] == int(usage[1]) and reply["finishReason"] == usage[4]
        assert noted == (reply["finishReason"] == "length")  # a cut reply is said to be cut
        streamed = "".join(d["delta"] for d in deltas if d["requestId"] == reply["requestId"])
        assert streamed and streamed.strip() == reply["reply"].strip()  # streamed, and adds up
        assert shown.strip() == reply["reply"].strip()  # the terminal shows the reply


def test_reset_starts_over(shared_worker: WorkerProcess, broker: Mosquitto, chats: list[Chat]) -> None:
    session = new_session()
    chat = Chat(broker.port, "--user", "chatter", "--session", session, "--show-stats", "--max-tokens", "8")
    chats.append(chat)
    _, first = chat.turn("first message of the conversation")
    _, second = chat.turn("first message of the conversation")
    assert int(second[1]) > int(first[1])
    chat.send("/reset")
    chat.expect(r"\[session reset: history and system prompt cleared\]")
    chat.child.expect_exact(PROMPT)
    _, again = chat.turn("first message of the conversation")
    assert int(again[1]) == int(first[1])  # no history: the same prompt as the first turn
    assert chat.quit() == 0


def test_ctrl_c_and_cancel_stop_a_long_reply(
    shared_worker: WorkerProcess, broker: Mosquitto, chats: list[Chat]
) -> None:
    session = new_session()
    watch = observer(broker.port, "canceller", session)
    chat = Chat(broker.port, "--user", "canceller", "--session", session, "--max-tokens", "1000")
    chats.append(chat)
    stream = f"chat/canceller/{session}/stream"
    done: set[str] = set()
    for stop in ("ctrl-c", "/cancel"):
        chat.send("tell me a very long story")
        chat.child.expect_exact(REPLY)
        # Generating now: a delta of this request (not a late one of the one cancelled before).
        watch.wait_for(lambda m: m.topic == stream and m.json()["requestId"] not in done)
        if stop == "ctrl-c":
            chat.child.sendintr()
        else:
            chat.send("/cancel")
        chat.expect(r"\[cancelling \(Ctrl-C again to stop waiting\)\]")
        tokens = int(chat.expect(r"\[cancelled after (\d+) tokens\]")[1])
        chat.child.expect_exact(PROMPT)
        reply = watch.wait_topic(f"chat/canceller/{session}/reply").json()
        assert reply["finishReason"] == "cancelled" and reply["usage"]["completionTokens"] == tokens < 1000
        done.add(reply["requestId"])
    controls = messages(watch, "canceller", session, "control")
    assert [c["action"] for c in controls] == ["cancel", "cancel"]
    # Still usable: one Ctrl-C at the prompt does not quit, commands and turns go on.
    chat.child.sendintr()
    chat.expect(r"\[Ctrl-C again, /quit or Ctrl-D to leave\]")
    chat.send("/verbose on")
    chat.expect(r"\[stats after each reply: on\]")
    chat.child.expect_exact(PROMPT)
    chat.send("/cancel")
    chat.expect(r"\[nothing to cancel\]")
    chat.child.expect_exact(PROMPT)
    # Two in a row leave, as /quit does.
    chat.child.sendintr()
    chat.expect(r"\[Ctrl-C again, /quit or Ctrl-D to leave\]")
    chat.child.sendintr()
    chat.child.expect_exact("bye")
    chat.child.expect(pexpect.EOF)
    chat.child.close()
    assert chat.child.exitstatus == 0 and "Traceback" not in chat.child.before
    watch.close()


def test_stats_command_prints_the_workers_stats(
    shared_worker: WorkerProcess, broker: Mosquitto, chats: list[Chat]
) -> None:
    chat = Chat(broker.port)
    chats.append(chat)
    chat.send("/stats")
    line = chat.expect(r"\[worker shared \(\d+ s ago\): (Processed=\d+, Errors=\d+, [^\]]*)\]")[1]
    assert "PrefixHitTotal=" in line and "KV=" in line and "PromptTokens=" in line, line
    # The last interval's latencies, or that it had no requests (an idle worker's 0.00 s misled).
    assert ("no requests in the window" in line) != ("AvgLatency=" in line), line
    chat.send("/help")
    chat.expect(r"/reset .*\n.*/cancel")
    assert chat.quit() == 0


def test_one_shot_prints_the_reply_and_exits_0(shared_worker: WorkerProcess, broker: Mosquitto) -> None:
    session = new_session()
    watch = observer(broker.port, "scripter", session)
    first = run_chat(broker.port, "--user", "scripter", "--session", session, "--message", "hi", "--max-tokens", "8")
    assert first.returncode == 0, first.stderr
    # The message on stdin, same session, with the numbers on stderr.
    second = run_chat(
        broker.port, "--user", "scripter", "--session", session, "--max-tokens", "8", "--show-stats", stdin="again\n"
    )
    assert second.returncode == 0, second.stderr
    requests = messages(watch, "scripter", session, "request")
    replies = messages(watch, "scripter", session, "reply")
    watch.close()
    assert [r["message"] for r in requests] == ["hi", "again"]
    assert [first.stdout, second.stdout] == [r["reply"] + "\n" for r in replies]
    usage = USAGE.search(second.stderr)
    assert usage and int(usage[1]) == replies[1]["usage"]["promptTokens"] > replies[0]["usage"]["promptTokens"]


def test_one_shot_error_reply_exits_1(shared_worker: WorkerProcess, broker: Mosquitto) -> None:
    result = run_chat(broker.port, "--session", new_session(), "--message", "hi", "--max-tokens", "5000")
    assert result.returncode == 1 and result.stdout == ""
    assert "error invalid_request: " in result.stderr and "5000" in result.stderr


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--session", "no spaces please"], "invalid --user or --session"),
        (["--user", "_worker"], "reserved"),
        (["--max-tokens", "0"], "invalid request"),
        (["--topic-prefix", "a/+"], "topic_prefix (--topic-prefix)"),
        (["--mqtt-tls-cert-file", "/dev/null"], "tls_cert_file and tls_key_file go together"),
        (["--tools", "/nonexistent.json"], "cannot read /nonexistent.json"),
        (["--tools", "/dev/null"], "/dev/null is not JSON"),
        (["--max-tool-rounds", "0"], "must be at least 1"),
        (["--tool-command", ""], "--tool-command is empty"),
    ],
)
def test_one_shot_usage_errors_exit_2(broker: Mosquitto, args: list[str], problem: str) -> None:
    result = run_chat(broker.port, *args, "--message", "hi", "--timeout", "5")
    assert result.returncode == 2 and problem in result.stderr, result.stderr


def test_one_shot_without_worker_or_broker_exits_3_in_seconds(broker: Mosquitto) -> None:
    """Said within seconds, not after --timeout (120 s by default): no broker, naming where it
    was looked for; no worker online, judged from the workers' retained status, and then the
    message is not sent (nobody would answer it; a worker that starts later would)."""
    watch = Client(broker.port, ["nobody/#"])
    # Nobody serves the prefix "nobody" on this broker; one worker of it is known, offline.
    watch.publish("nobody/_worker/gone/status", b"offline", retain=True)
    # Not after --timeout: with an hour's, run_chat's own limit (300 s) would end the wait.
    result = run_chat(broker.port, "--topic-prefix", "nobody", "--message", "hi", "--timeout", "3600")
    assert result.returncode == 3, result.stderr
    assert f"no worker is online on 127.0.0.1:{broker.port} (offline: gone)" in result.stderr, result.stderr
    assert "nobody/_worker/+/status" in result.stderr and "the message was not sent" in result.stderr
    watch.publish("nobody/marker", b"")  # the client has exited: a request of its came before
    watch.wait_topic("nobody/marker", timeout=PATIENCE)
    assert not watch.received(lambda m: m.topic.endswith("/request"))
    watch.publish("nobody/_worker/gone/status", b"", retain=True)  # the retained status removed
    watch.close()
    port = free_port()
    result = run_chat(port, "--message", "hi", "--timeout", "3600")
    assert result.returncode == 3, result.stderr
    assert f"no connection to the broker at 127.0.0.1:{port} (" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_user_and_credentials_come_from_the_clients_own_settings(tmp_path: Path) -> None:
    """A broker that checks passwords (and lets anonymous clients in): CHAT_MQTT_* log the
    client in and name its namespace; the worker's WORKER_MQTT_* are never read."""
    passwords = tmp_path / "passwd"
    subprocess.run(["mosquitto_passwd", "-b", "-c", str(passwords), "carl", "s3cret"], check=True)
    (tmp_path / "carl-password").write_text("s3cret\n")
    own = Mosquitto(tmp_path, f"password_file {passwords}\n", keep_root=True)  # root reads the file
    own.start()
    watch = Client(own.port, ["chat/+/+/request"])
    # A worker that says it is online (none answers): the client sends only then.
    watch.publish("chat/_worker/pretend/status", b"online", retain=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CHAT_", "WORKER_"))}

    def namespace_of(env: dict[str, str], *args: str) -> str:
        """Where a one-shot request went (nobody answers here: it gives up after 2 s)."""
        result = run_chat(own.port, *args, "--session", "s1", "--message", "hi", "--timeout", "2", env=env)
        assert result.returncode == 3 and "no answer within 2 s" in result.stderr, result.stderr
        return watch.wait_for(lambda m: m.topic.endswith("/s1/request"), timeout=PATIENCE).topic.split("/")[1]

    try:
        assert namespace_of({**base, "WORKER_MQTT_USERNAME": "carl", "WORKER_MQTT_PASSWORD": "s3cret"}) == "anon"
        assert namespace_of({**base, "CHAT_MQTT_USERNAME": "carl", "CHAT_MQTT_PASSWORD": "s3cret"}) == "carl"
        with_file = {**base, "CHAT_MQTT_USERNAME": "carl", "CHAT_MQTT_PASSWORD_FILE": str(tmp_path / "carl-password")}
        assert namespace_of(with_file, "--user", "dora") == "dora"
        wrong = {**base, "CHAT_MQTT_USERNAME": "carl", "CHAT_MQTT_PASSWORD": "wrong"}
        refused = run_chat(own.port, "--message", "hi", "--timeout", "5", env=wrong)
        assert refused.returncode == 3 and "connection refused" in refused.stderr, refused.stderr
    finally:
        watch.close()
        own.stop()


def test_reconnects_after_the_broker_restarts(
    shared_worker: WorkerProcess, broker: Mosquitto, chats: list[Chat], tmp_path: Path
) -> None:
    """A broker of this test's own, bridged to the shared one (where the worker is): the client
    talks to it, it is restarted, the client reconnects, says so, and the conversation goes on."""
    bridge = (
        f"connection to-shared\naddress 127.0.0.1:{broker.port}\ntopic chat/# both 1\n"
        "cleansession false\nrestart_timeout 1\n"
    )
    own = Mosquitto(tmp_path, bridge, keep_root=True)  # keep_root: its persistence file is written
    own.start()
    try:
        session = new_session()
        chat = Chat(own.port, "--user", "roamer", "--session", session, "--show-stats", "--max-tokens", "8")
        chats.append(chat)
        _, before = chat.turn("hello before the restart")
        own.stop()
        chat.expect(r"\[connection to the broker lost \(.*\); reconnecting\]")
        own.restart()
        chat.expect(r"\[reconnected to the broker \(session resumed\)\]")
        chat.child.expect_exact(PROMPT)
        _, after = chat.turn("hello after the restart")
        assert int(after[1]) > int(before[1])  # the same conversation, one turn longer
        assert chat.quit() == 0
    finally:
        own.stop()


# ---- tool calls. The random model never calls a tool by itself: each round here starts with
# a forced call (--tool-choice), and the results (sent with the default toolChoice, auto) get
# a reply without calls, which ends the message's rounds. maxTokens leaves a forced call room
# to finish (a call cut short is no call).

TOOLS = [
    {"type": "function", "function": {"name": "get_time", "description": "The local time"}},
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.fixture
def tools_file(tmp_path: Path) -> Path:
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(TOOLS))
    return path


def test_a_tool_round_in_the_terminal(
    shared_worker: WorkerProcess, broker: Mosquitto, chats: list[Chat], tools_file: Path
) -> None:
    """The call is shown with its arguments, its result asked for and sent; the session keeps
    the tools (sent with the first message, and again after a reset); Ctrl-C at the result's
    prompt leaves the calls open, and the next message goes on."""
    session = new_session()
    watch = observer(broker.port, "toolsmith", session)
    chat = Chat(
        broker.port, "--user", "toolsmith", "--session", session, "--tools", str(tools_file),
        "--tool-choice", "get_time", "--max-tokens", "64", "--show-stats",
    )  # fmt: skip
    chats.append(chat)
    chat.send("What time is it?")
    call = chat.expect(TOOL_CALL.pattern)
    assert (call[1], json.loads(call[2])) == ("get_time", {})
    assert chat.expect(USAGE.pattern)[4] == "tool_calls"
    chat.child.expect_exact(tool_prompt("get_time"))
    chat.send("12:30 CET")
    chat.child.expect_exact(REPLY)
    assert chat.expect(USAGE.pattern)[4] in ("stop", "length")
    chat.child.expect_exact(PROMPT)

    chat.send("And now?")  # forced again: a call; Ctrl-C leaves it unanswered
    open_call = chat.expect(TOOL_CALL.pattern)[3]
    chat.child.expect_exact(tool_prompt("get_time"))
    chat.child.sendintr()
    chat.expect(r"\[the calls are left unanswered; the next message tells the model they were not run\]")
    chat.child.expect_exact(PROMPT)
    chat.send("Once more.")  # the worker tells the model the open call was not run
    chat.expect(TOOL_CALL.pattern)
    chat.child.expect_exact(tool_prompt("get_time"))
    chat.send("")  # an empty result is a result
    chat.expect(USAGE.pattern)
    chat.child.expect_exact(PROMPT)
    chat.send("/reset")
    chat.expect(r"\[session reset: history and system prompt cleared\]")
    chat.child.expect_exact(PROMPT)
    chat.send("After the reset.")
    chat.expect(TOOL_CALL.pattern)
    chat.child.expect_exact(tool_prompt("get_time"))
    chat.send("13:00")
    chat.expect(USAGE.pattern)
    chat.child.expect_exact(PROMPT)
    assert chat.quit() == 0

    requests = messages(watch, "toolsmith", session, "request")
    replies = [r for r in messages(watch, "toolsmith", session, "reply") if "action" not in r]
    watch.close()
    named = {"type": "function", "function": {"name": "get_time"}}
    assert [(r.get("message"), r.get("tools"), r.get("toolChoice")) for r in requests] == [
        ("What time is it?", TOOLS, named),
        (None, None, None),  # the results: the model is free to answer (auto)
        ("And now?", None, named),  # the session keeps the tools
        ("Once more.", None, named),
        (None, None, None),
        ("After the reset.", TOOLS, named),  # a reset cleared them: sent again
        (None, None, None),
    ]
    assert "error" not in str(replies)
    calls = [r["toolCalls"][0]["id"] if "toolCalls" in r else None for r in replies]
    assert calls[0] == call[3] and calls[2] == open_call and None not in (calls[3], calls[5])
    assert [c is None for c in calls] == [False, True, False, False, True, False, True]
    assert [r["toolResults"] for r in requests if "toolResults" in r] == [
        [{"toolCallId": calls[0], "content": "12:30 CET"}],
        [{"toolCallId": calls[3], "content": ""}],
        [{"toolCallId": calls[5], "content": "13:00"}],
    ]


def test_one_shot_answers_tool_calls_with_tool_result_values(
    shared_worker: WorkerProcess, broker: Mosquitto, tools_file: Path
) -> None:
    """NAME=TEXT answers that tool's calls; stdout has the final reply only, stderr the call
    and its result."""
    session = new_session()
    watch = observer(broker.port, "scripter", session)
    result = run_chat(
        broker.port, "--user", "scripter", "--session", session, "--tools", str(tools_file),
        "--tool-choice", "get_weather", "--message", "Weather?", "--max-tokens", "64",
        "--tool-result", "get_time=noon", "--tool-result", 'get_weather={"sky": "clear"}', "--tool-result", "other",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    requests = messages(watch, "scripter", session, "request")
    replies = messages(watch, "scripter", session, "reply")
    watch.close()
    (call,) = replies[0]["toolCalls"]
    assert call["function"]["name"] == "get_weather" and set(json.loads(call["function"]["arguments"])) == {"city"}
    assert requests[1]["toolResults"] == [{"toolCallId": call["id"], "content": '{"sky": "clear"}'}]
    assert result.stdout == replies[1]["reply"] + "\n" and "toolCalls" not in replies[1]
    assert f"[tool call: get_weather {call['function']['arguments']} ({call['id']})]" in result.stderr
    assert f'[tool result for {call["id"]}: {{"sky": "clear"}}]' in result.stderr


def test_one_shot_answers_tool_calls_with_a_command(
    shared_worker: WorkerProcess, broker: Mosquitto, tools_file: Path, tmp_path: Path
) -> None:
    session = new_session()
    watch = observer(broker.port, "scripter", session)
    tool = tmp_path / "tool.sh"
    tool.write_text('#!/bin/sh\nprintf "%s(%s) of %s" "$TOOL_NAME" "$(cat)" "$TOOL_CALL_ID"\n')
    tool.chmod(0o755)
    result = run_chat(
        broker.port, "--user", "scripter", "--session", session, "--tools", str(tools_file),
        "--tool-choice", "required", "--message", "Do something.", "--max-tokens", "64", "--tool-command", str(tool),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    requests = messages(watch, "scripter", session, "request")
    replies = messages(watch, "scripter", session, "reply")
    watch.close()
    (call,) = replies[0]["toolCalls"]
    function = call["function"]
    expected = f"{function['name']}({function['arguments']}) of {call['id']}"
    assert requests[1]["toolResults"] == [{"toolCallId": call["id"], "content": expected}]
    assert result.stdout == replies[1]["reply"] + "\n"


def test_one_shot_unanswered_calls_exit_4_and_a_later_run_answers_them(
    shared_worker: WorkerProcess, broker: Mosquitto, tools_file: Path
) -> None:
    """Nothing answers the calls: they are printed as JSON, exit 4. A second run answers them
    by id (here forcing another call, which its --tool-result TEXT answers; with
    --max-tool-rounds 1 those results ask for a text answer)."""
    session = new_session()
    watch = observer(broker.port, "scripter", session)
    base = ["--user", "scripter", "--session", session, "--max-tokens", "64"]
    first = run_chat(broker.port, *base, "--tools", str(tools_file), "--tool-choice", "get_time", "--message", "Time?")
    assert first.returncode == 4, first.stderr
    (printed,) = [json.loads(line) for line in first.stdout.splitlines()]
    assert printed["function"] == {"name": "get_time", "arguments": "{}"} and printed["type"] == "function"
    assert f"--session {session} --tool-result ID=TEXT" in first.stderr

    second = run_chat(
        broker.port, *base, "--tool-result", f"{printed['id']}=09:15", "--tool-choice", "required",
        "--tool-result", "=any=thing", "--max-tool-rounds", "1",
    )  # fmt: skip
    assert second.returncode == 0, second.stderr
    requests = messages(watch, "scripter", session, "request")
    replies = messages(watch, "scripter", session, "reply")
    watch.close()
    assert replies[0]["toolCalls"] == [printed]
    assert requests[1]["toolResults"] == [{"toolCallId": printed["id"], "content": "09:15"}]
    assert requests[1]["toolChoice"] == "required" and "tools" not in requests[1]
    (again,) = replies[1]["toolCalls"]
    assert requests[2]["toolResults"] == [{"toolCallId": again["id"], "content": "any=thing"}]
    assert requests[2]["toolChoice"] == "none"  # the last round allowed: a text answer
    assert "toolCalls" not in replies[2] and second.stdout == replies[2]["reply"] + "\n"
