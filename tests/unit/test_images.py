"""worker/vision/images.py: an image's bytes decoded within bounds, or refused with words that
name the image and the reason."""

from __future__ import annotations

import asyncio
import hashlib
import io
import struct
import zlib

import pytest
from PIL import Image

from worker.vision.images import DecodedImage, ImageDecodeError, decode_image, decode_off_loop


def encoded(image: Image.Image, fmt: str, **kwargs: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **kwargs)
    return out.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims ``width`` x ``height`` pixels in a few dozen bytes (a bomb's header)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "GIF", "WEBP", "BMP"])
def test_every_accepted_format_decodes_to_rgb(fmt: str) -> None:
    data = encoded(Image.new("RGB", (40, 30), (200, 30, 30)), fmt)
    image = decode_image(data, where="images.0")
    assert isinstance(image, DecodedImage)
    assert (image.width, image.height, image.format, image.pixels.mode) == (40, 30, fmt, "RGB")
    assert image.sha256 == hashlib.sha256(data).hexdigest()


def test_transparency_is_laid_over_white() -> None:
    data = encoded(Image.new("RGBA", (8, 8), (0, 0, 0, 0)), "PNG")
    assert decode_image(data).pixels.getpixel((0, 0)) == (255, 255, 255)


def test_exif_orientation_is_applied() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90° clockwise: a portrait photo stored sideways
    data = encoded(Image.new("RGB", (60, 20)), "JPEG", exif=exif)
    image = decode_image(data)
    assert (image.width, image.height) == (20, 60)


def test_the_first_frame_of_an_animation() -> None:
    frames = [Image.new("RGB", (10, 10), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    pixel = decode_image(out.getvalue()).pixels.getpixel((5, 5))
    assert pixel[0] > 200 and pixel[2] < 50, pixel


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"", "is empty"),
        (b"hello, not an image", "not a JPEG, PNG, GIF, WebP or BMP image"),
        (encoded(Image.new("RGB", (8, 8)), "TIFF"), "not a JPEG, PNG, GIF, WebP or BMP image"),
        (b"%PDF-1.4\n" + b"0" * 100, "not a JPEG"),
    ],
)
def test_what_is_not_an_accepted_image_is_refused(data: bytes, words: str) -> None:
    with pytest.raises(ImageDecodeError, match=r"'message\.1'") as caught:
        decode_image(data, where="message.1")
    assert words in str(caught.value)


def test_a_truncated_image_is_refused() -> None:
    data = encoded(Image.effect_noise((256, 256), 60).convert("RGB"), "JPEG")
    with pytest.raises(ImageDecodeError, match="truncated or corrupt"):
        decode_image(data[: len(data) // 2])
    png = encoded(Image.effect_noise((256, 256), 60).convert("RGB"), "PNG")
    with pytest.raises(ImageDecodeError, match="truncated or corrupt"):
        decode_image(png[: len(png) // 2])


@pytest.mark.parametrize(
    ("width", "height", "words"),
    [
        # 120 MP: over the worker's bound, under Pillow's own (179 MP)
        (12_000, 10_000, r"12000x10000 pixels \(120.0 MP\): at most 100 MP"),
        # 2.5 GP (7.5 GB as RGB): Pillow's own bomb check refuses it first
        (50_000, 50_000, "too many pixels"),
    ],
)
def test_a_decompression_bomb_is_refused_by_its_header(width: int, height: int, words: str) -> None:
    """A PNG header that claims a huge image, in under 200 bytes: refused before a pixel is
    decoded (decoding it would take minutes and gigabytes)."""
    data = png_header_only(width, height)
    assert len(data) < 200
    with pytest.raises(ImageDecodeError, match=words):
        decode_image(data, max_pixels=100_000_000)


def test_the_pixel_bound_is_the_callers() -> None:
    data = encoded(Image.new("RGB", (200, 100)), "PNG")
    assert decode_image(data, max_pixels=20_000).width == 200
    with pytest.raises(ImageDecodeError, match=r"200x100 pixels \(0.0 MP\): at most 0.019999 MP"):
        decode_image(data, max_pixels=19_999)


def test_an_extreme_aspect_ratio_is_refused() -> None:
    with pytest.raises(ImageDecodeError, match="more than 200 times"):
        decode_image(encoded(Image.new("RGB", (1000, 4)), "PNG"))


def test_decoding_runs_off_the_event_loop() -> None:
    import threading

    seen: list[str] = []
    original = decode_image

    async def main() -> list[DecodedImage]:
        loop_thread = threading.current_thread().name
        images = await decode_off_loop([(encoded(Image.new("RGB", (4, 4)), "PNG"), "images.0")])
        seen.append(loop_thread)
        return images

    import worker.vision.images as module

    def spy(*args: object, **kwargs: object) -> DecodedImage:
        seen.append(threading.current_thread().name)
        return original(*args, **kwargs)  # type: ignore[arg-type]

    module.decode_image = spy  # type: ignore[assignment]
    try:
        images = asyncio.run(main())
    finally:
        module.decode_image = original
    assert len(images) == 1 and seen[0] != seen[1], seen
