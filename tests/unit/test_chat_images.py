"""Images from the terminal client: ``/image FILE`` attaches a file to the next message,
``--image FILE`` to the one-shot message (or the first interactive one); a file that is not an
image, or cannot be read, is said before anything is sent (no broker: the client's own rules;
the one-shot client's request on a real broker: tests/broker/test_chat_one_shot_images.py)."""

from __future__ import annotations

import argparse
import io
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from devtools.fakes import Sent
from worker.chat.cli import main
from worker.chat.images import MAX_IMAGE_FILE_BYTES, read_image
from worker.chat.terminal import InputLine, Terminal, usage_line
from worker.protocol.messages import ChatReply, Latency, Usage


def image_file(path: Path, fmt: str = "PNG") -> Path:
    Image.new("RGB", (12, 8), (0, 90, 200)).save(path, fmt)
    return path


def terminal(**flags: Any) -> tuple[Terminal, io.StringIO, Sent]:
    out = io.StringIO()
    args = argparse.Namespace(
        **{"show_stats": False, "show_reasoning": False, "timeout": 120.0, "max_tokens": None, **flags}
    )
    args.temperature = args.system_prompt = None
    term = Terminal(client=None, args=args, out=out)  # type: ignore[arg-type]
    sent = Sent()
    term.client = sent  # type: ignore[assignment]
    term.started = True
    return term, out, sent


def test_slash_image_attaches_a_file_to_the_next_message_only(tmp_path: Path) -> None:
    picture = image_file(tmp_path / "Door.PNG")  # the name as typed: not lowercased
    term, out, sent = terminal()
    term.handle(InputLine(f"/image {picture}"))
    assert f"[{picture} ({picture.stat().st_size} bytes) goes with your next message]" in out.getvalue()
    term.handle(InputLine("Who is at the door?"))
    assert sent.requests[0]["message"] == "Who is at the door?"
    assert sent.requests[0]["images"] == [picture.read_bytes()]
    term.pending = None  # answered
    term.handle(InputLine("And now?"))
    assert "images" not in sent.requests[1]


def test_slash_image_refuses_what_is_not_an_image_and_alone_drops_the_attached(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a picture")
    term, out, sent = terminal()
    term.handle(InputLine(f"/image {text}"))
    assert f"[{text} is not a JPEG, PNG, GIF, WebP or BMP image]" in out.getvalue()
    term.handle(InputLine(f"/image {tmp_path / 'missing.jpg'}"))
    assert "cannot read" in out.getvalue() and "No such file" in out.getvalue()
    term.handle(InputLine(f"/image {image_file(tmp_path / 'a.jpg', 'JPEG')}"))
    term.handle(InputLine("/image"))
    assert "[dropped 1 attached image(s)]" in out.getvalue()
    term.handle(InputLine("hello"))
    assert "images" not in sent.requests[0]
    assert "/image FILE" in term_help(term, out)


def term_help(term: Terminal, out: io.StringIO) -> str:
    term.handle(InputLine("/help"))
    return out.getvalue()


def test_image_flag_attaches_to_the_first_interactive_message(tmp_path: Path) -> None:
    picture = image_file(tmp_path / "cat.gif", "GIF")
    term, _, sent = terminal(images=[(str(picture), picture.read_bytes())])
    term.handle(InputLine("What is this?"))
    assert sent.requests[0]["images"] == [picture.read_bytes()]


def test_a_file_too_large_is_refused_before_it_is_read(tmp_path: Path) -> None:
    big = tmp_path / "big.jpg"
    with big.open("wb") as f:
        f.truncate(MAX_IMAGE_FILE_BYTES + 1)
    with pytest.raises(ValueError, match="make it smaller"):
        read_image(str(big))


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--image", "{text}", "--message", "hi"], "is not a JPEG, PNG"),
        (["--image", "/nonexistent/x.png", "--message", "hi"], "cannot read /nonexistent/x.png"),
        (["--image", "{png}", "--session", "s1", "--tool-result", "c1=x"], "--image goes with a message"),
    ],
)
def test_image_flags_that_cannot_be_used_exit_2_before_connecting(
    args: list[str], problem: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "t.txt"
    text.write_text("hello")
    png = image_file(tmp_path / "p.png")
    argv = [arg.replace("{text}", str(text)).replace("{png}", str(png)) for arg in args]
    assert main([*argv, "--mqtt-port", "1"], environ={}) == 2
    assert problem in capsys.readouterr().err


def test_the_usage_line_counts_image_tokens_when_there_are_some() -> None:
    def line(image_tokens: int | None) -> str:
        usage = Usage(prompt_tokens=400, completion_tokens=6, cached_tokens=96, image_tokens=image_tokens)
        latency = Latency(queue_ms=1, ttft_ms=50, total_ms=900)
        return usage_line(
            ChatReply(session_id="s", request_id="r", reply="x", finish_reason="stop", usage=usage, latency=latency)
        )

    assert line(380).startswith("prompt 400 tokens (96 cached, 380 of images), reply 6 tokens")
    assert line(None).startswith("prompt 400 tokens (96 cached), reply 6 tokens")
