"""DeviceTools' own rules, without a broker (tests/broker/test_device_tools.py has the real
round trips): the topic comes from the configuration only, a refused response topic makes
calls unavailable, answers are matched by correlation data, futures never stay pending; and
the transport's MQTT 5 properties of a call."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from loguru import logger

from worker.config.models import MqttToolConfig
from worker.tools.mqtt import DeviceTools, response_topic_for
from worker.tools.port import CallContext
from worker.transport.mqtt import outbound_properties
from worker.transport.port import Delivery, OutboundProperties, PublishNotSent, PublishRefused

RESPONSES = "chat/_tools/gpu-1/0123abcd"


class RecordingMessaging:
    """Messaging that records what is sent and lets the test answer. Only here, where no
    broker can show it: a subscription refused at SUBACK (mosquitto 2.0.11 grants them all),
    a publish failing in a chosen way at a chosen moment."""

    def __init__(self, *, watch_fails: Exception | None = None, send_fails: Exception | None = None) -> None:
        self.sent: list[tuple[str, bytes, OutboundProperties | None]] = []
        self.handler: Callable[[Delivery], None] | None = None
        self.unwatched: list[str] = []
        self.watch_fails = watch_fails
        self.send_fails = send_fails

    def send(
        self,
        topic: str,
        payload: bytes,
        *,
        qos: int = 1,
        retain: bool = False,
        properties: OutboundProperties | None = None,
    ) -> asyncio.Future[None]:
        self.sent.append((topic, payload, properties))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.send_fails is not None:
            done.set_exception(self.send_fails)
        else:
            done.set_result(None)
        return done

    async def watch(
        self, topic_filter: str, handler: Callable[[Delivery], None], *, qos: int = 1, retain_as_published: bool = True
    ) -> None:
        if self.watch_fails is not None:
            raise self.watch_fails
        self.handler = handler

    def unwatch(self, topic_filter: str) -> None:
        self.unwatched.append(topic_filter)

    def answer(self, payload: bytes, *, correlation: bytes | None = None, **users: str) -> None:
        """The device's answer to the last call (or with the given correlation data)."""
        assert self.handler is not None
        props = self.sent[-1][2]
        assert props is not None
        self.handler(
            Delivery(
                RESPONSES,
                payload,
                False,
                correlation_data=correlation if correlation is not None else props.correlation_data,
                user_properties=tuple(users.items()),
            )
        )


def tools_on(messaging: RecordingMessaging, timeout: float = 5.0) -> DeviceTools:
    configs = [
        MqttToolConfig(name="lamp_set", topic="devices/lamp/set", users=["*"], timeout=timeout),
        MqttToolConfig(name="sensor", topic="devices/sensor/read", users=["alice"], timeout=timeout),
    ]
    return DeviceTools(configs, messaging, RESPONSES)


CONTEXT = CallContext(request_id="req-1", tool_call_id="call-1", session="alice/s1")


async def answered_soon(messaging: RecordingMessaging, payload: bytes, **users: str) -> None:
    while not messaging.sent:
        await asyncio.sleep(0)
    messaging.answer(payload, **users)


def test_the_tools_are_the_configured_ones() -> None:
    tools = tools_on(RecordingMessaging())
    listed = {t.name: t for t in tools.tools()}
    assert set(listed) == {"lamp_set", "sensor"}
    assert listed["sensor"].allows("alice") and not listed["sensor"].allows("bob")
    assert listed["lamp_set"].source == "mqtt" and listed["lamp_set"].timeout == 5.0


def test_a_call_is_published_to_the_configured_topic_only_with_its_properties() -> None:
    """The arguments cannot name a topic: whatever the model writes goes to the tool's topic."""

    async def run() -> None:
        messaging = RecordingMessaging()
        tools = tools_on(messaging, timeout=2.5)
        await tools.start()
        arguments = {"on": True, "topic": "chat/alice/s1/request", "note": "ü"}
        outcome, _ = await asyncio.gather(
            tools.call("lamp_set", arguments, CONTEXT), answered_soon(messaging, b'{"on": true}')
        )
        assert outcome.ok and outcome.content == '{"on": true}'
        [(topic, payload, props)] = messaging.sent
        assert topic == "devices/lamp/set"
        assert payload == '{"on":true,"topic":"chat/alice/s1/request","note":"ü"}'.encode()
        assert props is not None
        assert props.response_topic == RESPONSES
        assert props.correlation_data is not None and len(props.correlation_data) == 16
        assert props.message_expiry == 3  # the timeout, rounded up
        assert props.user_properties == (("requestId", "req-1"), ("toolCallId", "call-1"))
        assert props.content_type == "application/json"

        # A tool this provider does not have: nothing is sent anywhere.
        unknown = await tools.call("chat/alice/s1/request", {}, CONTEXT)
        assert unknown.outcome == "unavailable" and len(messaging.sent) == 1
        await tools.close()
        assert messaging.unwatched == [RESPONSES]

    asyncio.run(run())


def test_every_call_gets_fresh_correlation_data() -> None:
    async def run() -> None:
        messaging = RecordingMessaging()
        tools = tools_on(messaging, timeout=0.05)
        await tools.start()
        for _ in range(3):
            assert (await tools.call("sensor", {}, CONTEXT)).outcome == "timeout"
        correlations = {props.correlation_data for _, _, props in messaging.sent if props is not None}
        assert len(correlations) == 3

    asyncio.run(run())


def test_a_refused_response_topic_makes_calls_unavailable_without_failing_the_start() -> None:
    errors: list[str] = []
    sink = logger.add(lambda m: errors.append(m.record["message"]), level="ERROR")

    async def run() -> None:
        messaging = RecordingMessaging(watch_fails=PublishRefused("subscription refused by the broker: Not authorized"))
        tools = tools_on(messaging)
        await tools.start()  # does not raise
        outcome = await tools.call("lamp_set", {"on": True}, CONTEXT)
        assert outcome.outcome == "unavailable" and "refused" in outcome.content
        assert messaging.sent == []  # refused before anything is published

    try:
        asyncio.run(run())
    finally:
        logger.remove(sink)
    assert any(RESPONSES in e and "refused" in e for e in errors), errors


def test_a_response_topic_not_subscribed_yet_still_lets_calls_go() -> None:
    """No connection at the start: the transport subscribes it on the next connect."""

    async def run() -> None:
        messaging = RecordingMessaging(watch_fails=PublishNotSent("not connected"))
        tools = tools_on(messaging, timeout=0.05)
        await tools.start()
        assert (await tools.call("lamp_set", {"on": True}, CONTEXT)).outcome == "timeout"
        assert len(messaging.sent) == 1

    asyncio.run(run())


@pytest.mark.parametrize("failure", [PublishRefused("refused by the broker: Not authorized"), PublishNotSent("closed")])
def test_a_call_the_broker_did_not_take_is_unavailable(failure: Exception) -> None:
    async def run() -> None:
        messaging = RecordingMessaging(send_fails=failure)
        tools = tools_on(messaging)
        await tools.start()
        outcome = await tools.call("lamp_set", {"on": True}, CONTEXT)
        assert outcome.outcome == "unavailable" and "not sent" in outcome.content
        assert tools.pending == 0
        assert len(messaging.sent) == 1  # tried once, not again

    asyncio.run(run())


def test_answers_are_matched_by_correlation_data_and_strangers_dropped() -> None:
    async def run() -> None:
        messaging = RecordingMessaging()
        tools = tools_on(messaging)
        await tools.start()
        call = asyncio.ensure_future(tools.call("sensor", {}, CONTEXT))
        while not messaging.sent:
            await asyncio.sleep(0)
        messaging.answer(b"not yours", correlation=b"x" * 16)  # another run's, or forged
        messaging.answer(b"no correlation", correlation=b"")
        await asyncio.sleep(0.01)
        assert not call.done()
        messaging.answer(b'{"temperature_c": 21.5}')
        messaging.answer(b"the same again")  # a duplicate of the answer: dropped
        outcome = await call
        assert outcome.content == '{"temperature_c": 21.5}'
        assert tools.pending == 0

    asyncio.run(run())


def test_a_device_error_and_bytes_that_are_not_utf8() -> None:
    async def run() -> None:
        messaging = RecordingMessaging()
        tools = tools_on(messaging)
        await tools.start()
        outcome, _ = await asyncio.gather(
            tools.call("lamp_set", {"on": 1}, CONTEXT),
            answered_soon(messaging, b"bad \xff arguments", outcome="error"),
        )
        assert (outcome.outcome, outcome.content) == ("error", "bad \ufffd arguments")
        assert len(messaging.sent) == 1 and tools.pending == 0

    asyncio.run(run())


def test_a_cancelled_or_closed_call_leaves_nothing_pending() -> None:
    async def run() -> None:
        messaging = RecordingMessaging()
        tools = tools_on(messaging)
        await tools.start()
        call = asyncio.ensure_future(tools.call("sensor", {}, CONTEXT))
        while not messaging.sent:
            await asyncio.sleep(0)
        assert tools.pending == 1
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert tools.pending == 0

        waiting = asyncio.ensure_future(tools.call("sensor", {}, CONTEXT))
        while len(messaging.sent) < 2:
            await asyncio.sleep(0)
        await tools.close()
        closed = await waiting
        assert closed.outcome == "unavailable" and "stopping" in closed.content
        assert tools.pending == 0

    asyncio.run(run())


def test_arguments_that_are_not_json_are_an_error_result() -> None:
    async def run() -> None:
        messaging = RecordingMessaging()
        tools = tools_on(messaging)
        await tools.start()
        outcome = await tools.call("lamp_set", {"on": {1, 2}}, CONTEXT)
        assert outcome.outcome == "error" and messaging.sent == []

    asyncio.run(run())


def test_the_response_topic_is_the_workers_own_and_stable() -> None:
    # Stable across starts: no stale subscription is left in the persistent broker session.
    assert response_topic_for("chat", "gpu-1") == response_topic_for("chat", "gpu-1") == "chat/_tools/gpu-1/responses"


def test_outbound_properties_as_paho_sends_them() -> None:
    props: Any = outbound_properties(
        OutboundProperties(
            response_topic="chat/_tools/gpu-1/ab",
            correlation_data=b"\x00\x01",
            message_expiry=7,
            user_properties=(("requestId", "r"), ("toolCallId", "c")),
            content_type="application/json",
        )
    )
    assert props.ResponseTopic == "chat/_tools/gpu-1/ab"
    assert props.CorrelationData == b"\x00\x01"
    assert props.MessageExpiryInterval == 7
    assert props.UserProperty == [("requestId", "r"), ("toolCallId", "c")]
    assert props.ContentType == "application/json"
    assert outbound_properties(None) is None
    assert outbound_properties(OutboundProperties()) is None


def test_arguments_and_results_are_logged_at_debug_only() -> None:
    lines: list[tuple[str, str]] = []
    sink = logger.add(lambda m: lines.append((m.record["level"].name, str(m))), level="DEBUG")

    async def run() -> None:
        messaging = RecordingMessaging()
        tools = tools_on(messaging, timeout=0.2)
        await tools.start()
        for users in ({}, {"outcome": "error"}):
            await asyncio.gather(
                tools.call("lamp_set", {"on": "ARG-MARKER"}, CONTEXT),
                answered_soon(messaging, b"RESULT-MARKER", **users),
            )
            messaging.sent.clear()
        await tools.call("lamp_set", {"on": "ARG-MARKER"}, CONTEXT)  # a timeout
        refusing = tools_on(RecordingMessaging(send_fails=PublishRefused("Not authorized")))
        await refusing.start()
        await refusing.call("lamp_set", {"on": "ARG-MARKER"}, CONTEXT)

    try:
        asyncio.run(run())
    finally:
        logger.remove(sink)
    assert any("ARG-MARKER" in text for level, text in lines if level == "DEBUG")  # the check can see them
    assert any("RESULT-MARKER" in text for level, text in lines if level == "DEBUG")
    above = [text for level, text in lines if level != "DEBUG"]
    assert above and not [t for t in above if "MARKER" in t], above
