"""A request's tool-loop progress with images, stored by an older worker and read by this one
(the SQLite store, the fake engine with vision, the fake toolbox): a redelivery goes on from
it, never calls again, and either answers or says why; never a progress that cannot be read."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
from pathlib import Path
from typing import Any

from PIL import Image

from devtools.fakes import FakeToolbox, Harness
from worker.engine.tokenizer import ChatTokenizer
from worker.engine.vllm import tool_support
from worker.session import (
    ImageRef,
    Progress,
    StoredImage,
    ToolCall,
    ToolResultMessage,
    Turn,
    UserMessage,
    WorkerCallRecord,
    assistant_message,
)
from worker.store.port import decode_progress, encode_progress
from worker.store.sqlite import SqliteStore
from worker.tools.port import WorkerTool

CAMERA = WorkerTool("door_camera", "A snapshot of the front door", None, ("*",), source="mcp")


def png(color: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 6), color).save(out, "PNG")
    return out.getvalue()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def redeliver(tmp_path: Path, tokenizer: ChatTokenizer, progress: str, payload: dict[str, Any]) -> Harness:
    """A worker restarted on the database that holds ``progress`` for request r1, which the
    broker delivers again."""
    store = SqliteStore(tmp_path)
    store.save_progress("u/s", "r1", progress)
    box = FakeToolbox(CAMERA)
    h = Harness(tools=tool_support("auto", tokenizer, "tiny"), toolbox=box, vision_engine=True, store=store)
    h.engine.rounds["r1"] = ["Nobody."]

    async def scenario() -> None:
        h.transport.deliver("chat/u/s/request", {**payload, "requestId": "r1", "workerTools": ["*"]})
        await h.run_until(lambda: len(h.transport.replies("s")) == 1)

    asyncio.run(scenario())
    assert not box.calls  # nothing is called again
    return h


def test_a_progress_without_its_requests_image_bytes_goes_on(tmp_path: Path, tokenizer: ChatTokenizer) -> None:
    """Stored while a progress held its turn's image references but not their bytes: the
    redelivered request brings its image again, and the loop goes on from the progress."""
    door = png((200, 30, 30))
    turn = Turn("r1", [UserMessage("anyone?", (ImageRef(sha(door), "image/png"),))])
    turn.messages.append(assistant_message("", [ToolCall("call_1", "door_camera", {})]))
    stored = json.loads(encode_progress(Progress(turn, {})))
    assert "images" not in stored  # the older form: no bytes
    payload = {
        "message": [{"type": "image_url", "image_url": {"url": data_url(door)}}, {"type": "text", "text": "anyone?"}]
    }
    h = redeliver(tmp_path, tokenizer, json.dumps(stored), payload)
    (reply,) = h.transport.replies("s")
    assert reply.get("reply") == "Nobody.", reply
    assert [[i.uuid for i in r.images] for r in h.engine.requests] == [[sha(door)]]
    (kept,) = h.service.sessions.get("u/s").turns
    assert [ref.sha256 for ref in kept.images()] == [sha(door)]
    assert h.service.sessions.get("u/s").images[sha(door)].data == door


def test_a_progress_whose_tool_image_bytes_are_lost_is_answered(tmp_path: Path, tokenizer: ChatTokenizer) -> None:
    """A tool's image that an older worker's progress named without its bytes cannot be sent
    again (the call is never made twice): the request gets session_unreadable, not silence,
    and a reset (which deletes the progress) starts the session over. With the bytes in the
    progress, as stored now, the same redelivery answers."""
    snap = png((10, 200, 10))
    turn = Turn("r1", [UserMessage("anyone?")])
    turn.messages.append(assistant_message("", [ToolCall("call_1", "door_camera", {})]))
    turn.messages.append(ToolResultMessage("call_1", "door_camera", "[image/png]", (ImageRef(sha(snap), "image/png"),)))
    progress = Progress(turn, {"call_1": WorkerCallRecord("ok", 4.0, 0)}, {sha(snap): StoredImage(snap, "image/png")})
    older = json.loads(encode_progress(progress))
    del older["images"]
    h = redeliver(tmp_path / "older", tokenizer, json.dumps(older), {"message": "anyone?"})
    (reply,) = h.transport.replies("s")
    assert reply["error"]["code"] == "session_unreadable" and "reset" in reply["error"]["message"]

    async def reset() -> None:
        h.transport.deliver("chat/u/s/control", {"action": "reset", "requestId": "x"})
        await h.run_until(lambda: len(h.transport.replies("s")) == 2)

    asyncio.run(reset())
    assert h.service.sessions.store.load_progress("u/s", "r1") is None
    h = redeliver(tmp_path / "now", tokenizer, encode_progress(progress), {"message": "anyone?"})
    (reply,) = h.transport.replies("s")
    assert reply.get("reply") == "Nobody.", reply
    assert [[i.uuid for i in r.images] for r in h.engine.requests] == [[sha(snap)]]


def test_an_older_workers_progress_decodes() -> None:
    """One stored before images (string contents, no images key) and one naming images
    without their bytes: both read, their turns as they were."""
    before_images = {
        "turnKey": "k",
        "messages": [
            {"role": "user", "content": "open the door"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "door", "arguments": {"open": True}}}
                ],
            },
        ],
        "calls": {"call_1": {"outcome": "ok", "durationMs": 3.0, "round": 0}},
    }
    read = decode_progress("u/s", json.dumps(before_images))
    assert read.turn.pending_calls()[0].name == "door" and read.images == {} and read.calls["call_1"].round == 0
    door = ImageRef("d" * 64, "image/jpeg", 4)
    turn = Turn("k", [UserMessage("look here", (door,))])
    read = decode_progress("u/s", encode_progress(Progress(turn, {})))
    assert read.turn == turn and read.turn.images() == [door] and read.images == {}
