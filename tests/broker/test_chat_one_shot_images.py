"""``python -m worker.chat --image FILE --message ...`` on a real mosquitto: the request it
publishes carries the file as Ollama's ``images`` (base64), which the worker's own parser
takes back to the file's bytes. A pretend worker (a retained ``online`` status, and a plain
MQTT client that answers) stands in for one, as in test_chat_one_shot.py."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from devtools.chat_terminal import run_chat
from devtools.mosquitto import Mosquitto
from devtools.mqtt_client import Client
from devtools.mqtt_client import pretend_worker as pretend_worker_on
from worker.protocol.images import ImageLimits
from worker.protocol.messages import parse_chat_request

PREFIX = "chatimages"


@pytest.fixture
def pretend_worker(broker: Mosquitto) -> Iterator[Client]:
    with pretend_worker_on(broker.port, PREFIX) as watch:
        yield watch


def test_the_one_shot_client_sends_its_images_with_the_message(
    broker: Mosquitto, pretend_worker: Client, tmp_path: Path
) -> None:
    door, garden = tmp_path / "door.jpg", tmp_path / "garden.png"
    Image.new("RGB", (64, 48), (120, 60, 30)).save(door, "JPEG")
    Image.new("RGB", (16, 16), (0, 160, 0)).save(garden, "PNG")
    session = "s-image"
    done: dict[str, subprocess.CompletedProcess[str]] = {}
    command = ["--topic-prefix", PREFIX, "--session", session, "--message", "What do you see?"]
    command += ["--image", str(door), "--image", str(garden)]
    thread = threading.Thread(target=lambda: done.setdefault("run", run_chat(broker.port, *command)))
    thread.start()
    try:
        message = pretend_worker.wait_for(lambda m: m.topic == f"{PREFIX}/anon/{session}/request", timeout=60)
        request = json.loads(message.payload)
        pretend_worker.publish(
            f"{PREFIX}/anon/{session}/reply",
            {
                "sessionId": session,
                "requestId": request["requestId"],
                "reply": "A door and a garden.",
                "finishReason": "stop",
                "usage": {"promptTokens": 400, "completionTokens": 6, "cachedTokens": 0, "imageTokens": 380},
                "latency": {"queueMs": 1.0, "ttftMs": 50.0, "totalMs": 900.0},
            },
        )
    finally:
        thread.join(120)
    run = done["run"]
    assert run.returncode == 0, run.stderr
    assert run.stdout == "A door and a garden.\n"
    assert request["message"] == "What do you see?"
    parsed = parse_chat_request(message.payload, session, 65536, ImageLimits(4 << 20, 4))
    assert [(i.data, i.media_type) for i in parsed.image_inputs] == [
        (door.read_bytes(), "image/jpeg"),
        (garden.read_bytes(), "image/png"),
    ]
