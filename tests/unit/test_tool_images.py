"""Images from the worker's own tools: an MCP image content item or a device's image answer
enters the conversation on a vision model (the loop's next generation sees it, stored by
hash with the session) and stays text on a model without vision."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
from typing import Any

from PIL import Image

from devtools.fakes import FakeToolbox, Harness
from worker.engine.tokenizer import ChatTokenizer
from worker.engine.vllm import tool_support
from worker.session import ToolCall, ToolResultMessage, message_from_dict
from worker.tools.mcp import result_outcome
from worker.tools.mqtt import _image_answer
from worker.tools.port import ToolOutcome, WorkerTool
from worker.transport.port import Delivery

CAMERA = WorkerTool("door_camera", "A snapshot of the front door", None, ("*",), source="mcp")


def snapshot() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 6), (10, 200, 10)).save(out, "PNG")
    return out.getvalue()


def run_camera_loop(tokenizer: ChatTokenizer, *, vision: bool) -> Harness:
    box = FakeToolbox(CAMERA)
    png = snapshot()
    box.answer = lambda name, args: ToolOutcome(f"[image/png, {len(png)} bytes]", images=((png, "image/png"),))
    h = Harness(tools=tool_support("auto", tokenizer, "tiny"), toolbox=box, vision_engine=vision)
    h.engine.rounds["r1"] = ['<tool_call>\n{"name": "door_camera", "arguments": {}}\n</tool_call>', "Nobody."]

    async def scenario() -> None:
        h.transport.deliver(
            "chat/u/s/request", {"message": "anyone at the door?", "requestId": "r1", "workerTools": ["*"]}
        )
        await h.run_until(lambda: len(h.transport.replies("s")) == 1)

    asyncio.run(scenario())
    return h


def test_a_tools_image_is_seen_by_the_next_generation_on_a_vision_model(tokenizer: ChatTokenizer) -> None:
    h = run_camera_loop(tokenizer, vision=True)
    (reply,) = h.transport.replies("s")
    assert reply["reply"] == "Nobody.", reply
    sha = hashlib.sha256(snapshot()).hexdigest()
    assert [[i.uuid for i in r.images] for r in h.engine.requests] == [[], [sha]]
    (turn,) = h.service.sessions.get("u/s").turns
    result = turn.messages[2]
    assert isinstance(result, ToolResultMessage) and [i.sha256 for i in result.images] == [sha]
    assert h.service.sessions.get("u/s").images[sha].data == snapshot()
    assert message_from_dict(result.template_form()) == result  # as the store reads it back


def test_a_tools_image_stays_text_on_a_model_without_vision(tokenizer: ChatTokenizer) -> None:
    h = run_camera_loop(tokenizer, vision=False)
    assert [r.images for r in h.engine.requests] == [(), ()]
    (turn,) = h.service.sessions.get("u/s").turns
    assert turn.messages[2]["content"] == f"[image/png, {len(snapshot())} bytes]"
    assert h.service.sessions.get("u/s").images == {}


def test_an_mcp_image_item_carries_its_bytes_and_a_device_image_answer_is_an_image() -> None:
    png = snapshot()
    outcome = result_outcome(
        {
            "content": [
                {"type": "text", "text": "door"},
                {"type": "image", "mimeType": "image/png", "data": base64.b64encode(png).decode()},
            ]
        }
    )
    assert outcome.content == f"door\n[image/png, {len(png)} bytes]" and outcome.images == ((png, "image/png"),)
    not_image = result_outcome({"content": [{"type": "image", "mimeType": "image/png", "data": "aGVsbG8="}]})
    assert not_image.images == () and not_image.content == "[image/png, 5 bytes]"
    assert _image_answer(Delivery("t", png, False, content_type="image/png")) == (png, "image/png")
    assert _image_answer(Delivery("t", png, False, content_type="image/jpeg")) is None  # says one type, holds another
    assert _image_answer(Delivery("t", json.dumps({"a": 1}).encode(), False, content_type="application/json")) is None


def test_a_tool_loops_progress_keeps_its_turns_images_for_a_redelivery() -> None:
    from worker.session import ImageRef, Progress, StoredImage, Turn, UserMessage
    from worker.store.port import decode_progress, encode_progress

    png = snapshot()
    sha = hashlib.sha256(png).hexdigest()
    turn = Turn("k", [UserMessage("look", (ImageRef(sha, "image/png"),))])
    read = decode_progress("u/s", encode_progress(Progress(turn, {}, {sha: StoredImage(png, "image/png")})))
    assert read.turn == turn and read.images[sha].data == png


def test_the_vision_template_renders_one_placeholder_per_stored_image(tmp_path: Any) -> None:
    """The turns' images as the tiny Qwen2-VL's chat template renders them: one whole
    placeholder per image ref, user and tool images alike, in the order the engine gets them."""
    from devtools.tinyvision import IMAGE_PAD, VISION_END, VISION_START, generate_tiny_vision_model
    from worker.engine.tokenizer import ChatTokenizer
    from worker.session import ImageRef, SessionHistory, Turn, UserMessage, assistant_message

    renderer = ChatTokenizer(str(generate_tiny_vision_model(tmp_path / "vl")))
    door, yard = ImageRef("d" * 64, "image/png"), ImageRef("y" * 64, "image/png", 4)
    call = ToolCall("call_1", "door_camera", {})
    history = SessionHistory(
        turns=[
            Turn(
                "k",
                [
                    UserMessage("see this", (door, yard)),
                    assistant_message("", [call]),
                    ToolResultMessage("call_1", "door_camera", "[image/png, 3 bytes]", (door,)),
                ],
            )
        ]
    )
    text = renderer.render_text(history.messages(), add_generation_prompt=True)
    placeholder = VISION_START + IMAGE_PAD + VISION_END
    assert text.count(IMAGE_PAD) == len(history.image_refs()) == 3
    assert placeholder + "see " + placeholder + "this" in text
    ids = renderer.render(history.messages(), add_generation_prompt=True)
    pad = renderer.hf_tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert ids.count(pad) == 3
