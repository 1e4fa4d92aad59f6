"""Images through the core (docs/protocol.md#images): parsed where the model takes images and
refused naming it where not, stored with their turn by content hash, re-sent with the kept
history on every turn with the same identifiers, counted in the usage, within the [vision]
limits of a session; on the fake engine and the memory store (the stores' encoding of images
is tested in tests/broker/test_store.py)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import os
from typing import Any

from PIL import Image

from devtools.fakes import IMAGE_TOKENS, Harness
from worker.session import ImageRef, SessionHistory, StoredImage, Turn, UserMessage, message_from_dict
from worker.store.port import encode_state, parse_state


def picture(color: tuple[int, int, int] = (200, 30, 30), size: tuple[int, int] = (8, 6), noise: int = 0) -> bytes:
    out = io.BytesIO()
    image = Image.new("RGB", size, color)
    if noise:
        image = Image.frombytes("RGB", size, os.urandom(size[0] * size[1] * 3))
    image.save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def parts(text: str, *images: bytes) -> list[dict[str, Any]]:
    return [*({"type": "image_url", "image_url": {"url": data_url(i)}} for i in images), {"type": "text", "text": text}]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_model_without_vision_refuses_an_image_naming_the_model() -> None:
    async def scenario() -> None:
        h = Harness()
        h.transport.deliver("chat/u/s/request", {"message": parts("what is it?", picture()), "requestId": "r1"})
        h.transport.deliver("chat/u/s/request", {"message": "hi", "imageTopics": ["cam/door"], "requestId": "r2"})
        await h.run_until(lambda: len(h.transport.replies("s")) == 2)
        for reply, key in zip(h.transport.replies("s"), ("r1", "r2"), strict=True):
            assert reply["requestId"] == key
            assert reply["error"]["code"] == "invalid_request"
            assert "'fake'" in reply["error"]["message"] and "images" in reply["error"]["message"]
        assert h.engine.requests == []

    asyncio.run(scenario())


def test_a_big_image_request_is_parsed_off_the_loop_and_its_refusal_names_its_request_id() -> None:
    async def scenario() -> None:
        h = Harness(max_payload_bytes=4096)
        big = picture(size=(64, 64), noise=1)
        assert len(big) > 4096
        h.transport.deliver("chat/u/s/request", {"message": parts("look", big), "requestId": "big"})
        await h.run_until(lambda: len(h.transport.replies("s")) == 1)
        (reply,) = h.transport.replies("s")
        assert reply["requestId"] == "big" and reply["error"]["code"] == "too_large"

    asyncio.run(scenario())


def test_images_are_stored_once_and_resent_with_their_hashes_every_turn() -> None:
    async def scenario() -> None:
        h = Harness(vision_engine=True, max_payload_bytes=4096)
        first, second = picture(size=(64, 64), noise=1), picture((0, 0, 255))
        h.transport.deliver("chat/u/s/request", {"message": parts("one", first), "maxTokens": 2, "requestId": "a"})
        await h.run_until(lambda: len(h.transport.replies("s")) == 1)
        h.transport.deliver("chat/u/s/request", {"message": "no image", "maxTokens": 2, "requestId": "b"})
        h.transport.deliver(
            "chat/u/s/request",
            {"message": "two", "images": [base64.b64encode(second).decode()], "requestId": "c", "maxTokens": 2},
        )
        h.transport.deliver(
            "chat/u/s/request", {"message": parts("same again", first), "maxTokens": 2, "requestId": "d"}
        )
        await h.run_until(lambda: len(h.transport.replies("s")) == 4)
        replies = h.transport.replies("s")
        assert all("error" not in r for r in replies), replies
        uuids = [[image.uuid for image in request.images] for request in h.engine.requests]
        assert uuids == [[sha(first)], [sha(first)], [sha(first), sha(second)], [sha(first), sha(second), sha(first)]]
        assert [r["usage"].get("imageTokens") for r in replies] == [IMAGE_TOKENS * n for n in (1, 1, 2, 3)]
        assert h.engine.requests[0].images[0].pixels == first  # the default decoder hands the bytes on
        history = h.service.sessions.store.load("u/s")
        assert history is not None
        assert set(history.images) == {sha(first), sha(second)}  # each image once
        assert history.images[sha(first)].data == first
        assert [ref.sha256 for ref in history.image_refs()] == [sha(first), sha(second), sha(first)]

    asyncio.run(scenario())


def test_images_in_the_prompt_trim_the_oldest_turns_and_their_bytes_go_with_them() -> None:
    async def scenario() -> None:
        h = Harness(vision_engine=True, vision={"max_images_in_prompt": 2})
        pictures = [picture((i * 40, 0, 0)) for i in range(3)]
        for i, image in enumerate(pictures):
            h.transport.deliver(
                "chat/u/s/request", {"message": parts(f"m{i}", image), "maxTokens": 2, "requestId": f"r{i}"}
            )
        await h.run_until(lambda: len(h.transport.replies("s")) == 3)
        assert all("error" not in r for r in h.transport.replies("s"))
        assert [image.uuid for image in h.engine.requests[-1].images] == [sha(pictures[1]), sha(pictures[2])]
        history = h.service.sessions.store.load("u/s")
        assert history is not None and [t.user for t in history.turns] == ["m1", "m2"]
        assert set(history.images) == {sha(pictures[1]), sha(pictures[2])}

    asyncio.run(scenario())


def test_session_limits_refuse_and_leave_the_session_unchanged() -> None:
    async def scenario() -> None:
        small, big = picture(), picture(size=(64, 64), noise=1)
        h = Harness(
            vision_engine=True,
            max_payload_bytes=65536,
            vision={"max_images_per_session": 2, "max_stored_bytes_per_session": len(small) * 2 + len(big) - 1},
        )
        h.transport.deliver("chat/u/s/request", {"message": parts("a", small), "maxTokens": 2, "requestId": "a"})
        h.transport.deliver(
            "chat/u/s/request", {"message": parts("b", picture((4, 5, 6)), picture((1, 2, 3))), "requestId": "b"}
        )
        await h.run_until(lambda: len(h.transport.replies("s")) == 2)
        refused = h.transport.replies("s")[1]
        assert refused["error"]["code"] == "invalid_request" and "3 images" in refused["error"]["message"]
        h.transport.deliver("chat/u/s/request", {"message": parts("c", picture((9, 9, 9)), big), "requestId": "c"})
        await h.run_until(lambda: len(h.transport.replies("s")) == 3)
        refused = h.transport.replies("s")[2]
        assert refused["error"]["code"] == "invalid_request", refused
        history = h.service.sessions.store.load("u/s")
        assert history is not None and [t.user for t in history.turns] == ["a"]
        assert set(history.images) == {sha(small)}

    asyncio.run(scenario())


def test_image_topics_without_configured_topics_get_the_words_of_a_topic_not_allowed() -> None:
    async def scenario() -> None:
        h = Harness(vision_engine=True)
        h.transport.deliver("chat/u/s/request", {"message": "door?", "imageTopics": ["cam/door"], "requestId": "r"})
        await h.run_until(lambda: len(h.transport.replies("s")) == 1)
        (reply,) = h.transport.replies("s")
        assert reply["error"]["code"] == "invalid_request"
        assert "no image topic 'cam/door'" in reply["error"]["message"]

    asyncio.run(scenario())


def test_a_user_message_with_images_renders_as_content_parts_and_reads_back() -> None:
    message = UserMessage("before after", (ImageRef("h1", "image/png", 7), ImageRef("h0", "image/jpeg", 0)))
    form = message.template_form()
    assert form["content"] == [
        {"type": "image", "sha256": "h0", "mediaType": "image/jpeg"},
        {"type": "text", "text": "before "},
        {"type": "image", "sha256": "h1", "mediaType": "image/png"},
        {"type": "text", "text": "after"},
    ]
    assert message_from_dict(form) == message
    assert UserMessage("plain").template_form() == {"role": "user", "content": "plain"}


def test_the_stored_state_names_its_images_and_holds_none_of_their_bytes() -> None:
    """The state refers to each image by hash and type; the stores keep the bytes apart
    (tests/broker/test_store.py). A state stored with its images in it (an older worker's)
    and one stored before images still read."""
    history = SessionHistory()
    history.turns = [
        Turn("k1", [UserMessage("a", (ImageRef("h1", "image/png"),))]),
        Turn("k2", [UserMessage("b", (ImageRef("h1", "image/png"), ImageRef("h2", "image/png", 1)))]),
    ]
    history.images = {name: StoredImage(name.encode() * 1000, "image/png") for name in ("h1", "h2", "gone")}
    state = encode_state(history)
    read = parse_state("u/s", state)
    assert read.turns == history.turns and read.images == {} and len(state) < 1000
    inline = json.loads(state) | {"images": {"h1": {"mediaType": "image/png", "data": "aDE="}}}
    assert parse_state("u/s", json.dumps(inline)).images == {"h1": StoredImage(b"h1", "image/png")}
    old = '{"systemPrompt": null, "turns": [{"key": "k", "messages": [{"role": "user", "content": "x"}]}]}'
    assert parse_state("u/s", old).images == {} and parse_state("u/s", old).turns[0].user == "x"


def test_a_users_sessions_share_the_stored_bytes_limit() -> None:
    async def scenario() -> None:
        one, two, three = (picture((i, 0, 0)) for i in (10, 20, 30))
        h = Harness(vision_engine=True, vision={"max_stored_bytes_per_user": len(one) + len(two) + len(three) - 1})
        h.transport.deliver("chat/u/s1/request", {"message": parts("a", one), "maxTokens": 2, "requestId": "a"})
        h.transport.deliver("chat/u/s2/request", {"message": parts("b", two), "maxTokens": 2, "requestId": "b"})
        h.transport.deliver("chat/v/t3/request", {"message": parts("c", three), "maxTokens": 2, "requestId": "c"})
        await h.run_until(lambda: all(len(h.transport.replies(s)) == 1 for s in ("s1", "s2", "t3")))
        h.transport.deliver("chat/u/s3/request", {"message": parts("d", three), "maxTokens": 2, "requestId": "d"})
        await h.run_until(lambda: len(h.transport.replies("s3")) == 1)
        refused = h.transport.replies("s3")[0]
        assert refused["error"]["code"] == "invalid_request" and "'u'" in refused["error"]["message"]
        h.transport.deliver("chat/u/s1/control", {"action": "reset", "requestId": "x"})
        await h.run_until(lambda: len(h.transport.replies("s1")) == 2)
        # A reset makes room.
        h.transport.deliver("chat/u/s3/request", {"message": parts("e", three), "maxTokens": 2, "requestId": "e"})
        await h.run_until(lambda: len(h.transport.replies("s3")) == 2)
        assert "error" not in h.transport.replies("s3")[1]

    asyncio.run(scenario())


class Camera:
    """The Messaging port as VisionTopics uses it: the filters watched, a message handed in."""

    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}

    async def watch(self, topic_filter: str, handler: Any, **kw: Any) -> None:
        self.handlers[topic_filter] = handler

    def unwatch(self, topic_filter: str) -> None:
        self.handlers.pop(topic_filter, None)


def test_an_image_topic_is_read_per_request_and_stored_with_the_turn() -> None:
    from worker.transport.port import Delivery
    from worker.vision.topics import VisionTopics

    async def scenario() -> None:
        topic = {"name": "door", "topic": "cam/+/snapshot", "users": ["u"], "max_age": 0, "timeout": 5}
        h = Harness(vision_engine=True, vision={"topics": [topic]})
        camera = Camera()
        topics = VisionTopics(h.service.config.vision, camera)  # type: ignore[arg-type]
        h.service.turns.vision_topics = topics
        await topics.start()
        snap = picture((5, 5, 5))
        camera.handlers["cam/+/snapshot"](Delivery("cam/door/snapshot", snap, True, content_type="image/png"))
        h.transport.deliver(
            "chat/u/s/request",
            {"message": "who?", "imageTopics": ["cam/door/snapshot"], "maxTokens": 2, "requestId": "a"},
        )
        h.transport.deliver(
            "chat/v/t/request",
            {"message": "who?", "imageTopics": ["cam/door/snapshot"], "maxTokens": 2, "requestId": "b"},
        )
        await h.run_until(lambda: len(h.transport.replies("s")) == 1 and len(h.transport.replies("t")) == 1)
        (reply,) = h.transport.replies("s")
        assert reply["usage"]["imageTokens"] == IMAGE_TOKENS, reply
        assert [i.uuid for i in h.engine.requests[0].images] == [sha(snap)]
        history = h.service.sessions.store.load("u/s")
        assert history is not None and history.images[sha(snap)].data == snap
        (other,) = h.transport.replies("t")  # not the user's topic: the words of one that does not exist
        assert "no image topic 'cam/door/snapshot'" in other["error"]["message"]
        topics.close()
        assert camera.handlers == {}

    asyncio.run(scenario())


def test_the_wiring_watches_vision_topics_only_where_configured_on_a_vision_model() -> None:
    from devtools.fakes import FAKE_VISION, FakeEngine, WordRenderer
    from worker.config.models import WorkerConfig
    from worker.store.memory import MemoryStore
    from worker.wiring import wire

    topic = {"name": "door", "topic": "cam/door", "users": ["*"]}

    async def parts(vision: dict[str, Any], engine: FakeEngine) -> Any:
        config = WorkerConfig.model_validate({"engine": {"model": "fake"}, "vision": vision})
        return wire(config, engine, WordRenderer(), MemoryStore(), lambda code: None)

    async def scenario() -> None:
        wired = await parts({"topics": [topic]}, FakeEngine(FAKE_VISION))
        assert wired.vision_topics is not None and wired.service.turns.vision_topics is wired.vision_topics
        assert (await parts({}, FakeEngine(FAKE_VISION))).vision_topics is None
        assert (await parts({"topics": [topic]}, FakeEngine())).vision_topics is None

    asyncio.run(scenario())


def test_a_vision_engine_is_wired_to_the_bounded_decoder() -> None:
    from devtools.fakes import FAKE_VISION, FakeEngine, WordRenderer
    from worker.config.models import WorkerConfig
    from worker.store.memory import MemoryStore
    from worker.wiring import wire

    async def scenario() -> None:
        config = WorkerConfig.model_validate({"engine": {"model": "fake"}, "vision": {"max_image_pixels": 100}})
        decode = wire(config, FakeEngine(FAKE_VISION), WordRenderer(), MemoryStore(), lambda code: None).service
        pixels = decode.turns.decode_image(picture(size=(8, 6)), "images.0")
        assert pixels.size == (8, 6) and pixels.mode == "RGB"  # a PIL image, as the engine takes it
        try:
            decode.turns.decode_image(picture(size=(20, 20)), "images.0")
        except ValueError as exc:
            assert "'images.0'" in str(exc)
        else:
            raise AssertionError("an image over max_image_pixels was decoded")

    asyncio.run(scenario())


def test_a_bad_image_is_refused_before_the_engine_and_the_session_is_unchanged() -> None:
    from worker.wiring import image_decoder

    async def scenario() -> None:
        h = Harness(vision_engine=True)
        h.service.turns.decode_image = image_decoder(50_000_000)
        good = picture()
        h.transport.deliver("chat/u/s/request", {"message": parts("a", good), "maxTokens": 2, "requestId": "a"})
        await h.run_until(lambda: len(h.transport.replies("s")) == 1)
        truncated = picture(size=(64, 64), noise=1)[:300]
        h.transport.deliver("chat/u/s/request", {"message": parts("b", truncated), "maxTokens": 2, "requestId": "b"})
        await h.run_until(lambda: len(h.transport.replies("s")) == 2)
        refused = h.transport.replies("s")[1]
        assert refused["error"]["code"] == "invalid_request" and "truncated" in refused["error"]["message"]
        assert len(h.engine.requests) == 1
        history = h.service.sessions.store.load("u/s")
        assert history is not None and [t.user for t in history.turns] == ["a"] and set(history.images) == {sha(good)}

    asyncio.run(scenario())


def test_an_image_come_before_its_topic_is_watched_is_dropped_not_an_invalid_topic() -> None:
    """A persistent broker session may deliver a watched image topic's message at the connect,
    before the vision topics subscribe (the subscription brings the retained image again):
    acknowledged and dropped, not taken for a request on an invalid topic."""
    from loguru import logger

    from worker.vision.topics import VisionTopics

    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="DEBUG", format="{level} {message}")

    async def scenario() -> None:
        topic = {"name": "door", "topic": "cam/+/snapshot", "users": ["u"], "max_age": 0, "timeout": 5}
        h = Harness(vision_engine=True, vision={"topics": [topic]})
        h.service.vision_topics = VisionTopics(h.service.config.vision, Camera())  # type: ignore[arg-type]
        early = h.transport.deliver("cam/door/snapshot", picture((5, 5, 5)))
        h.transport.deliver("chat/u/s/request", {"message": "hi", "maxTokens": 2, "requestId": "after"})
        await h.run_until(lambda: h.transport.replies("s"))
        assert early in h.transport.acked

    try:
        asyncio.run(scenario())
    finally:
        logger.remove(sink)
    assert any(line.startswith("DEBUG Dropping an image on 'cam/door/snapshot'") for line in lines), lines
    assert not [line for line in lines if "invalid topic" in line]
