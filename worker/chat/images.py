"""Image files the terminal client sends with a message (``--image FILE``, ``/image FILE``):
read and checked here, so that a wrong file is said before anything is sent."""

from __future__ import annotations

from pathlib import Path

from ..config.models import VisionConfig
from ..protocol.images import FORMATS, sniff_media_type

# What fits the worker's default vision.max_request_bytes once base64 (4/3) and the JSON
# around it are added.
MAX_IMAGE_FILE_BYTES = VisionConfig().max_request_bytes * 3 // 4 - 4096


def read_image(path: str) -> bytes:
    """The file's bytes; ValueError, saying why, for a file that cannot be read, is not an image
    of a format the worker takes, or is larger than a request with images may be by default."""
    file = Path(path).expanduser()
    try:
        size = file.stat().st_size
        if size > MAX_IMAGE_FILE_BYTES:
            raise ValueError(
                f"{path} is {size} bytes; a request with images may be {MAX_IMAGE_FILE_BYTES} bytes of image "
                "(the worker's default vision.max_request_bytes, base64 included): make it smaller"
            )
        data = file.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    if sniff_media_type(data) is None:
        raise ValueError(f"{path} is not a {FORMATS} image")
    return data
