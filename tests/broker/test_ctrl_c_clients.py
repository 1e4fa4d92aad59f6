"""Ctrl-C in the terminal of the chat client and of the chat page's server, as a user presses
it (pexpect's ``sendintr``: SIGINT to the terminal's foreground process group): each stops
what it is doing, the way it says, without a traceback. The broker is real; no worker runs
(a retained ``online`` status stands in for one, so that the client sends): the replies never
come, which is what lets a Ctrl-C land while one is awaited."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import pexpect
import pytest

from devtools.chat_terminal import PROMPT, Chat, chat_command, in_terminal
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from devtools.mqtt_client import pretend_worker as pretend_worker_on
from devtools.waiting import PATIENCE


def spawn(command: list[str]) -> pexpect.spawn:
    return in_terminal(command, timeout=PATIENCE)


def ended(child: pexpect.spawn) -> tuple[int, str]:
    """Its exit code and what it printed last, once it has exited."""
    child.expect(pexpect.EOF, timeout=PATIENCE)
    child.close()
    assert child.signalstatus is None, f"killed by signal {child.signalstatus}"
    return int(child.exitstatus), str(child.before)


@pytest.fixture
def pretend_worker(broker: Mosquitto) -> Iterator[Client]:
    """A retained ``online`` status on the prefix ``ctrlc`` (removed after), and a watcher of
    what the client publishes there."""
    with pretend_worker_on(broker.port, "ctrlc", "control") as watch:
        yield watch


def test_one_shot_chat_ctrl_c_cancels_its_request_and_exits_130(broker: Mosquitto, pretend_worker: Client) -> None:
    child = spawn(chat_command(broker.port, "--topic-prefix", "ctrlc", "--session", "s1", "--message", "hi"))
    request = pretend_worker.wait_for(lambda m: m.topic == "ctrlc/anon/s1/request", timeout=PATIENCE).json()
    child.sendintr()
    code, printed = ended(child)
    assert code == 130 and "Traceback" not in printed, printed
    control = pretend_worker.wait_for(lambda m: m.topic == "ctrlc/anon/s1/control", timeout=PATIENCE).json()
    assert control == {"action": "cancel", "requestId": request["requestId"]}


def test_interactive_chat_ctrl_c_cancels_then_stops_waiting_then_leaves(
    broker: Mosquitto, pretend_worker: Client
) -> None:
    chat = Chat(broker.port, "--topic-prefix", "ctrlc", "--session", "s2")
    chat.send("hello?")
    request = pretend_worker.wait_for(lambda m: m.topic == "ctrlc/anon/s2/request", timeout=PATIENCE).json()
    chat.child.sendintr()  # the first: cancels the reply
    chat.expect(r"\[cancelling \(Ctrl-C again to stop waiting\)\]")
    control = pretend_worker.wait_for(lambda m: m.topic == "ctrlc/anon/s2/control", timeout=PATIENCE).json()
    assert control == {"action": "cancel", "requestId": request["requestId"]}
    chat.child.sendintr()  # the second: stops waiting for it
    chat.expect(r"\[stopped waiting\]")
    chat.child.expect_exact(PROMPT)
    chat.child.sendintr()  # at the prompt: says how to leave
    chat.expect(r"\[Ctrl-C again, /quit or Ctrl-D to leave\]")
    chat.child.sendintr()  # and leaves on a second
    chat.child.expect_exact("bye")
    code, printed = ended(chat.child)
    assert code == 0 and "Traceback" not in printed, printed


def test_interactive_chat_ctrl_c_while_the_broker_is_away_gives_up(broker: Mosquitto) -> None:
    child = spawn(chat_command(1))  # nothing listens on port 1
    child.expect(r"cannot reach the broker at 127\.0\.0\.1:1 \(.*\); retrying, Ctrl-C to give up")
    child.sendintr()
    code, printed = ended(child)
    assert code == 130 and "Traceback" not in printed, printed


def test_the_chat_page_server_stops_on_ctrl_c() -> None:
    child = spawn([sys.executable, "-m", "worker.web", "--port", "0"])
    child.expect(r"Serving \S+ on http://127\.0\.0\.1:\d+/ \(Ctrl-C to stop\)")
    child.sendintr()
    code, printed = ended(child)
    assert code == 0 and "Stopped" in printed and "Traceback" not in printed, printed


def test_the_stats_a_chat_shows_when_idle_say_no_requests(broker: Mosquitto, pretend_worker: Client) -> None:
    """/stats of an idle worker: "no requests in the window", not latencies of 0.00."""
    idle = {
        "workerId": "pretend", "timestamp": 1.0, "uptimeS": 60.0, "intervalS": 30.0, "processed": 3, "errors": 0,
        "errorsByCode": {}, "cancelled": 0, "invalidTopics": 0, "promptTokensTotal": 30, "completionTokensTotal": 9,
        "cachedTokensTotal": 0, "requests": 0, "genTokensPerS": 0.0, "prefixCacheHitRateTotal": 0.5,
        "kvCacheUsage": 0.0, "gpuHitTokens": 0, "hostHitTokens": 0, "computedPromptTokens": 0, "kvOffloadGib": 0.0,
        "running": 0, "waiting": 0, "maxRunning": 0, "sessions": 1, "pending": 0,
    }  # fmt: skip
    pretend_worker.publish("ctrlc/_worker/pretend/stats", json.dumps(idle).encode(), retain=True)
    try:
        chat = Chat(broker.port, "--topic-prefix", "ctrlc")
        chat.send("/stats")
        line = chat.expect(r"\[worker pretend \(\d+ s ago\): ([^\]]*)\]")[1]
        assert "Processed=3, Errors=0, no requests in the window, KV=0.0%" in line, line
        assert "Latency" not in line and "GPU" not in line, line
        assert chat.quit() == 0
    finally:
        pretend_worker.publish("ctrlc/_worker/pretend/stats", b"", retain=True)
