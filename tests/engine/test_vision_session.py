"""Images through the service on the real CPU engine and the tiny Qwen2-VL: a client's image
stored with its turn and re-sent with its hash on the next turn (the prefix cache covers it),
the image tokens in the usage, and a restart on SQLite that keeps the image."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from devtools.fakes import MemoryTransport
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


def test_an_image_is_kept_resent_cached_and_survives_a_restart(tmp_path: Path) -> None:
    from worker.engine.vllm import VllmEngine

    model = generate_tiny_vision_model(tmp_path / "vl")
    config = WorkerConfig.model_validate(
        {"engine": {"model": str(model)}, "mqtt": {"worker_id": "t"}, "limits": {"max_payload_bytes": 4096}}
    )

    async def scenario() -> list[dict[str, Any]]:
        engine_config, settings = tiny_engine_settings(model)
        engine = await VllmEngine.start(engine_config, stop_token_ids=[], progress_bars=False, vision=settings)
        renderer = ChatTokenizer(str(model))
        transport = MemoryTransport()
        replies: list[dict[str, Any]] = []
        try:
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
                    engine,
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
            replies = transport.replies("s")
        finally:
            await engine.shutdown()
        return replies

    first, second, third = asyncio.run(scenario())
    assert all("error" not in r for r in (first, second, third)), (first, second, third)
    image_tokens = first["usage"]["imageTokens"]
    assert image_tokens == 54  # 300x200 scaled to 252x168 at MAX_PIXELS: 9x6 tokens
    assert second["usage"]["imageTokens"] == third["usage"]["imageTokens"] == image_tokens
    # The second turn's cached prefix covers the first turn's prompt, image included.
    assert second["usage"]["cachedTokens"] >= first["usage"]["promptTokens"] - BLOCK_SIZE
    assert third["usage"]["cachedTokens"] >= second["usage"]["promptTokens"] - BLOCK_SIZE
