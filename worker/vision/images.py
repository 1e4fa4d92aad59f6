"""An image's bytes decoded to the pixels a vision model's engine takes, within bounds.

The only module that imports Pillow. No I/O: bytes in, pixels out. Decoding is CPU work of
up to a second for a large image, so callers run it off the event loop (``decode_off_loop``,
or ``asyncio.to_thread``): the loop must keep streaming replies meanwhile.

What is refused, each with an ImageDecodeError that names the image and says why:

- bytes of no format in ``FORMATS`` (JPEG, PNG, GIF, WebP, BMP: what cameras, browsers and
  tools send), whatever their name or declared type says: Pillow is told to try only those,
  so none of its other, rarely used parsers ever sees a request's bytes;
- more than ``max_pixels`` pixels (width x height), read from the header before any pixel is
  decoded: a decompression bomb (a few KB of PNG that inflate to gigabytes) is refused by its
  header, and Pillow's own bomb check (past 2 x 89 MP) is caught the same way;
- a side longer than 200 times the other (Qwen2-VL's and Qwen3-VL's processors refuse such an
  image with an error from inside the engine);
- truncated or corrupt data: Pillow decodes lazily, so everything is decoded here, where a
  broken file fails, not later inside the engine.

Animated GIF and WebP: the first frame. EXIF orientation is applied (a phone's JPEG stands as
its camera showed it), and transparency is laid over white (as vLLM's and transformers' RGB
conversions do), so the engine gets RGB pixels whatever the file held.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageOps, UnidentifiedImageError

# Pillow's format names, in the order it tries them.
FORMATS = ("JPEG", "PNG", "GIF", "WEBP", "BMP")
FORMAT_WORDS = "JPEG, PNG, GIF, WebP or BMP"
# The worker's bound when none is given: 100 megapixels is past any camera's snapshot and
# phone photo (50 MP sensors), and 300 MB as RGB once decoded.
DEFAULT_MAX_PIXELS = 100_000_000
MAX_ASPECT_RATIO = 200  # Qwen2-VL's and Qwen3-VL's processors (smart_resize) refuse more


class ImageDecodeError(ValueError):
    """An image that cannot be decoded within the bounds; the message names it and says why
    (for the client: invalid_request)."""


@dataclass(frozen=True)
class DecodedImage:
    """An image's pixels, in RGB and fully loaded, and what identifies it.

    ``sha256``: the hash of the bytes as sent, the image's identifier in the session's store
    and for the engine's caches (engine/port.py EngineImage.uuid): the same bytes sent again
    are the same image."""

    pixels: Any  # PIL.Image.Image, mode RGB
    width: int
    height: int
    format: str  # one of FORMATS
    sha256: str

    def __repr__(self) -> str:  # never the pixels
        return f"DecodedImage({self.format}, {self.width}x{self.height}, {self.sha256[:12]})"


def decode_image(
    data: bytes, *, where: str = "image", max_pixels: int = DEFAULT_MAX_PIXELS, sha256: str | None = None
) -> DecodedImage:
    """Decode ``data`` (the bytes of one image file) within the bounds above; ``where`` names
    it in the error ("message.1", "images.0"); ``sha256``: its hash where the caller has it."""
    if not data:
        raise ImageDecodeError(f"'{where}' is empty")
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as opened:
            width, height = opened.size
            if width < 1 or height < 1:
                raise ImageDecodeError(f"'{where}' has no pixels ({width}x{height})")
            if width * height > max_pixels:
                raise ImageDecodeError(
                    f"'{where}' is {width}x{height} pixels ({width * height / 1e6:.1f} MP): at most "
                    f"{max_pixels / 1e6:g} MP are accepted"
                )
            if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
                raise ImageDecodeError(
                    f"'{where}' is {width}x{height} pixels: one side is more than {MAX_ASPECT_RATIO} times the other"
                )
            image_format = str(opened.format)
            opened.seek(0)  # the first frame of an animation
            opened.load()
            pixels = _rgb(ImageOps.exif_transpose(opened))
    except ImageDecodeError:
        raise
    except Image.DecompressionBombError as exc:  # Pillow's own bound (2 x MAX_IMAGE_PIXELS)
        raise ImageDecodeError(f"'{where}' has too many pixels: {exc}") from None
    except UnidentifiedImageError:
        raise ImageDecodeError(f"'{where}' is not a {FORMAT_WORDS} image") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:  # truncated, corrupt: Pillow's words
        raise ImageDecodeError(f"'{where}' is truncated or corrupt ({str(exc)[:120] or type(exc).__name__})") from None
    digest = sha256 if sha256 is not None else hashlib.sha256(data).hexdigest()
    return DecodedImage(pixels, pixels.width, pixels.height, image_format, digest)


def _rgb(image: Any) -> Any:
    """RGB pixels of a loaded image of any mode: transparency laid over white."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


async def decode_off_loop(
    images: Sequence[tuple[bytes, str]], *, max_pixels: int = DEFAULT_MAX_PIXELS
) -> list[DecodedImage]:
    """Decode ``(data, where)`` pairs in order on a worker thread (never on the event loop);
    the first that fails raises its ImageDecodeError."""

    def run() -> list[DecodedImage]:
        return [decode_image(data, where=where, max_pixels=max_pixels) for data, where in images]

    return await asyncio.to_thread(run)
