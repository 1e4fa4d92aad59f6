"""Images from MQTT topics (worker/vision/topics.py) through a real mosquitto and the worker's
own MqttTransport: a camera's retained snapshot and its next one, raw bytes and base64 (MQTT 5
Content Type), the topics' max age and timeout, an image too large, and a topic not allowed
answered in the same words as one that does not exist."""

from __future__ import annotations

import asyncio
import base64
import io
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from PIL import Image

from devtools import REPO
from devtools.acl import PASSWORDS, documented_acl
from devtools.mosquitto import Mosquitto, password_file
from devtools.mqtt_client import Client, transport_on
from worker.config.models import VisionConfig, VisionTopicConfig
from worker.protocol.messages import ErrorCode, RequestError
from worker.vision.topics import VisionTopics


def snapshot(color: tuple[int, int, int] = (10, 20, 30), fmt: str = "JPEG") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32, 24), color).save(out, fmt)
    return out.getvalue()


def content_type(value: str) -> Properties:
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.ContentType = value
    return props


def config(prefix: str, **entry: Any) -> VisionConfig:
    fields = {"name": "cams", "topic": f"{prefix}/+/person/snapshot", "users": ["alice"], "timeout": 10.0} | entry
    return VisionConfig(max_request_bytes=20_000, topics=[VisionTopicConfig(**fields)])


async def until(condition: Callable[[], bool]) -> None:
    """Wait for a state the broker's delivery brings about (no time window: the test's own timeout bounds it)."""
    while not condition():
        await asyncio.sleep(0.005)


async def publish(camera: Client, topic: str, payload: bytes, **kw: Any) -> None:
    await asyncio.to_thread(camera.publish, topic, payload, **kw)


@pytest.fixture
def prefix() -> str:
    return f"frigate{uuid.uuid4().hex[:8]}"


@pytest.fixture
def camera(broker: Mosquitto) -> Any:
    client = Client(broker.port, [])
    yield client
    client.close()


def run(coroutine: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coroutine, 60))


def test_a_retained_snapshot_of_unknown_age_is_taken_only_with_max_age_0(
    broker: Mosquitto, camera: Client, prefix: str
) -> None:
    door = f"{prefix}/front_door/person/snapshot"
    old = snapshot((1, 1, 1))
    camera.publish(door, old, retain=True)  # held by the broker before the worker subscribes

    async def main() -> None:
        async with transport_on(broker.port) as transport:
            any_age = VisionTopics(config(prefix, max_age=0), transport)
            await any_age.start()
            (image,) = await any_age.images("alice", [door])
            assert (image.data, image.media_type, image.source, image.topic) == (old, "image/jpeg", "topic", door)
            assert image.index == "imageTopics.0"
            any_age.close()

            recent = VisionTopics(config(prefix, max_age=60), transport)
            await recent.start()
            await until(lambda: door in recent._latest)  # the retained copy arrived, of no known age
            waiting = asyncio.ensure_future(recent.images("alice", [door]))
            await until(lambda: door in recent._waiters)
            assert not waiting.done()
            new = snapshot((200, 0, 0))
            await publish(camera, door, new, retain=True)  # Frigate publishes its snapshots retained
            (image,) = await waiting
            assert image.data == new
            # Now the topic has an image of known age: the next request takes it at once.
            (again,) = await recent.images("alice", [door])
            assert again.data == new and door not in recent._waiters
            recent.close()

    try:
        run(main())
    finally:
        camera.publish(door, b"", retain=True)  # clear the retained message


def test_an_image_older_than_max_age_is_waited_on_and_none_coming_is_an_error(
    broker: Mosquitto, camera: Client, prefix: str
) -> None:
    door = f"{prefix}/front_door/person/snapshot"
    later = {"offset": 0.0}

    async def main() -> None:
        async with transport_on(broker.port) as transport:
            topics = VisionTopics(
                config(prefix, max_age=30, timeout=1), transport, clock=lambda: time.monotonic() + later["offset"]
            )
            await topics.start()
            await publish(camera, door, snapshot())
            await until(lambda: door in topics._latest)
            assert (await topics.images("alice", [door]))[0].data == snapshot()
            later["offset"] = 31.0  # the image is now 31 s old: waited on, and none comes
            with pytest.raises(RequestError) as err:
                await topics.images("alice", [door])
            assert err.value.code is ErrorCode.INVALID_REQUEST
            assert err.value.message == f"'imageTopics.0': no image on {door!r} within 1 s (none newer than 30 s)"
            topics.close()

    run(main())


def test_base64_payloads_and_content_types(broker: Mosquitto, camera: Client, prefix: str) -> None:
    png = snapshot(fmt="PNG")
    cases = [
        ("raw-no-type", png, None, None),
        ("raw-typed", png, "image/png", None),
        ("b64-typed", base64.b64encode(png), "image/png;base64", None),
        ("b64-untyped", base64.b64encode(png) + b"\n", None, None),  # Home Assistant's b64 image encoding
        ("wrong-type", png, "image/jpeg", "says 'image/jpeg' but holds image/png"),
        ("not-an-image", b"hello, camera", "text/plain", "is not a JPEG, PNG"),
        ("too-large", png + b"\0" * 20_000, "image/png", "the limit is 20000"),
    ]

    async def main() -> None:
        async with transport_on(broker.port) as transport:
            topics = VisionTopics(config(prefix, max_age=0), transport)
            await topics.start()
            for camera_name, payload, ctype, error in cases:
                topic = f"{prefix}/{camera_name}/person/snapshot"
                props = content_type(ctype) if ctype else None
                await publish(camera, topic, payload, properties=props)
                await until(lambda topic=topic: topic in topics._latest)  # type: ignore[misc]
                if error is None:
                    (image,) = await topics.images("alice", [topic])
                    assert (image.data, image.media_type) == (png, "image/png"), camera_name
                else:
                    with pytest.raises(RequestError) as err:
                        await topics.images("alice", [topic])
                    assert err.value.code is ErrorCode.INVALID_REQUEST
                    assert error in err.value.message, (camera_name, err.value.message)
                    assert err.value.message.startswith("'imageTopics.0"), err.value.message
            topics.close()

    run(main())


def test_a_topic_not_allowed_gets_the_same_words_as_one_that_does_not_exist(
    broker: Mosquitto, camera: Client, prefix: str
) -> None:
    door = f"{prefix}/front_door/person/snapshot"

    async def main() -> None:
        async with transport_on(broker.port) as transport:
            topics = VisionTopics(config(prefix, max_age=0), transport)
            nothing = VisionTopics(VisionConfig(), transport)
            await topics.start()
            await nothing.start()
            await publish(camera, door, snapshot())
            await until(lambda: door in topics._latest)
            assert (await topics.images("alice", [door]))[0].data == snapshot()

            async def refusal(vision: VisionTopics, user: str, wanted: list[str]) -> str:
                with pytest.raises(RequestError) as err:
                    await vision.images(user, wanted)
                assert err.value.code is ErrorCode.INVALID_REQUEST
                return err.value.message

            not_allowed = await refusal(topics, "bob", [door])
            not_configured = await refusal(nothing, "bob", [door])
            assert not_allowed == not_configured
            assert "no image topic" in not_allowed and "imageTopics.0" in not_allowed
            # A topic outside every filter, and the second of two: named by its place.
            elsewhere = await refusal(topics, "alice", [door, f"{prefix}/front_door/car/snapshot"])
            assert elsewhere.startswith("'imageTopics.1': no image topic")
            topics.close()

    run(main())


def documented_camera_acl() -> str:
    """The ```acl block of docs/security.md's "Images" section (its camera topics)."""
    section = (REPO / "docs" / "security.md").read_text().split("\n## Images", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```acl\n(.*?)```", section, re.S)
    assert match, "docs/security.md: no ```acl block in the Images section"
    return match.group(1)


def test_the_camera_acl_recipe_lets_only_the_camera_publish_snapshots(tmp_path: Path) -> None:
    """docs/security.md's camera block, added to the topic ACL: the worker reads Frigate's
    snapshot; alice's own "snapshot" on the camera's topic never reaches it."""
    users = PASSWORDS | {"frigate": "frigate-secret"}
    acl = tmp_path / "acl"
    acl.write_text(documented_acl() + "\n" + documented_camera_acl())
    passwd = password_file(tmp_path / "passwd", users)
    broker = Mosquitto(
        tmp_path, f"allow_anonymous false\npassword_file {passwd}\nacl_file {acl}\n", keep_root=True, autosave="default"
    )
    broker.start()
    door = "frigate/front_door/person/snapshot"
    frigate = Client(broker.port, [], login=("frigate", users["frigate"]))
    alice = Client(broker.port, [], login=("alice", users["alice"]))
    login = {"username": "worker", "password": users["worker"], "status_topic": "chat/_worker/gpu-1/status"}

    async def main() -> None:
        async with transport_on(broker.port, **login) as transport:
            topics = VisionTopics(config("frigate", max_age=60), transport)
            await topics.start()
            waiting = asyncio.ensure_future(topics.images("alice", [door]))
            await until(lambda: door in topics._waiters)
            await publish(alice, door, snapshot((0, 0, 0)))  # refused by the broker (acknowledged first)
            real = snapshot((250, 250, 250))
            await publish(frigate, door, real, retain=True)
            (image,) = await waiting
            assert image.data == real
            topics.close()

    try:
        run(main())
    finally:
        frigate.close()
        alice.close()
        broker.stop()
