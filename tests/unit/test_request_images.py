"""Images in a request (docs/protocol.md#images): OpenAI content parts with data: URLs and
Ollama's base64 ``images``, parsed into ImageInput values; every bad input is refused with
invalid_request (too_large for a payload over its limit), and text requests are as before.

Fast: no engine, no broker. The images are real files made by Pillow.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import random
from typing import Any

import jsonschema
import pytest
from PIL import Image

from devtools import REPO
from worker.config.models import VisionConfig, VisionTopicConfig, WorkerConfig, namespace_allowed
from worker.protocol.images import ImageLimits, sniff_media_type
from worker.protocol.messages import ErrorCode, RequestError, Usage, parse_chat_request

LIMITS = ImageLimits(max_request_bytes=200_000, max_images=3)
MAX_PAYLOAD = 4096


@functools.cache
def picture(fmt: str = "PNG", size: tuple[int, int] = (8, 6)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(out, fmt)
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{b64(data)}"


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def parse(data: dict[str, Any] | bytes, limits: ImageLimits | None = LIMITS, **kw: Any) -> Any:
    payload = data if isinstance(data, bytes) else json.dumps(data).encode()
    return parse_chat_request(payload, "s1", MAX_PAYLOAD, limits, **kw)


def refused(data: dict[str, Any] | bytes, limits: ImageLimits | None = LIMITS, **kw: Any) -> RequestError:
    with pytest.raises(RequestError) as err:
        parse(data, limits, **kw)
    return err.value


@functools.cache
def request_schema() -> jsonschema.Draft202012Validator:
    schema = json.loads((REPO / "docs" / "schemas" / "request.schema.json").read_text(encoding="utf-8"))
    return jsonschema.Draft202012Validator(schema)


# -- what is accepted ------------------------------------------------------------------------


def test_content_parts_give_the_text_and_the_images_where_they_stood() -> None:
    png, jpeg = picture("PNG"), picture("JPEG")
    request = parse(
        {
            "message": [
                {"type": "text", "text": "Look:"},
                image_part(data_url(png)),
                {"type": "text", "text": "and"},
                image_part(data_url(jpeg, "image/jpeg")),
            ]
        }
    )
    assert request.message == "Look:\nand"
    first, second = request.image_inputs
    assert (first.data, first.media_type, first.source, first.index) == (
        png,
        "image/png",
        "content_part",
        "message.1.image_url.url",
    )
    assert (second.data, second.media_type) == (jpeg, "image/jpeg")
    # Each image stands after the text before it: "Look:\n" is 6 characters, "Look:\nand\n" 10.
    assert (first.offset, second.offset) == (6, 10)
    assert request.image_count == 2


def test_ollama_images_are_base64_before_the_text() -> None:
    request = parse({"message": "What is this?", "images": [b64(picture("PNG")), b64(picture("GIF"))]})
    assert request.message == "What is this?"
    assert [(i.source, i.media_type, i.offset, i.index) for i in request.image_inputs] == [
        ("images", "image/png", 0, "images.0"),
        ("images", "image/gif", 0, "images.1"),
    ]
    assert request.image_inputs[0].data == picture("PNG")


def test_an_image_alone_needs_no_text() -> None:
    assert parse({"message": [image_part(data_url(picture()))]}).message == ""
    assert parse({"message": "", "images": [b64(picture())]}).message == ""


def test_every_format_is_told_from_its_bytes() -> None:
    for fmt, media_type in (("PNG", "image/png"), ("JPEG", "image/jpeg"), ("GIF", "image/gif"), ("WEBP", "image/webp")):
        assert sniff_media_type(picture(fmt)) == media_type
        assert parse({"message": "x", "images": [b64(picture(fmt))]}).image_inputs[0].media_type == media_type
    assert sniff_media_type(picture("BMP")) == "image/bmp"
    # image/jpg is written by browsers and tools: taken as image/jpeg.
    request = parse({"message": [image_part(data_url(picture("JPEG"), "image/jpg"))]})
    assert request.image_inputs[0].media_type == "image/jpeg"


def test_the_same_image_has_the_same_hash_and_repr_never_shows_the_bytes() -> None:
    request = parse({"message": [image_part(data_url(picture()))], "images": [b64(picture())]})
    first, second = request.image_inputs
    assert first.sha256 == second.sha256 and len(first.sha256) == 64
    assert "base64" not in repr(first) and str(len(picture())) in repr(first)


def test_a_request_with_images_may_exceed_max_payload_bytes_up_to_its_own_limit() -> None:
    big = Image.frombytes("RGB", (64, 64), random.Random(0).randbytes(64 * 64 * 3))  # noise: no compression
    out = io.BytesIO()
    big.save(out, "PNG")
    payload = json.dumps({"message": "x", "images": [b64(out.getvalue())]}).encode()
    assert MAX_PAYLOAD < len(payload) < LIMITS.max_request_bytes
    assert parse(payload).image_inputs[0].data == out.getvalue()


def test_image_topics_are_kept_for_the_vision_topics_to_read() -> None:
    request = parse({"message": "Anyone at the door?", "imageTopics": ["frigate/front_door/person/snapshot"]})
    assert request.image_topics == ["frigate/front_door/person/snapshot"]
    assert request.image_inputs == () and request.image_count == 1


def test_text_requests_are_as_before_and_carry_no_images() -> None:
    for limits in (LIMITS, None):
        request = parse({"message": "hi", "maxTokens": 5}, limits)
        assert (request.message, request.image_inputs, request.images, request.image_topics) == ("hi", (), None, None)
        assert json.loads(request.to_json()) == {
            "message": "hi",
            "maxTokens": 5,
            "stream": False,
            "includeReasoning": False,
        }
    # The old words for the old mistakes.
    assert refused({"message": ""}).message == "'message': String should have at least 1 character"
    text = json.dumps({"message": "x" * MAX_PAYLOAD}).encode()
    assert refused(text, None).message == f"payload is {len(text)} bytes; the limit is {MAX_PAYLOAD}"
    assert refused(text).code is ErrorCode.TOO_LARGE


def test_a_lone_surrogate_is_bad_json_with_or_without_images() -> None:
    """The check of every string is skipped only for a payload without a \\u escape."""
    for data in (
        b'{"message": "\\ud800"}',
        b'{"message": "x", "images": ["' + b64(picture()).encode() + b'"], "k\\udfff": 1}',
    ):
        error = refused(data)
        assert (error.code, error.message) == (ErrorCode.BAD_JSON, "payload has a string that is not valid Unicode")
    assert parse(b'{"message": "caf\\u00e9"}').message == "caf\u00e9"


def test_usage_counts_image_tokens_apart_and_only_when_there_are_some() -> None:
    assert "imageTokens" not in json.loads(Usage(prompt_tokens=5, completion_tokens=1, cached_tokens=0).to_json())
    usage = Usage(prompt_tokens=500, completion_tokens=1, cached_tokens=0, image_tokens=480)
    assert json.loads(usage.to_json())["imageTokens"] == 480


def test_the_schema_takes_what_the_worker_takes() -> None:
    for data in (
        {"message": [{"type": "text", "text": "hi"}, image_part(data_url(picture()))]},
        {"message": "", "images": [b64(picture())]},
        {"message": "hi", "imageTopics": ["cam/1"]},
    ):
        assert request_schema().is_valid(data), data
        parse(data)
    for data in ({"message": ""}, {"message": []}, {"message": [{"type": "image_url", "imageUrl": {"url": "x"}}]}):
        assert not request_schema().is_valid(data), data
        refused(data)


# -- what is refused, and how ----------------------------------------------------------------


BAD_IMAGES: list[tuple[str, dict[str, Any], str]] = [
    ("http URL", {"message": [image_part("http://camera.local/snap.jpg")]}, "is an http URL"),
    ("https URL", {"message": [image_part("https://example.com/a.png")]}, "never fetches a URL"),
    ("file URL", {"message": [image_part("file:///etc/passwd")]}, "must be a data: URL"),
    ("no URL at all", {"message": [image_part("aGVsbG8=")]}, "must be a data: URL"),
    ("data URL of text", {"message": [image_part("data:text/plain;base64,aGVsbG8=")]}, "'text/plain', not an image"),
    ("data URL of SVG", {"message": [image_part("data:image/svg+xml;base64,PHN2Zz4=")]}, "not an image of type"),
    ("data URL without type", {"message": [image_part("data:;base64,aGVsbG8=")]}, "'no type'"),
    ("data URL not base64", {"message": [image_part("data:image/png,%89PNG")]}, "must be base64"),
    ("data URL bad base64", {"message": [image_part("data:image/png;base64,iVBOR*w0KGgo=")]}, "not valid base64"),
    ("data URL empty", {"message": [image_part("data:image/png;base64,")]}, "is empty"),
    ("bad base64", {"message": "x", "images": ["not base64!"]}, "'images.0' is not valid base64"),
    ("base64 without padding", {"message": "x", "images": ["aGVsbG8"]}, "not valid base64"),
    ("base64 with a line break", {"message": "x", "images": ["aGVs\nbG8="]}, "not valid base64"),
    ("non-ASCII base64", {"message": "x", "images": ["aGVsbG8é"]}, "not valid base64"),
    ("empty base64", {"message": "x", "images": [""]}, "'images.0' is empty"),
    ("not an image", {"message": "x", "images": [b64(b"hello, world, not an image")]}, "is not a JPEG, PNG"),
    ("empty images", {"message": "x", "images": []}, "'images' is empty"),
    ("images not strings", {"message": "x", "images": [5]}, "'images.0'"),
    ("a part without a type", {"message": [{"text": "hi"}]}, "'message.0'"),
    ("a part of another type", {"message": [{"type": "input_audio", "input_audio": {}}]}, "'message.0'"),
    ("a part with camelCase", {"message": [{"type": "image_url", "imageUrl": {"url": "x"}}]}, "unknown field"),
    ("a part with an extra field", {"message": [{"type": "text", "text": "a", "x": 1}]}, "unknown field"),
    ("no parts", {"message": []}, "empty list of content parts"),
    ("images with toolResults", {"toolResults": [{"toolCallId": "c", "content": "x"}], "images": ["x"]}, "'message'"),
    ("a wildcard topic", {"message": "x", "imageTopics": ["frigate/+/person/snapshot"]}, "not a topic name"),
    ("a $ topic", {"message": "x", "imageTopics": ["$SYS/broker/uptime"]}, "not a topic name"),
    ("an empty topic", {"message": "x", "imageTopics": [""]}, "not a topic name"),
    ("no topics", {"message": "x", "imageTopics": []}, "'imageTopics' is empty"),
    ("a topic twice", {"message": "x", "imageTopics": ["a/b", "a/b"]}, "names a topic twice"),
]


@pytest.mark.parametrize(("data", "fragment"), [c[1:] for c in BAD_IMAGES], ids=[c[0] for c in BAD_IMAGES])
def test_bad_images_are_invalid_requests_that_name_the_image(data: dict[str, Any], fragment: str) -> None:
    error = refused(data)
    assert error.code is ErrorCode.INVALID_REQUEST
    assert fragment in error.message


def test_a_data_url_whose_bytes_are_another_format_is_refused() -> None:
    error = refused({"message": [image_part(data_url(picture("JPEG"), "image/png"))]})
    assert error.code is ErrorCode.INVALID_REQUEST
    assert "says 'image/png' but holds image/jpeg" in error.message


def test_too_many_images_count_parts_images_and_topics_together() -> None:
    url = data_url(picture())
    error = refused({"message": [image_part(url), image_part(url)], "images": [b64(picture())], "imageTopics": ["c/1"]})
    assert error.code is ErrorCode.INVALID_REQUEST
    assert "carries 4 images" in error.message and "limit is 3" in error.message
    parse({"message": [image_part(url)], "images": [b64(picture())], "imageTopics": ["c/1"]})  # 3: the limit


def test_a_payload_over_the_image_limit_is_too_large_unread() -> None:
    payload = json.dumps({"message": "x", "images": ["A" * LIMITS.max_request_bytes]}).encode()
    error = refused(payload)
    assert error.code is ErrorCode.TOO_LARGE
    assert error.message == (
        f"payload is {len(payload)} bytes; the limit is {MAX_PAYLOAD} ({LIMITS.max_request_bytes} with images)"
    )


def test_a_large_payload_that_only_mentions_images_is_too_large() -> None:
    """Taken past max_payload_bytes only to be read: without an image in it, the old limit holds."""
    payload = json.dumps({"message": "x" * MAX_PAYLOAD, "images": None}).encode()
    error = refused(payload)
    assert error.code is ErrorCode.TOO_LARGE and "for a request without images" in error.message
    topics_only = json.dumps({"message": "x" * MAX_PAYLOAD, "imageTopics": ["c/1"]}).encode()
    assert refused(topics_only).code is ErrorCode.TOO_LARGE


def test_the_text_of_an_image_request_is_held_to_the_payload_limit() -> None:
    """Images raise the payload's limit, not the text's: its tokens are counted and encoded
    like any request's, so more of it is refused before any tokenizing."""
    image = [b64(picture())]
    error = refused({"message": "x" * (MAX_PAYLOAD + 1), "images": image})
    assert error.code is ErrorCode.TOO_LARGE
    assert (
        error.message == f"the request's text is {MAX_PAYLOAD + 1} bytes; the limit is {MAX_PAYLOAD}, with images too"
    )
    half = "x" * (MAX_PAYLOAD // 2 + 1)
    assert refused({"message": half, "systemPrompt": half, "images": image}).code is ErrorCode.TOO_LARGE
    wide = "é" * (MAX_PAYLOAD // 2 + 1)  # fewer characters than the limit, more bytes
    assert refused({"message": [{"type": "text", "text": wide}, image_part(data_url(picture()))]}).code is (
        ErrorCode.TOO_LARGE
    )
    request = parse({"message": "x" * (MAX_PAYLOAD - 10), "images": image})  # over the payload limit, text within
    assert len(request.image_inputs) == 1


def test_a_model_without_vision_refuses_images_naming_the_model() -> None:
    for data in (
        {"message": [image_part(data_url(picture()))]},
        {"message": "x", "images": [b64(picture())]},
        {"message": "x", "imageTopics": ["cam/1"]},
    ):
        error = refused(data, None, model="Qwen/Qwen3-0.6B")
        assert error.code is ErrorCode.INVALID_REQUEST
        assert "the model 'Qwen/Qwen3-0.6B' does not take images" in error.message


def test_a_large_image_payload_without_vision_is_too_large() -> None:
    payload = json.dumps({"message": "x", "images": [b64(picture())] * 100}).encode()
    assert len(payload) > MAX_PAYLOAD
    assert refused(payload, None).code is ErrorCode.TOO_LARGE


# -- configuration ---------------------------------------------------------------------------


def test_the_limits_come_from_the_vision_section() -> None:
    vision = VisionConfig(max_request_bytes=9000, max_images_per_request=2)
    assert ImageLimits.of(vision) == ImageLimits(max_request_bytes=9000, max_images=2)


def test_vision_topics_use_the_worker_tools_allowlist() -> None:
    entry = VisionTopicConfig(name="door", topic="frigate/front_door/+/snapshot", users=["alice"])
    assert entry.allows("alice") and not entry.allows("bob")
    assert VisionTopicConfig(name="all", topic="cams/#", users=["*"]).allows("bob")
    assert namespace_allowed(["*"], "x") and not namespace_allowed(["a"], "b")
    with pytest.raises(ValueError, match="users must name at least one"):
        VisionTopicConfig(name="none", topic="cams/#", users=[])
    with pytest.raises(ValueError, match="Field required"):
        VisionTopicConfig.model_validate({"name": "nobody", "topic": "cams/#"})  # no default: never open by accident


@pytest.mark.parametrize("topic", ["", "$SYS/#", "cams/#/x", "cams/a+", "cams/#b", "a\x00b"])
def test_a_vision_topic_must_be_a_topic_filter(topic: str) -> None:
    with pytest.raises(ValueError, match="must be an MQTT topic filter"):
        VisionTopicConfig(name="t", topic=topic, users=["*"])


@pytest.mark.parametrize("topic", ["chat/alice/s1/request", "chat/#", "+/alice/+/reply", "#", "+/+/+/+"])
def test_a_vision_topic_cannot_reach_the_workers_own_topics(topic: str) -> None:
    vision = VisionConfig(topics=[VisionTopicConfig(name="t", topic=topic, users=["*"])])
    with pytest.raises(ValueError, match="overlaps the worker's own topics"):
        WorkerConfig.model_validate({"vision": vision.model_dump()})


def test_vision_topics_outside_the_prefix_and_unique_names() -> None:
    topics = [
        {"name": "door", "topic": "frigate/+/person/snapshot", "users": ["*"]},
        {"name": "x", "topic": "chat2/#", "users": ["a"]},
    ]
    assert len(WorkerConfig.model_validate({"vision": {"topics": topics}}).vision.topics) == 2
    with pytest.raises(ValueError, match="named 'door'"):
        VisionConfig.model_validate({"topics": [topics[0], topics[0]]})
