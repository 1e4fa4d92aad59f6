"""Simulated devices for the worker's device tools ([[tools.mqtt]]), on MQTT 5 request/response.

    python -m devtools.devices --host 127.0.0.1 --port 1883 [--prefix devices] [--log calls.jsonl]
        [--delay-ms N] [--delay DEVICE=MS ...] [--username U --password P]

- ``<prefix>/lamp/set`` with ``{"on": true|false}``: switches the lamp, answers its state ``{"on": ...}``;
- ``<prefix>/lamp/get``: answers the lamp's state;
- ``<prefix>/sensor/read``: answers ``{"temperature_c": 21.5, "occupied": false}``;
- ``<prefix>/camera/snapshot``: the front-door camera; answers its snapshot, a JPEG
  (:func:`door_snapshot`: a drawn front door with a visitor holding a parcel) with the MQTT 5
  Content Type ``image/jpeg``, as a real camera would: on a vision model the worker puts it in
  the conversation as an image (docs/tools.md).

Each answer goes to the call's ResponseTopic with its CorrelationData (a call without a
ResponseTopic is logged and not answered). Calls are deduplicated by their ``toolCallId``
user property: a repeated id gets the stored answer again and does not actuate again. Bad
arguments are answered with the user property ``outcome=error``. Every call received is
appended to ``--log`` as a JSON line (topic, toolCallId, requestId, payload, time, duplicate),
for the fault tests: a device must see each call at most once. ``--delay-ms`` delays every
answer; ``--delay lamp/set=20000`` one device's (a slow lamp).

In-process (tests): ``SimulatedDevices(port=...)``, ``start()``, ``stop()``; ``calls`` holds
the same records as the log, ``answered`` one record per answer sent (toolCallId, topic,
payload, time), ``actuations`` counts the lamp switches. ``held`` devices answer only once the test
calls ``release(device)`` (a call kept outstanding for as long as a fault test needs, with no
race against a timer); ``wait_until`` waits for a condition on those records.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

SENSOR = {"temperature_c": 21.5, "occupied": False}
SNAPSHOT_SIZE = (320, 240)  # the camera's picture: 99 tokens of Qwen2-VL (28x28 pixels a token)


@functools.cache
def door_snapshot() -> bytes:
    """The front-door camera's snapshot: a JPEG of SNAPSHOT_SIZE (about 8 KB), drawn with PIL,
    the same bytes every time: a front door under its lamp and, on the step beside it, a
    visitor in a red coat holding a parcel, with the camera's caption in the corner."""
    from PIL import Image, ImageDraw

    width, height = SNAPSHOT_SIZE
    image = Image.new("RGB", SNAPSHOT_SIZE, (196, 184, 160))  # the house's wall
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 200, width, height), fill=(120, 120, 118))  # the path
    draw.rectangle((60, 192, 250, 206), fill=(150, 146, 140))  # the step
    draw.rectangle((100, 50, 190, 194), fill=(245, 242, 235))  # the door's frame
    draw.rectangle((108, 58, 182, 194), fill=(104, 52, 34))  # the door
    for top in (68, 132):  # its panels
        draw.rectangle((116, top, 174, top + 52), outline=(78, 38, 24), width=3)
    draw.ellipse((166, 124, 174, 132), fill=(212, 175, 55))  # the knob
    draw.ellipse((138, 22, 152, 36), fill=(255, 236, 150), outline=(90, 90, 90))  # the lamp
    draw.rectangle((22, 70, 80, 130), fill=(150, 190, 215), outline=(245, 242, 235), width=4)  # a window
    # The visitor: head, red coat, legs, and a parcel in the arms.
    draw.ellipse((215, 78, 245, 110), fill=(224, 180, 150))
    draw.rounded_rectangle((205, 108, 255, 172), radius=10, fill=(190, 40, 40))
    draw.rectangle((212, 170, 226, 200), fill=(40, 40, 60))
    draw.rectangle((234, 170, 248, 200), fill=(40, 40, 60))
    draw.rectangle((196, 128, 236, 158), fill=(176, 132, 80), outline=(120, 86, 50), width=2)
    draw.line((216, 128, 216, 158), fill=(120, 86, 50), width=2)
    draw.rectangle((0, 0, 110, 14), fill=(0, 0, 0))
    draw.text((4, 2), "FRONT DOOR  cam 1", fill=(255, 255, 255))
    out = io.BytesIO()
    image.save(out, "JPEG", quality=85)
    return out.getvalue()


@dataclass(frozen=True)
class Answer:
    payload: bytes
    error: bool = False
    content_type: str = "application/json"


class SimulatedDevices:
    """A lamp and a sensor answering MQTT 5 requests; see the module's docstring."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 1883,
        *,
        prefix: str = "devices",
        log: Path | None = None,
        delay_ms: int = 0,
        delays: Mapping[str, float] | None = None,
        held: Collection[str] = (),
        login: tuple[str, str] | None = None,
    ) -> None:
        """``delays``: seconds before a device answers, by device (its topic after the prefix,
        e.g. ``"lamp/set"``), over ``delay_ms``. ``held``: devices that answer only after
        ``release``."""
        self.host, self.port, self.prefix = host, port, prefix
        self.log = log
        self.delay = delay_ms / 1000
        self.delays = dict(delays or {})
        self.lamp_on = False
        self.actuations = 0  # lamp switches actually done (a duplicate call does none)
        self.calls: list[dict[str, Any]] = []
        self.answered: list[dict[str, Any]] = []
        self._answers: dict[str, Answer] = {}  # by toolCallId
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a call arrived or an answer went out
        self._gates = {device: threading.Event() for device in held}
        self._stopped = threading.Event()
        self._suback = threading.Event()
        self._client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=f"sim-devices-{time.monotonic_ns()}", protocol=mqtt.MQTTv5
        )
        if login is not None:
            self._client.username_pw_set(*login)
        self._client.on_connect = self._on_connect
        self._client.on_subscribe = lambda c, u, mid, reasons, p: self._suback.set()
        self._client.on_message = self._on_message

    @property
    def topics(self) -> list[str]:
        return [
            f"{self.prefix}/lamp/set",
            f"{self.prefix}/lamp/get",
            f"{self.prefix}/sensor/read",
            f"{self.prefix}/camera/snapshot",
        ]

    def start(self, timeout: float = 10) -> None:
        """Connect and subscribe; returns once the broker has acknowledged the subscription."""
        self._client.connect(self.host, self.port, keepalive=30)
        self._client.loop_start()
        if not self._suback.wait(timeout):
            self.stop()
            raise ConnectionError(f"the broker at {self.host}:{self.port} did not take the devices' subscription")

    def stop(self) -> None:
        # Answers still waiting (delayed or held) are dropped.
        self._stopped.set()
        for gate in self._gates.values():
            gate.set()
        self._client.disconnect()
        self._client.loop_stop()

    def release(self, device: str) -> None:
        """A held device answers the calls it holds, and from now on answers at once."""
        self._gates[device].set()

    def wait_until(self, condition: Callable[[], bool], timeout: float) -> None:
        """Until ``condition`` (called under the devices' lock, on ``calls`` and ``answered``)
        holds; TimeoutError after ``timeout`` seconds."""
        with self._changed:
            if not self._changed.wait_for(condition, timeout):
                raise TimeoutError(f"devices: not within {timeout:g} s; calls {self.calls}, answered {self.answered}")

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            print(f"devices: connection refused: {reason}", file=sys.stderr, flush=True)
            return
        # Resubscribed on every connect: the session is not kept.
        client.subscribe([(t, SubscribeOptions(qos=1)) for t in self.topics])  # type: ignore[no-untyped-call]

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        props = message.properties
        users = dict(getattr(props, "UserProperty", None) or []) if props else {}
        response_topic = getattr(props, "ResponseTopic", None) if props else None
        correlation = getattr(props, "CorrelationData", None) if props else None
        call_id = users.get("toolCallId")
        with self._lock:
            stored = self._answers.get(call_id) if call_id else None
            duplicate = stored is not None
            answer = stored if stored is not None else self._act(message.topic, bytes(message.payload))
            if call_id and not duplicate:
                self._answers[call_id] = answer
            record = {
                "topic": message.topic,
                "toolCallId": call_id,
                "requestId": users.get("requestId"),
                "payload": bytes(message.payload).decode("utf-8", errors="replace"),
                "time": time.time(),
                "duplicate": duplicate,
                "responseTopic": response_topic,
            }
            self.calls.append(record)
            if self.log is not None:
                with self.log.open("a") as out:
                    out.write(json.dumps(record) + "\n")
            self._changed.notify_all()
        if response_topic is None:
            print(f"devices: a call on {message.topic} has no ResponseTopic; not answered", file=sys.stderr)
            return
        device = message.topic.removeprefix(f"{self.prefix}/")
        delay = self.delays.get(device, self.delay)
        gate = self._gates.get(device)
        reply = (response_topic, correlation, answer, call_id, message.topic)
        if delay <= 0 and (gate is None or gate.is_set()):
            self._answer(*reply)
            return

        def later() -> None:
            if gate is not None:
                gate.wait()
            if not self._stopped.wait(delay) and not self._stopped.is_set():
                self._answer(*reply)

        threading.Thread(target=later, name=f"device-{device}", daemon=True).start()

    def _act(self, topic: str, payload: bytes) -> Answer:
        """Run one call (under the lock): the answer, stored for its toolCallId."""
        try:
            arguments = json.loads(payload) if payload.strip() else {}
        except ValueError:
            return Answer(b'{"error":"arguments are not JSON"}', error=True)
        if topic == f"{self.prefix}/lamp/set":
            if not isinstance(arguments, dict) or not isinstance(arguments.get("on"), bool):
                return Answer(b'{"error":"expected {\\"on\\": true|false}"}', error=True)
            if arguments["on"] != self.lamp_on:
                self.lamp_on = arguments["on"]
                self.actuations += 1
            return Answer(json.dumps({"on": self.lamp_on}).encode())
        if topic == f"{self.prefix}/lamp/get":
            return Answer(json.dumps({"on": self.lamp_on}).encode())
        if topic == f"{self.prefix}/sensor/read":
            return Answer(json.dumps(SENSOR).encode())
        if topic == f"{self.prefix}/camera/snapshot":
            return Answer(door_snapshot(), content_type="image/jpeg")
        return Answer(b'{"error":"unknown device"}', error=True)

    def _answer(
        self, response_topic: str, correlation: bytes | None, answer: Answer, call_id: str | None, topic: str
    ) -> None:
        props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
        if correlation is not None:
            props.CorrelationData = correlation
        props.ContentType = answer.content_type
        if answer.error:
            props.UserProperty = [("outcome", "error")]
        self._client.publish(response_topic, answer.payload, qos=1, properties=props)
        # A picture is recorded as what it is, not as its bytes.
        text = (
            answer.payload.decode()
            if answer.content_type == "application/json"
            else f"[{answer.content_type}, {len(answer.payload)} bytes]"
        )
        with self._changed:
            self.answered.append({"toolCallId": call_id, "topic": topic, "payload": text, "time": time.time()})
            self._changed.notify_all()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.devices", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=1883)
    parser.add_argument("--prefix", default="devices")
    parser.add_argument("--log", type=Path, default=None, help="append every call received as a JSON line")
    parser.add_argument("--delay-ms", type=int, default=0, help="answer this much later")
    parser.add_argument(
        "--delay",
        action="append",
        default=[],
        metavar="DEVICE=MS",
        help="one device's delay, e.g. lamp/set=20000 (repeatable; over --delay-ms)",
    )
    parser.add_argument("--username", default=None)
    parser.add_argument("--password", default=None)
    args = parser.parse_args(argv)
    login = (args.username, args.password or "") if args.username else None
    delays = {}
    for item in args.delay:
        device, _, ms = item.partition("=")
        if not device or not ms.isdigit():
            parser.error(f"--delay {item!r}: expected DEVICE=MS, e.g. lamp/set=20000")
        delays[device] = int(ms) / 1000
    devices = SimulatedDevices(
        args.host, args.port, prefix=args.prefix, log=args.log, delay_ms=args.delay_ms, delays=delays, login=login
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    devices.start()
    print(f"devices ready on {args.host}:{args.port}: {', '.join(devices.topics)}", flush=True)
    stop.wait()
    devices.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
