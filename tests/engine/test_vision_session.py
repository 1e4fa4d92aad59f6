"""Images through the service on the real CPU engine and the tiny Qwen2-VL: a client's image
stored with its turn and re-sent with its hash on the next turn (the prefix cache covers it),
the image tokens in the usage, and a restart on SQLite that keeps the image; the tools demo's
door camera (devtools/devices.py on a real mosquitto, a [[tools.mqtt]] tool of the in-process
worker) whose snapshot the loop's next generation sees. One engine start for the module."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from devtools.devices import SimulatedDevices, door_snapshot
from devtools.fakes import MemoryTransport
from devtools.inproc import LiveWorker
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from devtools.tinyvision import TEST_MAX_PIXELS, generate_tiny_vision_model, tiny_engine_settings
from devtools.worker_process import BLOCK_SIZE
from worker.config.models import WorkerConfig
from worker.core.service import Service
from worker.engine.tokenizer import ChatTokenizer
from worker.store.sqlite import SqliteStore
from worker.wiring import image_decoder

pytestmark = pytest.mark.e2e

MAX_PIXELS = TEST_MAX_PIXELS
QUESTION = "Is anyone at the door? Look at the picture of the front door camera and say who is there, if anyone."


def jpeg() -> bytes:
    pixels = np.random.default_rng(7).integers(0, 255, (200, 300, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG")
    return out.getvalue()


class EngineLoop:
    """The engine started on an event loop in a thread: the module's tests share one start
    (vLLM's AsyncLLM stays on the loop it started on, so each test runs its worker there)."""

    def __init__(self, model: Path) -> None:
        from worker.engine.vllm import VllmEngine

        self.model = model
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config, settings = tiny_engine_settings(model)
        self.engine = self.run(VllmEngine.start(config, stop_token_ids=[], progress_bars=False, vision=settings))

    def run(self, coroutine: Any, timeout: float = 600) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self.engine.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineLoop]:
    started = EngineLoop(generate_tiny_vision_model(tmp_path_factory.mktemp("vl")))
    try:
        yield started
    finally:
        started.close()


def test_an_image_is_kept_resent_cached_and_survives_a_restart(engine: EngineLoop, tmp_path: Path) -> None:
    model = engine.model
    config = WorkerConfig.model_validate(
        {"engine": {"model": str(model)}, "mqtt": {"worker_id": "t"}, "limits": {"max_payload_bytes": 4096}}
    )

    async def scenario() -> list[dict[str, Any]]:
        renderer = ChatTokenizer(str(model))
        transport = MemoryTransport()
        for start, payloads in enumerate(
            [
                [
                    {
                        "message": [
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(jpeg()).decode()},
                            },
                            {"type": "text", "text": QUESTION},
                        ]
                    },
                    {"message": "And now?"},
                ],
                [{"message": "And after the restart?"}],
            ]
        ):
            store = SqliteStore(tmp_path / "store")
            service = Service(
                config,
                engine.engine,
                renderer,
                transport,
                lambda code: None,
                store,
                decode_image=image_decoder(config.vision.max_image_pixels),
            )
            consumer = asyncio.ensure_future(service.consume())
            for index, payload in enumerate(payloads):
                before = len(transport.replies("s"))
                transport.deliver("chat/u/s/request", {**payload, "maxTokens": 4, "requestId": f"r{start}{index}"})
                while len(transport.replies("s")) == before:
                    await asyncio.sleep(0.05)
            consumer.cancel()
            store.close()
        return transport.replies("s")

    first, second, third = engine.run(scenario())
    assert all("error" not in r for r in (first, second, third)), (first, second, third)
    image_tokens = first["usage"]["imageTokens"]
    assert image_tokens == 54  # 300x200 scaled to 252x168 at MAX_PIXELS: 9x6 tokens
    assert second["usage"]["imageTokens"] == third["usage"]["imageTokens"] == image_tokens
    # The second turn's cached prefix covers the first turn's prompt, image included.
    assert second["usage"]["cachedTokens"] >= first["usage"]["promptTokens"] - BLOCK_SIZE
    assert third["usage"]["cachedTokens"] >= second["usage"]["promptTokens"] - BLOCK_SIZE


def test_the_door_cameras_snapshot_is_seen_by_the_next_generation(engine: EngineLoop, broker: Mosquitto) -> None:
    """The tools demo's "Is anyone at the door?" on a vision model: the forced door_camera call
    goes to the simulated camera over the broker, which answers its JPEG (Content Type
    image/jpeg); the generation after the call has the picture in its prompt (its image tokens
    in the usage), and the session keeps it by its hash, with the tool's result."""
    from worker.engine.vllm import tool_support

    prefix = f"cam{uuid.uuid4().hex[:6]}"
    renderer = ChatTokenizer(str(engine.model))
    # No arguments, and none allowed: the random model's forced call is then short.
    nothing = {"type": "object", "properties": {}, "additionalProperties": False}
    camera = {
        "name": "door_camera",
        "description": "A snapshot of the front door",
        "parameters": nothing,
        "users": ["*"],
    }
    devices = SimulatedDevices(port=broker.port, prefix=prefix)
    devices.start()
    live = LiveWorker(
        broker.port,
        engine=engine.engine,
        loop=engine.loop,
        renderer=renderer,
        tool_support=tool_support("auto", renderer, "tiny-vl"),
        tools={"mqtt": [camera | {"topic": f"{prefix}/camera/snapshot"}]},
    )
    client = Client(broker.port, [live.topic("u", "door", "reply")])
    try:
        # A random model calls a tool only when forced: the first generation writes the call.
        client.publish(
            live.topic("u", "door"),
            {
                "requestId": "d1",
                "message": "Is anyone at the door?",
                "workerTools": ["*"],
                "toolChoice": {"type": "function", "function": {"name": "door_camera"}},
                "maxTokens": 48,  # the call's markup (the reply after it runs to maxTokens too)
                "temperature": 0,
            },
        )
        reply = client.wait_topic(live.topic("u", "door", "reply"), 300).json()
        stored = live.call(lambda: dict(live.service.sessions.get("u/door").images))
    finally:
        client.close()
        live.close()
        devices.stop()
    jpeg = door_snapshot()
    assert "error" not in reply, reply
    (call,) = reply["workerCalls"]
    assert (call["name"], call["outcome"], call["result"]) == ("door_camera", "ok", f"[image/jpeg, {len(jpeg)} bytes]")
    assert [c["topic"] for c in devices.calls] == [f"{prefix}/camera/snapshot"]
    # The first generation's prompt had no image, the second the snapshot: 320x240 scaled to
    # 252x168 at MAX_PIXELS, 9x6 tokens.
    assert reply["usage"]["imageTokens"] == 54, reply
    first, second = reply["rounds"]
    assert second["promptTokens"] - first["promptTokens"] > 54
    assert list(stored) == [hashlib.sha256(jpeg).hexdigest()] and stored[hashlib.sha256(jpeg).hexdigest()].data == jpeg
